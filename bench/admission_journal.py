"""What the admission journal costs the sidecar: per request, per chunk, per tick, and in fsyncs.

In-process and on this machine's disk (``--dir``, default a temporary directory; pass the spool's
file system to measure its fsync). It drives ``sidecar.journal.AdmissionJournal`` exactly as the
sidecar does, without HTTP, and counts CPU time of its thread (``time.thread_time``), so that the journal's own
cost is measured and not the noise of a loaded machine around it:

- ``request``: build the admitted record, ``admit`` (one ``write(2)``, which also carries the
  previous request's end line, and the slot taken) and ``finish`` (no write of its own; the
  slot given back), the journal's whole cost on the event loop per request;
- ``chunk``: the relay's per-chunk work (``StreamMeter.feed`` of one token chunk) without a
  progress slot and with one (``sidecar.progress``: the chunk's count kept before it is sent),
  in alternating rounds, and the difference: what the journal adds to a chunk;
- ``tick``: one tick over ``--streams`` running streams (nothing is written for them: their
  slots are written as they relay), and over as many non-streamed requests read from vLLM's
  stream (the tick writes each one's tokens so far to its slot);
- ``fsync``: one fsync of the journal file and one of the slot file, with ``--streams`` slots
  written since the last (off the event loop, once per tick);
- ``rotation``: reading the running streams' admission lines back from a full file (8 MiB of
  admissions and ends), which a rotation does on the event loop, once per file.

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
from sidecar.assemble import Assembler
from sidecar.journal import AdmissionJournal
from sidecar.stream import StreamMeter

__all__ = ["main"]

_CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1790812800,'
    b'"model":"llama-3.1-8b-instruct","choices":[{"index":0,"delta":{"content":" word"},'
    b'"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":42,"total_tokens":%d,'
    b'"completion_tokens":%d}}\n\n'
)
# The stream's first chunk: the role, and vLLM's first usage (the prompt).
_ROLE = _CHUNK.replace(b'"content":" word"', b'"role":"assistant","content":""') % (42, 0)


def _record(i: int) -> UsageRecord:
    now = time.time()
    return UsageRecord(
        request_id=f"{int(now * 1000):012x}{i:020x}",
        team="search",
        model="chat-small",
        served_version="llama-3.1-8b-instruct",
        replica="small-0",
        received_at=now,
        first_token_at=None,
        finished_at=now,
        prompt_tokens=0,
        cached_prompt_tokens=0,
        completion_tokens=0,
        status=RequestStatus.INTERRUPTED.value,
        http_status=502,
        stream=True,
        usage_exact=False,
    )


def _best_us(fn: Callable[[], None], count: int, repeats: int = 7) -> float:
    """The median over ``repeats`` runs of ``fn`` x ``count``: CPU microseconds per call."""
    return statistics.median(rounds_us(fn, repeats, count, clock=time.thread_time))


async def measure(directory: Path, streams: int, mark_millis: int) -> dict[str, float]:
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

    chunks = [_CHUNK % (42 + n, n) for n in range(1, 20_001)]
    plain = StreamMeter(False, False, 0.0)
    streamed = _record(10**8)
    journal.admit(streamed.to_json(), 0.0)
    slotted = StreamMeter(False, False, 0.0, slot=journal.slot(streamed.request_id))
    for meter in (plain, slotted):
        meter.feed(_ROLE, 0.0)

    def feeder(meter: StreamMeter) -> Callable[[], None]:
        feed_at = iter(range(1, 10**9))

        def one_chunk() -> None:
            n = next(feed_at)
            meter.feed(chunks[n % len(chunks)], n * 1e-3)

        return one_chunk

    plain_rounds: list[float] = []
    slot_rounds: list[float] = []
    one_plain, one_slotted = feeder(plain), feeder(slotted)
    for _ in range(9):  # alternating, so that the machine's drift hits both alike
        plain_rounds += rounds_us(one_plain, 1, 5_000, clock=time.thread_time)
        slot_rounds += rounds_us(one_slotted, 1, 5_000, clock=time.thread_time)
    assert slotted.slot is not None
    assert slotted.token_events == plain.token_events

    meters = []
    for i in range(streams):
        rec = _record(i)
        journal.admit(rec.to_json(), 0.0)
        meter = StreamMeter(False, False, 0.0, slot=journal.slot(rec.request_id))
        meter.feed(_ROLE + chunks[0], 0.0)
        meters.append(meter)
    streams_tick = _tick_us(journal, [])
    counting = []
    for i in range(streams):
        rec = _record(streams + i)
        journal.admit(rec.to_json(), 0.0)
        assembler = Assembler("/v1/chat/completions")
        journal.track(rec.request_id, assembler)
        counting.append(assembler)
    whole_tick = _tick_us(journal, counting)
    fsyncs: dict[str, list[float]] = {"log": [], "slots": []}
    assert journal._slots is not None
    for t in range(20):
        for meter in meters:  # every stream's slot written since the last fsync
            meter.feed(chunks[t + 1], 0.0)
        journal._tick(time.time())
        for name, fd in (("log", journal._fd), ("slots", journal._slots.fd)):
            start = time.perf_counter()
            await asyncio.to_thread(os.fsync, fd)
            fsyncs[name].append((time.perf_counter() - start) * 1e6)
    while journal._size < journal.rotate_bytes:
        for _ in range(1000):
            one_request()
        journal._tick(time.time())
    reads = []
    for _ in range(5):
        start = time.thread_time()
        found = journal._admission_lines()
        reads.append((time.thread_time() - start) * 1e6)
    assert len(found) == 2 * streams + 1
    await journal.close()
    return {
        "request_us": request_us,
        "chunk_feed_us": statistics.median(plain_rounds),
        "chunk_slot_us": statistics.median(slot_rounds),
        "chunk_feed_best_us": min(plain_rounds),
        "chunk_slot_best_us": min(slot_rounds),
        "tick_streams_us": streams_tick,
        "tick_whole_us": whole_tick,
        "fsync_log_p50_us": statistics.median(fsyncs["log"]),
        "fsync_slots_p50_us": statistics.median(fsyncs["slots"]),
        "fsync_max_us": max(fsyncs["log"] + fsyncs["slots"]),
        "ticks_per_second": 1000 / mark_millis,
        "rotation_read_us": statistics.median(reads),
        "rotation_file_bytes": journal._size,
    }


def _tick_us(journal: AdmissionJournal, counting: list[Assembler]) -> float:
    """CPU µs of one tick (the median of 7), the non-streamed requests' blocks moving between."""
    ticks = []
    for t in range(1, 8):
        for (
            assembler
        ) in counting:  # every request's counts moved since the last tick: the worst case
            assembler.feed(_CHUNK % (42 + t, t))
        start = time.thread_time()
        journal._tick(time.time())
        ticks.append((time.thread_time() - start) * 1e6)
    return statistics.median(ticks)


def main(argv: Sequence[str] | None = None) -> int:
    """Run once and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to put the journal (default: a temp dir)")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--mark-millis", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        figures = asyncio.run(measure(Path(tmp), args.streams, args.mark_millis))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"per request (admit + finish, 1 write):  {figures['request_us']:8.2f} us")
    print(
        f"per chunk, the relay's feed, no slot:    {figures['chunk_feed_us']:8.2f} us"
        f" (best {figures['chunk_feed_best_us']:.2f})"
    )
    print(
        f"per chunk, the relay's feed, with slot:  {figures['chunk_slot_us']:8.2f} us"
        f" (best {figures['chunk_slot_best_us']:.2f})"
    )
    print(
        f"per chunk, the slot's part:              {figures['chunk_slot_us'] - figures['chunk_feed_us']:8.2f} us"
        f" (best {figures['chunk_slot_best_us'] - figures['chunk_feed_best_us']:.2f})"
    )
    print(
        f"tick over {args.streams} streams:            {figures['tick_streams_us'] / 1000:8.3f} ms"
        f" every {args.mark_millis} ms"
    )
    print(
        f"tick over {args.streams} non-streamed requests: {figures['tick_whole_us'] / 1000:8.3f} ms"
        f" every {args.mark_millis} ms"
    )
    print(
        f"fsync (off the loop), p50:               {figures['fsync_log_p50_us']:8.0f} us the log,"
        f" {figures['fsync_slots_p50_us']:.0f} us the slots, {figures['fsync_max_us']:.0f} us max,"
        f" {figures['ticks_per_second']:g} of each a second"
    )
    print(
        f"rotation: reading back {args.streams} admissions: {figures['rotation_read_us'] / 1000:8.2f} ms"
        f" (from a {figures['rotation_file_bytes'] / 2**20:.1f} MiB file, on the loop, once a file)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
