"""CPU per chunk of the sidecar's whole per-token path in Python, without the sockets.

One upstream read of one vLLM chunk (chunked framing included) goes through what the protocol
relay runs for it in the sidecar: ``sidecar.pool.Connection.data_received`` (httptools' parser
and its ``on_body``), ``sidecar.direct.StreamSink.body``, ``StreamMeter.feed`` (with the
stream's admission-journal slot, ``sidecar.progress``, in a revision that has one) and the
client's ``RawWriter.write``, down to a transport whose ``write`` keeps the bytes. What the event loop
and the kernel add (the read and write system calls, epoll) is not in it: ``bench.sidecar_overhead``
measures the whole. Reported: the best and the median of ``--rounds`` rounds, µs per chunk.

``--root DIR`` imports the sidecar from ``DIR`` instead (a ``git worktree`` of another
revision), so two revisions can be compared with the same script:

    .venv/bin/python -m bench.chunk_path
    git worktree add /tmp/base HEAD~3 && .venv/bin/python -m bench.chunk_path --root /tmp/base
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chunks import CHUNK, ROLE, import_root, revision_parser

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


class Transport:
    """Enough of an ``asyncio.Transport`` for both ends: writes are kept, then dropped."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.write = self.out.append

    def is_closing(self) -> bool:
        return False

    def is_reading(self) -> bool:
        return True


def framed(event: bytes) -> bytes:
    """``event`` as one chunk of a chunked body, as vLLM's server writes it."""
    return b"%x\r\n%b\r\n" % (len(event), event)


def per_chunk(chunks: int) -> float:
    """µs per upstream read of one chunk on a fresh stream, after its head and role chunk."""
    from infermeter.http_guard import RawWriter
    from sidecar.direct import StreamSink
    from sidecar.pool import Connection, Pool
    from sidecar.stream import StreamMeter

    loop = asyncio.new_event_loop()
    slots: Any = None
    meter = StreamMeter(False, False, time.perf_counter())
    if "slot" in StreamMeter.__slots__:  # (a revision whose streams are journaled in slots)
        from sidecar.progress import SlotTable

        slots = SlotTable(Path(tempfile.mkdtemp()) / "journal-0.slots")
        meter.slot = slots.take("0" * 32, 0.0)
    try:
        conn = Connection(Pool("127.0.0.1", 9, 1.0, 60.0))
        upstream, client = Transport(), Transport()
        conn.connection_made(upstream)  # type: ignore[arg-type]
        sink = StreamSink(meter, loop)
        conn._sink = sink
        conn.data_received(HEAD)
        writer: Any = RawWriter(client, loop.create_future())  # type: ignore[arg-type]
        sink.go_direct(writer)
        conn.data_received(framed(ROLE))
        block, feed, out = framed(CHUNK), conn.data_received, client.out
        start = time.perf_counter()
        for i in range(chunks):
            feed(block)
            if i & 1023 == 0:
                out.clear()
        elapsed = time.perf_counter() - start
        assert sink.meter.token_events == chunks, "the meter did not count every chunk"
        return elapsed / chunks * 1e6
    finally:
        loop.close()
        if slots is not None:
            slots.close(delete=True)
            slots.path.parent.rmdir()


def main() -> int:
    """Measure and print."""
    parser = revision_parser(__doc__ or "")
    parser.add_argument("--chunks", type=int, default=50_000, help="reads per round (50,000)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (15)")
    args = parser.parse_args()
    where = import_root(args.root)
    values = [per_chunk(args.chunks) for _ in range(args.rounds)]
    print(
        f"{where}: best {min(values):.2f} µs, median {statistics.median(values):.2f} µs per "
        f"chunk ({args.rounds} rounds of {args.chunks})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
