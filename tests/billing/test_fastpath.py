"""The ingest fast path takes exactly the batches whose every field has the kind's type."""

from __future__ import annotations

from typing import Any

import orjson
import polars as pl
import pytest

from billing.fastpath import ndjson_frame, typed_frame
from infermeter.records import KINDS
from infermeter.wire import line_count
from tests.billing.conftest import ndjson, usage

USAGE = KINDS["usage"]


def test_a_shipper_batch_becomes_typed_columns():
    """Records as the sidecar writes them: every column with its SQL type, defaults filled in."""
    frame = typed_frame(USAGE, [usage(), usage(received_at=1790812800, finished_at=1790812900)])
    assert frame is not None
    assert frame.schema["received_at"] == pl.Float64
    assert frame.schema["prompt_tokens"] == pl.Int64
    assert frame["endpoint"].to_list() == ["/v1/chat/completions"] * 2
    assert frame["usage_exact"].to_list() == [True, True]


@pytest.mark.parametrize(
    "odd",
    [
        {"prompt_tokens": "1"},
        {"prompt_tokens": 1.5},
        {"prompt_tokens": True},
        {"team": None},
        {"colour": "red"},
    ],
)
def test_any_deviation_sends_the_batch_to_the_per_record_path(odd: dict[str, Any]) -> None:
    """One record off type, null, or with an extra key: no fast path (and nothing coerced)."""
    assert typed_frame(USAGE, [usage(), usage() | odd]) is None


def test_records_with_different_keys_take_the_per_record_path():
    """A record missing a key the first one has is not filled in silently."""
    short = {k: v for k, v in usage().items() if k != "replica"}
    assert typed_frame(USAGE, [usage(), short]) is None
    assert typed_frame(USAGE, [7]) is None


def test_shipper_ndjson_becomes_typed_columns():
    """A spool segment's lines, as the shipper sends them: typed columns, numbered in order."""
    first, second = usage(), usage(received_at=1790812800, finished_at=1790812900)
    frame = ndjson_frame(USAGE, ndjson([first, second, first]))
    assert frame is not None
    assert frame.schema["received_at"] == pl.Float64
    assert frame.schema["prompt_tokens"] == pl.Int64
    assert frame["received_at"].to_list()[1] == 1790812800.0
    assert frame["pos"].to_list() == [1, 2, 3]
    assert frame["dup"].to_list() == [False, False, True]


@pytest.mark.parametrize(
    "odd",
    [
        {"prompt_tokens": "1"},
        {"prompt_tokens": 1.5},
        {"prompt_tokens": 1.0},
        {"prompt_tokens": True},
        {"received_at": "1790812800"},
        {"stream": 1},
        {"team": None},
        {"colour": "red"},
        {"endpoint": None},
    ],
)
def test_any_ndjson_deviation_sends_the_batch_to_the_per_record_path(odd: dict[str, Any]) -> None:
    """Off type, null, or an extra key in one line: no fast path, and nothing coerced."""
    assert ndjson_frame(USAGE, ndjson([usage(), usage() | odd])) is None


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (ndjson([usage()]) + b"\n" + ndjson([usage()]), "a blank line"),
        (orjson.dumps(usage()) + orjson.dumps(usage()) + b"\n", "two records on one line"),
        (orjson.dumps(usage(), option=orjson.OPT_INDENT_2) + b"\n", "one record over many lines"),
        (ndjson([usage()]) + b"42\n", "a line that is not an object"),
        (ndjson([usage()]) + b'{"request_id": "\xff"}\n', "invalid UTF-8"),
        (ndjson([usage()]) + b"{oops\n", "a line that is not JSON"),
        (b"", "an empty body"),
    ],
)
def test_ndjson_that_is_not_one_record_a_line_takes_the_per_record_path(
    body: bytes, why: str
) -> None:
    """Arrow's reader is lenient about framing; the fast path is not."""
    assert ndjson_frame(USAGE, body) is None, why


def test_absent_fields_with_defaults_take_the_per_record_path():
    """An absent field reads as null to Arrow; only the per-record path tells absent from null."""
    short = {k: v for k, v in usage().items() if k != "endpoint"}
    assert ndjson_frame(USAGE, ndjson([short])) is None
    nullable = {k: v for k, v in usage().items() if k != "finish_reason"}
    frame = ndjson_frame(USAGE, ndjson([nullable]))
    assert frame is not None
    assert frame["finish_reason"].to_list() == [None]


def test_line_count_counts_a_last_line_without_newline():
    """The batch limit counts records the way the per-record path splits them."""
    assert [line_count(b""), line_count(b"a\n"), line_count(b"a\nb"), line_count(b"a\n\n")] == [
        0,
        1,
        2,
        2,
    ]
