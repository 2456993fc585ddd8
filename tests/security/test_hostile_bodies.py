"""Ingest bodies built to crash the readers: each is refused with a reason, and the process lives.

pyarrow's readers trust their input more than billing may: its JSON reader faults on a body that
starts with ``null``, and an IPC stream is read without checking its offsets. Each case runs in
a child process, so a crash fails its test instead of ending the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from tests.billing.conftest import OCT, gpu_samples, usage
from tests.servers import serving

INGEST = "im-demo-ingest"

HEADER = textwrap.dedent(
    """
    import json, random, sys
    import pyarrow as pa
    from billing.fastpath import arrow_frame, ndjson_frame
    from billing.ledger import Ledger
    from infermeter.errors import BadRequest
    from infermeter.records import USAGE
    from infermeter.wire import decode_arrow, encode_arrow
    from tests.billing.conftest import NOV, ndjson, usage
    """
)


def _survives(script: str) -> str:
    """Run ``script`` after HEADER in a child; its stdout, once it has exited normally."""
    done = subprocess.run(
        [sys.executable, "-c", HEADER + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("body", [b"null", b"null\n", b'null\r[ "team"', b"{}\rnull", b" null"])
def test_ndjson_that_faults_arrows_json_reader_is_named_line_by_line(body: bytes) -> None:
    """The per-record path names line 1; the fast path never hands such a body to Arrow."""
    out = _survives(
        f"""
        ledger = Ledger.open(":memory:", ["search"], {{}})
        result = ledger.ingest_lines("usage", {body!r}, now=NOV)
        print(result.accepted, len(result.rejected), result.rejected[0].id)
        print(ndjson_frame(USAGE, {body!r}))
        """
    )
    assert out.split()[:3] == ["0", "1", "#1"]
    assert out.split()[3:] == ["None"]


def test_an_arrow_stream_with_offsets_outside_its_data_is_refused() -> None:
    """A string column whose offsets run past its bytes: 400's ValueError, not a read out of bounds."""
    out = _survives(
        """
        # A team name of 13 bytes, written uncompressed: its offsets buffer is (0, 13); the end
        # offset becomes 2**30.
        table = decode_arrow(USAGE, encode_arrow(USAGE, ndjson([usage(team="thirteenbytes")])))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        body = sink.getvalue().to_pybytes()
        offsets = bytes(4) + (13).to_bytes(4, "little") + b"thirteenbytes"
        assert body.count(offsets) == 1
        body = body.replace(offsets, bytes(4) + (1 << 30).to_bytes(4, "little") + b"thirteenbytes")
        try:
            arrow_frame(USAGE, body).to_dicts()
        except BadRequest as exc:
            print("refused:", exc)
        """
    )
    assert out.startswith("refused:")
    assert "not an Arrow IPC stream" in out


def test_arrow_streams_with_random_bytes_changed_never_crash_the_reader() -> None:
    """Four thousand corruptions of one real stream: each is refused or read, none faults."""
    out = _survives(
        """
        good = encode_arrow(USAGE, ndjson([usage(request_id=f"r{i:030d}") for i in range(5)]))
        rnd = random.Random(20261201)
        outcomes = {"read": 0, "refused": 0}
        for _ in range(4000):
            body = bytearray(good)
            for _ in range(rnd.randint(1, 4)):
                body[rnd.randrange(len(body))] = rnd.getrandbits(8)
            try:
                arrow_frame(USAGE, bytes(body)).to_dicts()
                outcomes["read"] += 1
            except BadRequest:
                outcomes["refused"] += 1
        print(json.dumps(outcomes))
        """
    )
    assert sum(json.loads(out).values()) == 4000


# -- bodies that are valid JSON, or nearly, built to fail the service rather than the reader --


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over the in-memory ledger, on a loopback port (its handlers run on the
    server's worker threads, whose stacks are shallower than a test's)."""
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url


async def _post(url: str, path: str, body: bytes, content_type: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await client.post(
            path,
            content=body,
            headers={"authorization": f"Bearer {INGEST}", "content-type": content_type},
        )


@pytest.mark.parametrize("depth", [100, 990, 1_000, 1_030, 100_000])
@pytest.mark.parametrize(
    "shape",
    [
        lambda deep: deep,
        lambda deep: b'{"usage": ' + deep + b"}",
        lambda deep: b'{"usage": [{"request_id": ' + deep + b"}]}",
    ],
    ids=["the-body", "the-batch", "a-field"],
)
async def test_json_nested_deep_is_a_400_or_a_rejected_record_never_a_500(billing, shape, depth):
    """Nesting of any depth, where the body, the batch or a field should be flat: a 4xx or a
    refused record, each with a reason (it was a RecursionError and a 500)."""
    answer = await _post(billing, "/v1/ingest", shape(_deep(depth)), "application/json")
    assert answer.status_code < 500, answer.text[:300]
    if answer.status_code == 200:
        assert answer.json()["accepted"] == 0
        assert answer.json()["rejected"]
    else:
        assert answer.status_code == 400
        assert answer.json()["error"]["message"]


@pytest.mark.parametrize("depth", [100, 990, 1_000, 1_030, 100_000])
async def test_an_ndjson_line_nested_deep_is_one_rejected_record(billing, depth):
    """In NDJSON, a deep line is refused by name and its neighbours are kept."""
    good = usage(start=OCT + 3600)
    lines = [orjson.dumps(good), b'{"request_id": ' + _deep(depth) + b"}", _deep(depth)]
    answer = await _post(
        billing, "/v1/ingest/usage", b"\n".join(lines) + b"\n", "application/x-ndjson"
    )
    assert answer.status_code == 200, answer.text[:300]
    body = answer.json()
    assert body["accepted"] == 1
    assert [r["id"] for r in body["rejected"]] == ["#2", "#3"]


async def test_a_huge_array_in_a_field_is_refused_and_not_answered_back(billing):
    """A million-element array as an id is one refused record answered by its place, not echoed."""
    huge = b"[" + b",".join([b"1"] * 1_000_000) + b"]"
    answer = await _post(
        billing, "/v1/ingest/usage", b'{"request_id": ' + huge + b"}\n", "application/x-ndjson"
    )
    assert answer.status_code == 200
    assert answer.json()["rejected"] == [
        {"id": "#1", "reason": answer.json()["rejected"][0]["reason"]}
    ]
    assert len(answer.content) < 1_000


@pytest.mark.parametrize(
    "value",
    [b"1e400", b"-1e400", b"123456789012345678901234567890", b"1e-400", b"1" * 5000],
)
@pytest.mark.parametrize(
    "field", ["energy_joules", "power_watts", "interval_seconds", "xid_errors"]
)
async def test_absurd_magnitudes_are_a_4xx_or_a_rejected_record(billing, field, value):
    """Numbers past any float or integer, in every wire form, never reach the ledger as a 500."""
    line = orjson.dumps(gpu_samples(start=OCT + 3600, seconds=10)[0] | {field: 0}).replace(
        f'"{field}":0'.encode(), f'"{field}":'.encode() + value
    )
    for path, body, content_type in (
        ("/v1/ingest/gpu_samples", line + b"\n", "application/x-ndjson"),
        ("/v1/ingest", b'{"gpu_samples": [' + line + b"]}", "application/json"),
    ):
        answer = await _post(billing, path, body, content_type)
        assert answer.status_code < 500, (path, answer.text[:300])
        if answer.status_code == 200 and value != b"1e-400":
            assert answer.json()["accepted"] == 0, answer.text[:300]


@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
@pytest.mark.parametrize(
    ("kind", "field"),
    [("usage", "prompt_tokens"), ("usage", "choices"), ("gpu_samples", "xid_errors")],
    ids=["not null", "defaulted", "defaulted sample"],
)
async def test_an_integer_past_64_bits_is_one_rejected_record_and_the_rest_kept(
    billing, ledger, kind, field, value
):
    """2^63..2^64-1 is an integer to JSON that no BIGINT holds: its record is refused as out of
    range (not a 500 that refuses the batch on every resend, not kept as the field's default),
    and the batch's other records are kept, once."""
    records = (
        [usage(start=OCT + 3600 + i) for i in range(4)]
        if kind == "usage"
        else gpu_samples(start=OCT + 3600, seconds=40)
    )
    *good, bad = records
    id_field, table = ("request_id", "usage") if kind == "usage" else ("sample_id", "gpu_samples")
    line = orjson.dumps(bad | {field: 0}).replace(
        f'"{field}":0'.encode(), f'"{field}":{value}'.encode()
    )
    body = b"".join(orjson.dumps(r) + b"\n" for r in good) + line + b"\n"
    for sent in (1, 2):
        answer = await _post(billing, f"/v1/ingest/{kind}", body, "application/x-ndjson")
        assert answer.status_code == 200, answer.text[:300]
        result = answer.json()
        assert (result["accepted"], result["duplicates"]) == ((3, 0) if sent == 1 else (0, 3))
        assert [r["id"] for r in result["rejected"]] == [bad[id_field]]
        assert result["rejected"][0]["reason"].startswith(f"{field}: out of range")
    with ledger.reader() as cur:
        kept = cur.execute(f"SELECT count(*) FROM {table}").fetchall()
    assert kept == [(3,)]
