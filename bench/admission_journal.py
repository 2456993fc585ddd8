"""What the admission journal costs the sidecar: per request, per chunk, and in fsyncs.

In-process and on this machine's disk (``--dir``, default a temporary directory; pass the spool's
file system to measure its fsync). It drives ``sidecar.journal.AdmissionJournal`` exactly as the
sidecar does, without HTTP, and counts CPU time of its thread (``time.thread_time``), so that the journal's own
cost is measured and not the noise of a loaded machine around it:

- ``request``: build the admitted record, ``admit`` (one ``write(2)``, which also carries the
  previous request's end line) and ``finish`` (no write of its own),
  the journal's whole cost on the event loop per request;
- ``chunk``: the relay's per-chunk work (``StreamMeter.feed`` of one token chunk), which the
  journal does not touch, next to the marks' cost spread over the chunks of an interval: one
  tick over ``--streams`` running streams whose counts all moved, divided by the chunks those
  streams relay in ``journal_mark_millis`` at ``--tokens-per-second`` each;
- ``fsync``: one fsync of the journal file (run off the event loop, once per mark interval);
- ``rotation``: reading the running streams' admission lines back from a full file (8 MiB of
  admissions, ends and marks), which a rotation does on the event loop, once per file.

    .venv/bin/python -m bench.admission_journal            # about 10 seconds
    .venv/bin/python -m bench.admission_journal --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.chunks import rounds_us
from infermeter.records import RequestStatus, UsageRecord
from sidecar.journal import AdmissionJournal
from sidecar.stream import StreamMeter

__all__ = ["main"]

_CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1790812800,'
    b'"model":"llama-3.1-8b-instruct","choices":[{"index":0,"delta":{"content":" word"},'
    b'"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":42,"total_tokens":%d,'
    b'"completion_tokens":%d}}\n\n'
)


def _record(i: int) -> UsageRecord:
    now = time.time()
    return UsageRecord(
        request_id=f"{int(now * 1000):012x}{i:020x}", team="search", model="chat-small",
        served_version="llama-3.1-8b-instruct", replica="small-0", received_at=now,
        first_token_at=None, finished_at=now, prompt_tokens=0, cached_prompt_tokens=0,
        completion_tokens=0, status=RequestStatus.INTERRUPTED.value, http_status=502, stream=True,
        usage_exact=False,
    )  # fmt: skip


def _best_us(fn: Callable[[], None], count: int, repeats: int = 7) -> float:
    """The median over ``repeats`` runs of ``fn`` x ``count``: CPU microseconds per call."""
    return statistics.median(rounds_us(fn, repeats, count, clock=time.thread_time))


async def measure(directory: Path, streams: int, tokens_per_second: float, mark_millis: int) -> dict[str, float]:  # fmt: skip
    """The figures of the module docstring, in microseconds."""
    journal = AdmissionJournal(directory, 3600)  # no tick of its own during the measurement
    journal.open()
    counter = iter(range(10**9))

    def one_request() -> None:
        i = next(counter)
        record = _record(i)
        journal.admit(record.to_json(), 0.0)
        journal.finish(record.request_id)

    request_us = _best_us(one_request, 2_000)

    meter = StreamMeter(False, False, 0.0)
    chunks = [_CHUNK % (42 + n, n) for n in range(1, 20_001)]
    feed_at = iter(range(10**9))

    def one_chunk() -> None:
        n = next(feed_at)
        meter.feed(chunks[n % len(chunks)], n * 1e-3)

    chunk_us = _best_us(one_chunk, 2_000)

    meters = []
    for i in range(streams):
        rec = _record(i)
        journal.admit(rec.to_json(), 0.0)
        m = StreamMeter(False, False, 0.0)
        journal.track(rec.request_id, m)
        meters.append(m)
    ticks = []
    for t in range(1, 8):
        for m in meters:  # every stream's counts moved since the last tick: the worst case
            m.feed(_CHUNK % (42 + t, t), t * 1e-3)
        start = time.thread_time()
        journal._mark_all(time.time())
        ticks.append((time.thread_time() - start) * 1e6)
    tick_us = statistics.median(ticks)
    chunks_per_tick = streams * tokens_per_second * mark_millis / 1000
    while journal._size < journal.rotate_bytes:
        for _ in range(1000):
            one_request()
        journal._mark_all(time.time())
    reads = []
    for _ in range(5):
        start = time.thread_time()
        found = journal._admission_lines()
        reads.append((time.thread_time() - start) * 1e6)
    assert len(found) == streams
    fsyncs = []
    for _ in range(20):
        start = time.perf_counter()
        await asyncio.to_thread(os.fsync, journal._fd)
        fsyncs.append((time.perf_counter() - start) * 1e6)
    await journal.close()
    return {
        "request_us": request_us,
        "chunk_feed_us": chunk_us,
        "mark_tick_us": tick_us,
        "mark_per_chunk_us": tick_us / chunks_per_tick,
        "fsync_p50_us": statistics.median(fsyncs),
        "fsync_max_us": max(fsyncs),
        "fsyncs_per_second": 1000 / mark_millis,
        "rotation_read_us": statistics.median(reads),
        "rotation_file_bytes": journal._size,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run once and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to put the journal (default: a temp dir)")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens-per-second", type=float, default=20.0)
    parser.add_argument("--mark-millis", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        figures = asyncio.run(measure(Path(tmp), args.streams, args.tokens_per_second, args.mark_millis))  # fmt: skip
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"per request (admit + finish, 1 write):  {figures['request_us']:8.2f} us")
    print(f"per chunk, the relay's feed (unchanged): {figures['chunk_feed_us']:8.2f} us")
    print(f"per chunk, marks spread over the chunks: {figures['mark_per_chunk_us']:8.3f} us"
          f"  ({args.streams} streams x {args.tokens_per_second:g} tok/s, one tick"
          f" {figures['mark_tick_us'] / 1000:.2f} ms every {args.mark_millis} ms)")  # fmt: skip
    print(f"fsync of the journal (off the loop):     {figures['fsync_p50_us']:8.0f} us p50,"
          f" {figures['fsync_max_us']:.0f} us max, {figures['fsyncs_per_second']:g} a second")  # fmt: skip
    print(f"rotation: reading back {args.streams} admissions: {figures['rotation_read_us'] / 1000:8.2f} ms"
          f" (from a {figures['rotation_file_bytes'] / 2**20:.1f} MiB file, on the loop, once a file)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
