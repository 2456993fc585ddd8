"""The sidecar's steps for one request timed warm and cold: why a few hundred µs at c=1, a few at c=16.

At c=1 each request finds the sidecar's core after other processes (the client, the replica)
ran on it: the caches and TLB hold their memory, not the sidecar's. The same Python then takes
several times as long as when requests follow each other on a busy sidecar. This times one
request's steps with the sidecar's own code, in one process pinned to one core (``--steps``):

- ``admission``: the pure steps of admitting one streamed request (the key check, the plan of
  its body, the journal's admission line, the upstream request head);
- ``server``: the sidecar's HTTP server reading one request (``sidecar.http_server``: its parse,
  the ASGI scope and exchange, and the task that will run the app, made but not run);
- ``server-notask``: the same, with the task not made: what making it costs is the difference.

Each after each of these gaps:

- ``warm``: a 2 ms spin (the core stays on this process);
- ``idle``: a 2 ms sleep (the core idles, nothing else runs);
- ``other``: another process's 2 ms turn on the same core, reading 16 MB (as the client and the
  replica run between two of the sidecar's requests at c=1);
- ``evicted``: this process copies 64 MB, which leaves none of its own memory in any cache level.

    .venv/bin/python -m bench.cold_steps
    .venv/bin/python -m bench.cold_steps --steps server server-notask

Read the ratios to ``warm``; the µs themselves move with the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

_GAP_SECONDS = 0.002
_TOUCH_BYTES = 16 << 20
_EVICT_BYTES = 64 << 20
# A request as the benchmarks' clients send it.
_BODY = (
    b'{"model":"chat-small","messages":[{"role":"user","content":"Say hello."}],'
    b'"max_tokens":16,"stream":true}'
)
_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:9000\r\n"
    b"authorization: Bearer im-demo-search\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\naccept: */*\r\nuser-agent: bench\r\n\r\n%b" % (len(_BODY), _BODY)
)
# A step, and what to do after it, untimed.
Steps = tuple[Callable[[], None], Callable[[], None]]


def admission_steps() -> Steps:
    """One streamed request's pure admission steps, on the embedded demo configuration."""
    import orjson

    from infermeter.config import load_config
    from infermeter.journal_files import admission_line
    from infermeter.records import RequestStatus
    from sidecar.accounting import Call, admitted_fields, ending_fields
    from sidecar.admission import identify, plan, upstream_headers
    from sidecar.pool import request_head
    from sidecar.state import build_view

    view = build_view(load_config(), "small-0")
    headers = [
        (b"host", b"127.0.0.1:9000"),
        (b"authorization", b"Bearer im-demo-search"),
        (b"content-type", b"application/json"),
        (b"content-length", b"120"),
    ]
    body = _BODY

    def one() -> None:
        call = Call(os.urandom(16).hex(), "/v1/chat/completions", time.time(), time.perf_counter())
        team = identify(view, "POST", call.endpoint, headers)
        assert isinstance(team, str)  # a key's team (a gateway signature would be Signed)
        call.team = team
        planned = plan(view, call.endpoint, body, default_reserve_tokens=256, metering_down=False)
        assert not isinstance(planned, BaseException)
        call.model, call.served_version, call.stream = (
            planned.model,
            planned.served_version,
            planned.stream,
        )
        record = admitted_fields(call, "small-0", None) | ending_fields(
            call, RequestStatus.INTERRUPTED, 502, None, None, None, time.perf_counter()
        )
        admission_line(record)
        out = upstream_headers(view, headers, None)
        sent = orjson.dumps(planned.body)
        request_head(b"POST", call.endpoint.encode(), b"127.0.0.1:8000", out, len(sent))

    return one, lambda: None


class _Transport:
    """What the server's connection asks of its transport, doing nothing."""

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 9000)

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def server_steps(task: bool) -> Steps:
    """The sidecar's HTTP server reading one request on a kept-alive connection (on uvloop, as
    the sidecar runs); the app's task is made (``task``) and cancelled after, untimed."""
    import asyncio

    import uvloop

    from sidecar import http_server

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)

    async def app(scope: object, receive: object, send: object) -> None:
        """Never run: each task is cancelled before its first step."""

    class NoTask(http_server._Connection):
        __slots__ = ()

        def _start(self, exchange: http_server._Exchange) -> None:
            self._answering = exchange

    server = http_server.HttpServer(app, "127.0.0.1", 9000)
    server.loop = loop
    conn = (http_server._Connection if task else NoTask)(server)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn._disarm()

    def one() -> None:
        conn.data_received(_REQUEST)
        assert conn._answering is not None, "the request was not read whole"

    def after() -> None:
        # The next request finds the connection as a kept-alive one between requests does.
        conn._answering = None
        for made in list(server.tasks):
            made.cancel()
        loop.run_until_complete(asyncio.sleep(0))

    return one, after


_STEPS: dict[str, Callable[[], Steps]] = {
    "admission": admission_steps,
    "server": lambda: server_steps(task=True),
    "server-notask": lambda: server_steps(task=False),
}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _other(turn: int, done: int) -> None:
    """The other process: on each byte from ``turn``, read 16 MB over and over for 2 ms (every
    cache line and page of it), then answer."""
    memory = bytearray(_TOUCH_BYTES)
    while os.read(turn, 1):
        end = time.perf_counter() + _GAP_SECONDS
        while time.perf_counter() < end:
            memory.find(b"\x01")
        os.write(done, b"x")


_EVICT_FROM = bytearray(_EVICT_BYTES)


def _evict() -> None:
    """Read 64 MB and write as much: no level of cache keeps any of this process's own memory."""
    bytes(_EVICT_FROM)


def measure(samples: int, rounds: int, which: str = "admission") -> dict[str, float]:
    """Median µs of the steps after each kind of gap, over ``rounds`` interleaved rounds."""
    steps, after = _STEPS[which]()
    for _ in range(200):
        steps()
        after()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    turn_r, turn_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(turn_w)
        os.close(done_r)
        _other(turn_r, done_w)
        os._exit(0)
    os.close(turn_r)
    os.close(done_w)

    def other() -> None:
        os.write(turn_w, b"x")
        os.read(done_r, 1)

    gaps: dict[str, Callable[[], None]] = {
        "warm": lambda: _spin(_GAP_SECONDS),
        "idle": lambda: time.sleep(_GAP_SECONDS),
        "other": other,
        "evicted": _evict,
    }
    times: dict[str, list[float]] = {name: [] for name in gaps}
    try:
        for _ in range(rounds):
            for name, gap in gaps.items():
                for _ in range(samples):
                    gap()
                    start = time.perf_counter()
                    steps()
                    times[name].append(time.perf_counter() - start)
                    after()
    finally:
        os.close(turn_w)
        os.waitpid(child, 0)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main() -> None:
    """Print the median µs of the admission steps after each kind of gap."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="requests per gap per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the gaps interleaved")
    parser.add_argument(
        "--steps", nargs="+", choices=sorted(_STEPS), default=["admission"], help="what to time"
    )
    args = parser.parse_args()
    for which in args.steps:
        result = measure(args.samples, args.rounds, which)
        warm = result["warm"]
        print(f"{which} steps of one streamed request, one core, median µs after each gap")
        for name, us in result.items():
            print(f"  {name:>7} {us:8.1f}   x{us / warm:.1f}")


if __name__ == "__main__":
    main()
