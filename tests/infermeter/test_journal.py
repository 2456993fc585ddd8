"""The admission journal's format: what a dead sidecar left running becomes interrupted records."""

from __future__ import annotations

import orjson
import pytest

from infermeter.journal import Pending, interrupted_record, recover, unfinished
from infermeter.records import RequestStatus, UsageRecord
from infermeter.spool import Spool

T0 = 1_790_812_800.0


def admitted(request_id: str = "r1", stream: bool = True) -> UsageRecord:
    """The record a request is journaled with when it is admitted."""
    return UsageRecord(
        request_id=request_id, team="search", model="chat-small", served_version="v1", replica="small-0",
        received_at=T0, first_token_at=None, finished_at=T0, prompt_tokens=0, cached_prompt_tokens=0,
        completion_tokens=0, status=RequestStatus.INTERRUPTED.value, http_status=502, stream=stream,
        usage_exact=False,
    )  # fmt: skip


def line(entry: dict[str, object]) -> bytes:
    """One journal line."""
    return orjson.dumps(entry) + b"\n"


def test_unfinished_keeps_admissions_without_an_end_and_their_last_mark():
    """An admission with no finish line is pending with its last mark; a finished one is gone."""
    lines = [
        line({"a": admitted("r1").to_json()}),
        line({"a": admitted("r2").to_json()}),
        line({"m": "r1", "p": 7, "c": 3, "k": 0, "t": T0 + 0.1, "at": T0 + 0.5}),
        line({"m": "r1", "p": 7, "c": 9, "k": 0, "t": T0 + 0.1, "at": T0 + 1.0}),
        line({"f": "r2"}),
        b'{"m": "r1", "p": 7, "c": 1',  # torn: the process died mid-write
    ]
    pending = unfinished(lines)
    assert list(pending) == ["r1"]
    assert pending["r1"].mark is not None
    assert pending["r1"].mark["c"] == 9


@pytest.mark.parametrize(
    ("mark", "stream", "expected"),
    [
        (None, True, (0, 0, None, 502, T0 + 2.0)),
        (
            {"p": 7, "c": 9, "k": 2, "t": T0 + 0.1, "at": T0 + 1.0},
            True,
            (7, 9, T0 + 0.1, 200, T0 + 2.0),
        ),
        ({"p": 7, "c": 0, "k": 0, "t": None, "at": T0 + 3.0}, False, (7, 0, None, 502, T0 + 3.0)),
    ],
)
def test_interrupted_record_takes_the_last_mark(mark, stream, expected):
    """Counts and first-token time come from the mark; the end is the later of mark and last write."""
    record = interrupted_record(Pending(admitted(stream=stream).to_json(), mark), T0 + 2.0)
    assert record.status == "interrupted"
    assert record.usage_exact is False
    assert record.request_id == "r1"
    got = (record.prompt_tokens, record.completion_tokens, record.first_token_at,
           record.http_status, record.finished_at)  # fmt: skip
    assert got == expected


async def test_recover_keeps_the_journal_when_the_spool_refuses(tmp_path):
    """A full spool at start: no record is lost, the journal stays for the next start."""
    left = tmp_path / "spool" / "journal" / "journal-00000000000000000001.log"
    left.parent.mkdir(parents=True)
    left.write_bytes(line({"a": admitted().to_json()}))
    spool = Spool(tmp_path / "spool", max_bytes=10)
    spool.open()
    assert await recover([left], spool) == []
    await spool.close()
    assert left.exists()
    assert not list(spool.directory.glob("seg-*.jsonl"))
