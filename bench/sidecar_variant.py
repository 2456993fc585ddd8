"""A ``--sidecar-launcher`` for ``bench/sidecar_overhead.py``: the sidecar with one part changed.

Each variant answers "what does this part cost?" by running the real sidecar without it, in the
same benchmark as nginx and the unchanged sidecar. ``SIDECAR_VARIANT`` names it:

- ``unmetered``: streamed blocks are relayed as they arrive, with no ``StreamMeter.feed`` (the
  client gets vLLM's bytes, per-chunk usage included; only ``[DONE]`` is still detected);
- ``asyncio``: Python's own event loop instead of uvloop (``sidecar.event_loop: asyncio``);
- ``arena1``: glibc's malloc limited to one arena (``MALLOC_ARENA_MAX=1``), for RSS;
- ``malloc``: Python's objects allocated by glibc's malloc, not pymalloc (``PYTHONMALLOC=malloc``),
  for RSS;
- ``memory``: the unchanged sidecar, with a thread that writes every second to
  ``SIDECAR_MEMORY_LOG`` (default ``sidecar-memory.txt``) its RSS, what glibc's malloc holds in
  use and free (``mallinfo2``) and what Python's allocator holds in live and free blocks
  (``sys._debugmallocstats``); with ``SIDECAR_TRACEMALLOC=1`` it also traces allocations and, at
  each new RSS peak, writes to ``<log>.sites`` the 40 source lines whose live allocations grew
  most since start-up (tracing makes every allocation dearer, so read the RSS of that run as
  inflated);
- ``stamps``: the unchanged sidecar, with the time of each step of a generation request taken
  from the read that brought it (in the HTTP server: the request's first callback, its URL, a
  header, the head parsed, the body, the read's end and the app's task begun; then the app's
  start, the plan and admission, the journal, the relay opening, the pooled connection in
  hand, the upstream write's call and its return, the upstream head and first content, the
  first write to the client), the
  medians written to ``SIDECAR_STAMPS`` (default ``sidecar-stamps.txt``) every 20 requests:
  where the added TTFT of ``ttft_c1`` goes (run that phase alone: at any concurrency the steps
  of different requests interleave). With ``SIDECAR_STAMPS_SPIN_US=N`` each read first spins
  N µs before its steps (a core kept busy, not woken, when the request comes: if the steps
  then run faster, their cost was the wake-up, not the caches);
- ``nofsync``: the spool's records written but not fsync'ed (``Spool._sync_files`` does
  nothing): what the tick's fsync costs, the disk thread's hand-off kept;
- ``nojournal``: no admission journal on the request's path (``Sidecar._enter`` admits without
  its line, its slot or its ``write(2)``, so the relay has no slot to write either): what the
  journal costs a request, at the cost of what it guarantees;
- ``nojournalwrite``: the journal's line built but not written (``AdmissionJournal._write``
  counts the bytes only), the slot kept;
- ``noslot``: the journal's line written, but the relay given no slot to write its progress to;
- ``nogc``: Python's cyclic garbage collector off (``gc.disable()`` before start-up);
- ``gcstats``: the unchanged sidecar, writing to ``SIDECAR_GCSTATS.<pid>`` (default
  ``sidecar-gcstats.txt.<pid>``) every 2 s how many collections of each generation the cyclic
  collector has made and the CPU time they took (``gc.callbacks``): what the collector costs the
  request path;
- ``eager``: the app's coroutine for a request run at once when its body is in, inside the
  server's read, until it first waits (for a streamed request, on vLLM's answer after the
  upstream write), and only then given to a task, as Python 3.12's eager tasks do: what the
  task made before the upstream write costs the added TTFT (a new upstream connection is made
  in a task of its own, as ``asyncio.timeout`` needs one; a body over 64 KiB would stall, the
  app not reading it before its end: for the benchmarks' small requests only);
- ``cycles``: the unchanged sidecar, with a thread that every 2 s runs the cyclic collector
  keeping what it finds (``gc.DEBUG_SAVEALL``) and writes how many objects, of which types,
  were garbage held only by reference cycles to ``SIDECAR_CYCLES.<pid>`` (default
  ``sidecar-cycles.txt.<pid>``): what the request path leaves for the collector instead of
  freeing it when its last reference goes;
- ``norecord``: no usage record spooled (``Spool.write`` returns at once, its request finished
  in the journal; the record's fields are still built and the admission journal still
  written): the most the spool's part of a record, its JSON line, seal, write and the tick's
  fsync, can cost together;
- ``calls``: the unchanged sidecar, writing to ``SIDECAR_CALLS`` (default
  ``sidecar-calls.txt``) every call one generation request makes (its ``SIDECAR_CALLS_NTH``-th,
  default 30) from the read that brought it to its upstream write (``sys.setprofile``), one a
  line, Python functions as ``file:line:name`` and built-ins as ``C:name``: what runs before
  vLLM sees a request;
- ``cprofile``: the unchanged sidecar under cProfile from its ``SIDECAR_PROFILE_FROM``-th
  generation request (default 40) until the ``SIDECAR_PROFILE_TO``-th (default 200) ends; the
  stats go to ``SIDECAR_PROFILE`` (``pstats`` format). cProfile's cost per call inflates
  call-heavy code several-fold: read it for call counts and shares, not for µs.

    SIDECAR_VARIANT=unmetered .venv/bin/python -m bench.sidecar_overhead --quick \\
        --phases paced_500 --sidecar-launcher bench/sidecar_variant.py
    SIDECAR_VARIANT=stamps SIDECAR_STAMPS=/tmp/stamps.txt .venv/bin/python -m \
        bench.sidecar_overhead --quick --phases ttft_c1 --sidecar-launcher bench/sidecar_variant.py
    SIDECAR_VARIANT=memory SIDECAR_MEMORY_LOG=/tmp/mem.txt .venv/bin/python -m \
        bench.sidecar_overhead --quick --phases rss_1000 --sidecar-launcher bench/sidecar_variant.py
    SIDECAR_VARIANT=cprofile SIDECAR_PROFILE=/tmp/c16.prof .venv/bin/python -m \
        bench.sidecar_overhead --quick --phases c16_json --sidecar-launcher bench/sidecar_variant.py

It takes the arguments of ``infermeter sidecar``. Not for production: a measuring tool only.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

_DONE = b"data: [DONE]\n\n"


def _unmetered() -> None:
    from sidecar.direct import StreamSink

    def body(self: StreamSink, data: bytes, now: float) -> None:
        if data.endswith(_DONE):
            self.meter.done = True
        writer = self.writer
        if writer is not None:
            writer.write(data)
        elif self.pending is None:
            self.pending = [data]
        else:
            self.pending.append(data)

    StreamSink.body = body  # type: ignore[method-assign]


def _cprofile() -> None:
    import cProfile
    from typing import Any

    from sidecar.app import Sidecar

    profile = cProfile.Profile()
    first = int(os.environ.get("SIDECAR_PROFILE_FROM", "40"))
    last = int(os.environ.get("SIDECAR_PROFILE_TO", "200"))
    out = os.environ.get("SIDECAR_PROFILE", "sidecar.prof")
    served = 0
    generate = Sidecar._generate

    async def counted(self: Sidecar, *args: Any) -> None:
        nonlocal served
        served += 1
        number = served
        if number == first:
            profile.enable()
        try:
            await generate(self, *args)
        finally:
            if number == last:
                profile.disable()
                profile.dump_stats(out)

    Sidecar._generate = counted  # type: ignore[method-assign,assignment]


def _nofsync() -> None:
    from typing import IO

    from infermeter.spool import Spool

    def sync_files(self: Spool, files: list[IO[bytes]]) -> None:
        return None

    Spool._sync_files = sync_files  # type: ignore[method-assign]


def _norecord() -> None:
    from typing import Any

    from infermeter.spool import Spool

    def write(
        self: Spool, record: dict[str, Any], durable: Callable[[], None] | None = None
    ) -> None:
        if durable is not None:
            durable()

    Spool.write = write  # type: ignore[method-assign]


def _nojournal() -> None:
    from sidecar.accounting import Call
    from sidecar.app import Sidecar

    def enter(self: Sidecar, call: Call) -> None:
        pass  # (no drain either: the benchmark never drains)

    Sidecar._enter = enter  # type: ignore[method-assign]


def _nojournalwrite() -> None:
    from sidecar.journal import AdmissionJournal

    def write(self: AdmissionJournal, data: bytes) -> None:
        self._size += len(data)
        self._unsynced = True

    AdmissionJournal._write = write  # type: ignore[method-assign]


def _noslot() -> None:
    from sidecar.journal import AdmissionJournal

    AdmissionJournal.slot = lambda self, request_id: None  # type: ignore[method-assign]


def _calls() -> None:
    from types import FrameType
    from typing import Any

    from sidecar import http_server, pool

    out = os.environ.get("SIDECAR_CALLS", "sidecar-calls.txt")
    nth = int(os.environ.get("SIDECAR_CALLS_NTH", "30"))
    seen: list[str] = []
    state = {"requests": 0, "tracing": False}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            seen.append(f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}")
        elif event == "c_call":
            seen.append(f"C:{getattr(arg, '__qualname__', arg)}")

    read = http_server._Connection.data_received

    def data_received(self: Any, data: bytes) -> None:
        if b"/v1/" in data[:64]:
            state["requests"] += 1
            if state["requests"] == nth:
                state["tracing"] = True
                sys.setprofile(profile)
        read(self, data)

    send = pool.Connection.send

    def sent(self: Any, *args: Any, **kwargs: Any) -> None:
        send(self, *args, **kwargs)
        if state["tracing"]:
            sys.setprofile(None)
            state["tracing"] = False
            with open(out, "w") as f:
                f.write("\n".join(seen) + "\n")

    http_server._Connection.data_received = data_received  # type: ignore[method-assign]
    pool.Connection.send = sent  # type: ignore[method-assign]


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def _pymalloc_mb() -> tuple[float, float] | None:
    """Python's allocator: MB in live blocks, MB in free blocks of its pools (None when another
    allocator is in front of it, as tracemalloc is)."""
    import tempfile

    with tempfile.TemporaryFile() as stats:
        saved = os.dup(2)
        os.dup2(stats.fileno(), 2)  # sys._debugmallocstats writes to the C stderr
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        stats.seek(0)
        text = stats.read().decode()
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip().replace(",", "")
    live, free = (
        values.get("# bytes in allocated blocks"),
        values.get("# bytes in available blocks"),
    )
    if live is None or free is None:
        return None
    mb = 1024 * 1024
    return int(live) / mb, int(free) / mb


def _memory() -> None:
    import ctypes
    import threading
    import tracemalloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    log = os.environ.get("SIDECAR_MEMORY_LOG", "sidecar-memory.txt")
    sites = os.environ.get("SIDECAR_TRACEMALLOC") == "1"
    if sites:
        tracemalloc.start()

    def watch() -> None:
        mb = 1024 * 1024
        base = None
        peak = 0.0
        with open(log, "w") as out:
            while True:
                time.sleep(1.0)
                rss, info, blocks = _rss_mb(), libc.mallinfo2(), _pymalloc_mb()
                python = (
                    ""
                    if blocks is None
                    else f"; pymalloc live {blocks[0]:.1f}, free {blocks[1]:.1f}"
                )
                out.write(
                    f"{time.time():.0f} rss {rss:.1f} MB; malloc in use {info.uordblks / mb:.1f}, "
                    f"free {info.fordblks / mb:.1f}, mmap {info.hblkhd / mb:.1f}{python}\n"
                )
                out.flush()
                if not sites:
                    continue
                if base is None:
                    base = tracemalloc.take_snapshot()
                elif rss > peak + 0.5:
                    peak = rss
                    grown = tracemalloc.take_snapshot().compare_to(base, "lineno")[:40]
                    with open(log + ".sites", "w") as top:
                        top.write(f"rss {rss:.1f} MB\n")
                        top.writelines(
                            f"{d.size_diff:>12,} B {d.count_diff:>9,} blocks  {d.traceback[0]}\n"
                            for d in grown
                        )

    threading.Thread(target=watch, name="memory-log", daemon=True).start()


def _stamps() -> None:
    import statistics
    from typing import Any

    from infermeter import http_guard
    from sidecar import http_server, pool
    from sidecar.app import Sidecar
    from sidecar.relay import Relay

    out = os.environ.get("SIDECAR_STAMPS", "sidecar-stamps.txt")
    clock = time.perf_counter
    now: dict[str, float] = {}
    rows: list[dict[str, float]] = []
    steps = (
        "begun",
        "url",
        "header",
        "head parsed",
        "body parsed",
        "read returned",
        "task",
        "app",
        "planned",
        "admitted",
        "journaled",
        "opening",
        "pooled",
        "sending",
        "sent",
        "upstream head",
        "upstream content",
        "client write",
    )

    def report() -> None:
        with open(out, "w") as f:
            f.write(f"{len(rows)} requests; µs from the read that brought the request, median\n")
            for step in steps:
                values = [r[step] - r["read"] for r in rows[10:] if step in r]
                if values:
                    f.write(f"{step:>18} {statistics.median(values) * 1e6:8.0f}\n")

    def wrap(cls: Any, name: str, before: str | None, after: str | None) -> None:
        original = getattr(cls, name)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            if before is not None and before not in now:
                now[before] = clock()
            result = original(*args, **kwargs)
            if after is not None and after not in now:
                now[after] = clock()
            return result

        setattr(cls, name, stamped)

    def wrap_async(cls: Any, name: str, before: str | None, after: str | None) -> None:
        original = getattr(cls, name)

        async def stamped(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                now[before] = clock()
            result = await original(*args, **kwargs)
            if after is not None:
                now[after] = clock()
            return result

        setattr(cls, name, stamped)

    read = http_server._Connection.data_received
    spin = float(os.environ.get("SIDECAR_STAMPS_SPIN_US", "0")) / 1e6

    def data_received(self: Any, data: bytes) -> None:
        if b"/v1/" in data[:64]:
            if spin:
                until = clock() + spin
                while clock() < until:
                    pass
            now.clear()
            now["read"] = clock()
        read(self, data)

    http_server._Connection.data_received = data_received  # type: ignore[method-assign]
    wrap(http_server._Connection, "data_received", None, "read returned")
    wrap(http_server._Connection, "on_message_begin", None, "begun")
    wrap(http_server._Connection, "on_url", None, "url")
    wrap(http_server._Connection, "on_header", None, "header")
    wrap(http_server._Connection, "on_headers_complete", None, "head parsed")
    wrap(http_server._Connection, "on_message_complete", None, "body parsed")
    wrap_async(http_server._Connection, "_run", "task", None)
    wrap_async(Sidecar, "_generate", "app", None)
    wrap_async(Sidecar, "admit_planned", "planned", "admitted")
    wrap(Sidecar, "_enter", None, "journaled")
    wrap_async(Relay, "open_stream", "opening", None)
    wrap_async(pool.Pool, "connection", None, "pooled")
    wrap(pool.Connection, "send", "sending", "sent")
    wrap(pool.Connection, "on_headers_complete", "upstream head", None)
    on_body = pool.Connection.on_body

    def body(self: Any, data: bytes) -> None:
        if "upstream content" not in now and b'"content"' in data:
            now["upstream content"] = self.last_read
        on_body(self, data)

    pool.Connection.on_body = body  # type: ignore[method-assign,assignment]
    write = http_guard.RawWriter.write

    def client_write(self: Any, data: bytes) -> None:
        write(self, data)
        if "upstream content" in now and "client write" not in now:
            now["client write"] = clock()
            rows.append(dict(now))
            if len(rows) % 20 == 0:
                report()

    http_guard.RawWriter.write = client_write  # type: ignore[method-assign]


def _asyncio() -> None:
    from infermeter import serving

    serving.loop_factory = lambda choice: None


def _eager() -> None:
    import asyncio
    from collections.abc import Coroutine, Generator
    from typing import Any

    from sidecar import http_server, pool

    class Pending:
        """Awaited by the task: the coroutine's first wait, then the coroutine driven on."""

        def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
            self.coro, self.first = coro, first

        def __await__(self) -> Generator[Any, Any, None]:
            coro, value = self.coro, self.first
            while True:
                try:
                    sent = yield value
                except BaseException as exc:
                    try:
                        value = coro.throw(exc)
                    except StopIteration:
                        return
                else:
                    try:
                        value = coro.send(sent)
                    except StopIteration:
                        return

    async def drive(pending: Pending) -> None:
        await pending

    conn_cls = http_server._Connection

    def run_now(self: http_server._Connection, exchange: http_server._Exchange) -> None:
        coro = self._run(exchange)
        try:
            first = coro.send(None)
        except StopIteration:
            return
        self.server.tasks.add(self.loop.create_task(drive(Pending(coro, first))))

    def start(self: http_server._Connection, exchange: http_server._Exchange) -> None:
        self._answering = exchange
        if not exchange.more_body:
            run_now(self, exchange)
        # (else at the body's end: ``on_message_complete``)

    complete = conn_cls.on_message_complete

    def on_message_complete(self: http_server._Connection) -> None:
        exchange = self._parsing
        complete(self)
        if exchange is not None and exchange is self._answering:
            run_now(self, exchange)

    connection = pool.Pool.connection

    async def in_a_task(self: pool.Pool, new: bool = False) -> pool.Connection:
        if asyncio.current_task() is None and (new or not self._idle):
            return await asyncio.get_running_loop().create_task(connection(self, new))
        return await connection(self, new)

    conn_cls._start = start  # type: ignore[method-assign]
    conn_cls.on_message_complete = on_message_complete  # type: ignore[method-assign]
    pool.Pool.connection = in_a_task  # type: ignore[method-assign]


def _nogc() -> None:
    import gc

    gc.disable()


def _gcstats() -> None:
    import gc
    import threading

    out = os.environ.get("SIDECAR_GCSTATS", "sidecar-gcstats.txt")
    # Per generation: collections and the thread CPU seconds they took.
    seen = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.thread_time()
        else:
            entry = seen[info["generation"]]
            entry[0] += 1
            entry[1] += time.thread_time() - began[0]

    gc.callbacks.append(timed)

    def write() -> None:
        while True:
            time.sleep(2.0)
            with open(f"{out}.{os.getpid()}", "w") as log:
                log.write(
                    " ".join(f"gen{g}: {n} in {1000 * s:.1f} ms" for g, (n, s) in seen.items())
                    + "\n"
                )

    threading.Thread(target=write, daemon=True).start()


def _cycles() -> None:
    import collections
    import gc
    import threading

    out = os.environ.get("SIDECAR_CYCLES", "sidecar-cycles.txt")

    def watch() -> None:
        time.sleep(3.0)  # (what start-up leaves is not the request path's)
        gc.set_debug(gc.DEBUG_SAVEALL)
        with open(f"{out}.{os.getpid()}", "w") as log:
            while True:
                time.sleep(2.0)
                gc.collect()
                kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
                log.write(
                    f"{time.time():.0f} {len(gc.garbage)} objects in cycles: "
                    + " ".join(f"{k}:{n}" for k, n in kinds.most_common(20))
                    + "\n"
                )
                log.flush()
                gc.garbage.clear()

    threading.Thread(target=watch, daemon=True).start()


# The variants that patch this process before the sidecar starts (arena1 and malloc re-execute
# it with another allocator instead).
_PATCHES: dict[str, Callable[[], None]] = {
    "unmetered": _unmetered,
    "asyncio": _asyncio,
    "cprofile": _cprofile,
    "nofsync": _nofsync,
    "norecord": _norecord,
    "calls": _calls,
    "nojournal": _nojournal,
    "nojournalwrite": _nojournalwrite,
    "noslot": _noslot,
    "nogc": _nogc,
    "gcstats": _gcstats,
    "eager": _eager,
    "cycles": _cycles,
    "memory": _memory,
    "stamps": _stamps,
}


def main() -> int:
    """Apply ``SIDECAR_VARIANT`` and run ``infermeter`` with this process's arguments."""
    variant = os.environ.get("SIDECAR_VARIANT", "")
    if variant == "arena1" and os.environ.get("MALLOC_ARENA_MAX") != "1":
        env = dict(os.environ, MALLOC_ARENA_MAX="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if variant == "malloc" and os.environ.get("PYTHONMALLOC") != "malloc":
        env = dict(os.environ, PYTHONMALLOC="malloc")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    patch = _PATCHES.get(variant)
    if patch is not None:
        patch()
    elif variant not in ("", "arena1", "malloc"):
        raise SystemExit(f"SIDECAR_VARIANT: unknown variant {variant!r}")
    from launcher.cli import main as run_infermeter

    return run_infermeter(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
