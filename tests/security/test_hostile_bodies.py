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

import pytest

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
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
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
