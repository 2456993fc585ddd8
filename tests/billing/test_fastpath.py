"""The ingest fast path takes exactly the batches whose every field has the kind's type."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from billing.fastpath import typed_frame
from billing.ingest_sql import KINDS
from tests.billing.conftest import usage

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
