"""CPU of per-request steps of the sidecar, in-process: the usage record, the end, the end wait.

- ``record``: what one request's accounting serialises: its admission line for the journal
  (``Accounting.admission`` and ``infermeter.journal_files.admission_line``) and its usage record
  for the spool (``Accounting.record_of`` and the spool's ``orjson.dumps``). Revisions before
  the record was built once as JSON fields made a ``UsageRecord`` twice and converted each.
- ``end``: a request's end on its path (``Accounting.record``, for requests admitted to a real
  journal, with a real spool in a temporary directory), and its share of the tick that writes
  the records and fsyncs them (``Accounting.flush``; a revision without it wrote each record on
  the path: its spool's ``sync``). CPU of the event loop's thread (``time.thread_time``): the
  fsync waits in the spool's own thread.
- ``wait``: a request waiting for the first of its end, its client leaving and the drain's cut,
  the end coming first: ``asyncio.wait(..., FIRST_COMPLETED)`` and ``Drain.until_first`` (when
  the revision has it), on uvloop.

``--root DIR`` imports the sidecar from ``DIR`` (a ``git worktree`` of another revision):

    .venv/bin/python -m bench.request_steps
    git worktree add /tmp/base d337e09 && .venv/bin/python -m bench.request_steps --root /tmp/base
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from bench.chunks import import_root, revision_parser, rounds_us


def record_us(rounds: int, n: int) -> list[float]:
    """µs per request for the journal's admission line and the spool's record line."""
    from infermeter.journal_files import admission_line
    from infermeter.records import RequestStatus
    from sidecar.accounting import Accounting, Call
    from sidecar.stream import StreamMeter, UsageCounts

    accounting: Any = Accounting.__new__(Accounting)
    accounting.replica, accounting.instance = "small-0", None
    meter = StreamMeter(False, False, 0.0)
    meter.first_token_at = 0.2
    usage = UsageCounts(12, 64, 0)
    admitted: Callable[[Any], Any] = getattr(
        accounting,
        "admission",
        lambda call: accounting.record_of(call, RequestStatus.INTERRUPTED, 502, None, None, None),
    )

    def one() -> None:
        call = Call(
            "req-0123456789abcdef",
            "/v1/chat/completions",
            1.7e9,
            0.0,
            team="search",
            model="chat-small",
            served_version="chat-small",
            stream=True,
        )
        admission_line(admitted(call))
        record = accounting.record_of(call, RequestStatus.OK, 200, usage, meter, "stop")
        orjson.dumps(record if isinstance(record, dict) else record.to_json())

    return rounds_us(one, rounds, n)


def end_us(rounds: int, n: int) -> dict[str, list[float]]:
    """µs of the event loop's CPU per request: its end on its path, and its share of the tick."""
    import tempfile
    from pathlib import Path

    import uvloop

    from infermeter.records import RequestStatus
    from infermeter.spool import Spool
    from sidecar.accounting import Accounting, Call
    from sidecar.journal import AdmissionJournal
    from sidecar.metrics import SidecarMetrics
    from sidecar.stream import StreamMeter, UsageCounts

    meter = StreamMeter(False, False, 0.0)
    meter.first_token_at = 0.2
    usage = UsageCounts(12, 64, 0)
    results: dict[str, list[float]] = {"end on the path": [], "end at the tick": []}

    async def main(directory: Path) -> None:
        spool = Spool(directory, roll_records=10**9, sync_seconds=3600)
        spool.open()
        journal = AdmissionJournal(directory / "journal", 3600)
        journal.open()
        accounting = Accounting(spool, journal, SidecarMetrics(), "small-0", None, "refuse")
        tick = getattr(accounting, "flush", spool.sync)
        for r in range(rounds):
            calls = [
                Call(
                    f"req-{r:04d}-{i:015d}",
                    "/v1/chat/completions",
                    1.7e9,
                    time.perf_counter(),
                    team="search",
                    model="chat-small",
                    served_version="chat-small",
                    stream=True,
                )
                for i in range(n)
            ]
            for call in calls:
                journal.admit(accounting.admission(call), call.started)
            start = time.thread_time()
            for call in calls:
                accounting.record(call, RequestStatus.OK, 200, usage, meter, "stop")
            results["end on the path"].append((time.thread_time() - start) / n * 1e6)
            start = time.thread_time()
            await tick()
            results["end at the tick"].append((time.thread_time() - start) / n * 1e6)
        await journal.close()
        await spool.close()

    with tempfile.TemporaryDirectory() as tmp:
        uvloop.run(main(Path(tmp)))
    return results


def wait_us(rounds: int, n: int) -> dict[str, list[float]]:
    """µs per wait for the first of three futures, the first one set soon after it starts."""
    import uvloop

    from sidecar.drain import Drain

    drain = Drain()

    async def asyncio_wait(a: Any, b: Any) -> None:
        await asyncio.wait((a, b, drain.cut), return_when=asyncio.FIRST_COMPLETED)

    ways: dict[str, Callable[[Any, Any], Any]] = {"asyncio.wait": asyncio_wait}
    if hasattr(drain, "until_first"):
        ways["Drain.until_first"] = drain.until_first
    results: dict[str, list[float]] = {name: [] for name in ways}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                for _ in range(n):
                    ended, lost = loop.create_future(), loop.create_future()
                    loop.call_soon(ended.set_result, None)
                    await way(ended, lost)
                results[name].append((time.perf_counter() - start) / n * 1e6)

    uvloop.run(main())
    return results


def main() -> int:
    """Measure and print."""
    parser = revision_parser(__doc__ or "")
    parser.add_argument("--rounds", type=int, default=9, help="rounds (9)")
    parser.add_argument("-n", type=int, default=20_000, help="requests per round (20,000)")
    args = parser.parse_args()
    where = import_root(args.root)
    print(
        f"sidecar from {where}; best and median of {args.rounds} rounds of {args.n}, µs per request"
    )
    rows = {"record (journal + spool lines)": record_us(args.rounds, args.n)}
    # (A tick's worth of requests at a time, as many as end in 500 ms at 2,000 a second.)
    rows |= end_us(args.rounds, min(args.n, 1_000))
    rows |= {f"end wait ({name})": v for name, v in wait_us(args.rounds, args.n).items()}
    for name, values in rows.items():
        print(f"  {name:34} best {min(values):6.2f}  median {statistics.median(values):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
