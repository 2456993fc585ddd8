"""How many streamed chunks per second one simulated vLLM replica process can serve.

The replica (``infermeter simulate --replica ID``) runs in its own process on a loopback port,
with an engine profile fast enough that the simulated GPU is not what limits it. A separate
client process keeps ``C`` streaming chat completions in flight (each one re-issued as soon as
it finishes) and counts SSE ``data:`` events; the parent reads the server's CPU time from
``/proc/PID/stat`` around the measured window. The client is deliberately lean (an asyncio
``Protocol`` speaking HTTP/1.1 keep-alive on raw sockets, counting events by scanning bytes) so
that it is not the bottleneck; ``--client httpx`` swaps in httpx to show the difference.

    .venv/bin/python -m bench.sim_throughput --duration 10 --concurrency 16 64 256

Everything is bounded: each concurrency runs for ``--warmup`` + ``--duration`` seconds, the
server is stopped at the end, and only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import yaml

from bench.rawload import RepeatingStream, run_connections
from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.serving import free_port
from simulator.replica import replica_spec

__all__ = ["Result", "main", "run_benchmark"]

HOST = "127.0.0.1"
ClientKind = Literal["raw", "httpx"]
_DATA = b"data: "
_DONE = b"[DONE]"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
# ``--server-loop uvloop``: the same replica server, but run on uvloop. An experiment, to size
# what the event loop costs; the shipped command (``infermeter simulate``) is the default.
_UVLOOP_SERVER = """
import sys
from pathlib import Path

import uvloop

from infermeter.config import load_config
from simulator.serve import serve_replica

uvloop.run(serve_replica(load_config(Path(sys.argv[1])), sys.argv[2]))
"""


@dataclass(frozen=True)
class EngineSettings:
    """The simulated engine profile the benchmark gives the replica's model."""

    max_num_seqs: int
    step_base_ms: float
    step_per_seq_ms: float
    kv_cache_tokens: int = 50_000_000
    prefill_tokens_per_second: float = 1e9

    def ceiling(self, concurrency: int) -> float:
        """Chunks/s the simulated engine allows at ``concurrency``, with zero CPU cost."""
        batch = min(concurrency, self.max_num_seqs)
        return batch * 1000.0 / (self.step_base_ms + self.step_per_seq_ms * batch)


@dataclass(frozen=True)
class Result:
    """One measured window at one concurrency."""

    concurrency: int
    client: str
    duration_s: float
    chunks: int
    requests: int
    errors: int
    chunks_per_s: float
    requests_per_s: float
    server_cpu_per_s: float
    server_cpu_us_per_chunk: float
    server_runq_wait_per_s: float
    client_cpu_per_s: float
    engine_ceiling_chunks_per_s: float
    loadavg_1m: float


# -- client process ------------------------------------------------------------------------------


class _Tally:
    """One connection's counts of SSE ``data:`` events and ``[DONE]`` markers, across reads."""

    __slots__ = ("data", "dones", "errors", "requests", "tail")

    def __init__(self) -> None:
        self.data = 0
        self.dones = 0
        self.requests = 0
        self.errors = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        """Count the events in ``chunk``, including one split across the previous read."""
        joined = self.tail + chunk
        self.data += joined.count(_DATA)
        self.dones += joined.count(_DONE)
        # Neither pattern fits in five bytes, so nothing in the kept tail is counted twice.
        self.tail = joined[-5:]

    @property
    def chunks(self) -> int:
        """Data events other than the ``[DONE]`` terminator."""
        return self.data - self.dones


class _RawStream(RepeatingStream):
    """Counts every SSE event of every response into the shared tally."""

    def __init__(self, request: bytes, tally: _Tally, stop: asyncio.Event) -> None:
        super().__init__(request, stop)
        self.tally = tally

    def on_send(self) -> None:
        self.tally.tail = b""

    def on_body(self, data: bytes) -> None:
        self.tally.feed(data)

    def on_done(self) -> None:
        self.tally.requests += 1

    def on_error(self) -> None:
        self.tally.errors += 1


async def _raw_worker(port: int, request: bytes, tally: _Tally, stop: asyncio.Event) -> None:
    def on_connect_error() -> None:
        tally.errors += 1

    await run_connections(
        lambda: _RawStream(request, tally, stop), HOST, port, stop, on_connect_error
    )


async def _httpx_worker(
    client: Any, url: str, body: dict[str, Any], tally: _Tally, stop: asyncio.Event
) -> None:
    import httpx

    while not stop.is_set():
        tally.tail = b""
        try:
            async with client.stream("POST", url, json=body) as response:
                if response.status_code == 200:
                    async for chunk in response.aiter_raw():
                        tally.feed(chunk)
                    tally.requests += 1
                    continue
                tally.errors += 1
        except httpx.TransportError:
            tally.errors += 1
        await asyncio.sleep(0.05)


def _totals(tallies: list[_Tally]) -> tuple[int, int, int]:
    return (
        sum(t.chunks for t in tallies),
        sum(t.requests for t in tallies),
        sum(t.errors for t in tallies),
    )


def _request_bytes(port: int, body: bytes) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _drive(
    conn: Connection,
    port: int,
    model: str,
    concurrency: int,
    max_tokens: int,
    warmup: float,
    duration: float,
    kind: ClientKind,
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to a large number, please."}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    tallies = [_Tally() for _ in range(concurrency)]
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    client: Any = None
    if kind == "raw":
        request = _request_bytes(port, json.dumps(body).encode())
        tasks = [asyncio.create_task(_raw_worker(port, request, tally, stop)) for tally in tallies]
    else:
        import httpx

        client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            timeout=httpx.Timeout(60.0),
            trust_env=False,
        )
        url = f"http://{HOST}:{port}/v1/chat/completions"
        tasks = [
            asyncio.create_task(_httpx_worker(client, url, body, tally, stop)) for tally in tallies
        ]
    try:
        await asyncio.sleep(warmup)
        c0, r0, e0, cpu0 = *_totals(tallies), time.process_time()
        t0 = time.monotonic()
        conn.send(("start",))
        await asyncio.sleep(duration)
        c1, r1, e1, cpu1 = *_totals(tallies), time.process_time()
        t1 = time.monotonic()
        conn.send(("end", c1 - c0, r1 - r0, e1 - e0, (cpu1 - cpu0) / (t1 - t0), t1 - t0))
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if client is not None:
            await client.aclose()


def _client_main(
    conn: Connection,
    port: int,
    model: str,
    concurrency: int,
    max_tokens: int,
    warmup: float,
    duration: float,
    kind: ClientKind,
) -> None:
    """Entry point of the load-generating process."""
    coro: Coroutine[Any, Any, None] = _drive(
        conn, port, model, concurrency, max_tokens, warmup, duration, kind
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        asyncio.run(coro)
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro)
    conn.close()


# -- server process and measurement --------------------------------------------------------------


def write_config(path: Path, replica_id: str, port: int, engine: EngineSettings) -> str:
    """Write the benchmark config to ``path``; return the model name requests must ask for."""
    raw: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text(encoding="utf-8"))
    replica = next((r for r in raw["replicas"] if r["id"] == replica_id), None)
    if replica is None:
        raise SystemExit(f"no replica {replica_id!r} in {DEFAULT_CONFIG}")
    replica["upstream_url"] = f"http://{HOST}:{port}"
    if "max_num_seqs" in replica:  # a per-replica override would cap the batch below ours
        replica["max_num_seqs"] = engine.max_num_seqs
    engines = raw.setdefault("simulator", {}).setdefault("engines", {})
    profile = dict(engines.get(replica["model"], {}))
    profile.update(
        max_num_seqs=engine.max_num_seqs,
        kv_cache_tokens=engine.kv_cache_tokens,
        step_base_ms=engine.step_base_ms,
        step_per_seq_ms=engine.step_per_seq_ms,
        prefill_tokens_per_second=engine.prefill_tokens_per_second,
    )
    engines[replica["model"]] = profile
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    config = load_config(path, environ={})
    spec = replica_spec(config, replica_id)
    if spec.engine.max_num_seqs != engine.max_num_seqs:
        raise SystemExit(
            f"replica {replica_id} would run max_num_seqs={spec.engine.max_num_seqs}, "
            f"not the benchmark's {engine.max_num_seqs}"
        )
    return spec.served_model


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds used so far by process ``pid``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    # After the command name: state is field 3, utime field 14, stime field 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def runqueue_wait_seconds(pid: int) -> float:
    """Seconds the main thread of ``pid`` spent runnable but waiting for a CPU."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):  # kernels without schedstats
        return 0.0


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=1.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"simulated replica exited with {proc.returncode}:\n{log.read_text()[-2000:]}"
            )
        if _healthy(port):
            return
        time.sleep(0.1)
    raise SystemExit(f"simulated replica not healthy after {timeout:.0f}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _receive(conn: Connection, proc: multiprocessing.process.BaseProcess, limit: float) -> Any:
    """The load generator's next message; exit if it dies or goes quiet for ``limit`` s."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if conn.poll(0.25):
            try:
                return conn.recv()
            except EOFError:
                break
        if not proc.is_alive():
            break
    raise SystemExit(f"load generator failed (exit code {proc.exitcode})")


def _measure(
    server_pid: int,
    port: int,
    model: str,
    concurrency: int,
    args: argparse.Namespace,
    engine: EngineSettings,
) -> Result:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_client_main,
        args=(
            child,
            port,
            model,
            concurrency,
            args.max_tokens,
            args.warmup,
            args.duration,
            args.client,
        ),
        daemon=True,
    )
    proc.start()
    child.close()
    limit = args.warmup + args.duration + 30.0
    try:
        _receive(parent, proc, limit)
        cpu0, wait0 = cpu_seconds(server_pid), runqueue_wait_seconds(server_pid)
        t0 = time.monotonic()
        msg = _receive(parent, proc, limit)
        cpu1, wait1 = cpu_seconds(server_pid), runqueue_wait_seconds(server_pid)
        t1 = time.monotonic()
    finally:
        proc.join(timeout=15)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    _, chunks, requests, errors, client_cpu, window = msg
    server_cpu = (cpu1 - cpu0) / (t1 - t0)
    chunks_per_s = chunks / window
    return Result(
        concurrency=concurrency,
        client=args.client,
        duration_s=round(window, 3),
        chunks=chunks,
        requests=requests,
        errors=errors,
        chunks_per_s=round(chunks_per_s, 1),
        requests_per_s=round(requests / window, 2),
        server_cpu_per_s=round(server_cpu, 3),
        server_cpu_us_per_chunk=round(1e6 * server_cpu / chunks_per_s, 1) if chunks else 0.0,
        server_runq_wait_per_s=round((wait1 - wait0) / (t1 - t0), 3),
        client_cpu_per_s=round(client_cpu, 3),
        engine_ceiling_chunks_per_s=round(engine.ceiling(concurrency), 0),
        loadavg_1m=round(os.getloadavg()[0], 2),
    )


def run_benchmark(args: argparse.Namespace) -> list[Result]:
    """Start one replica, measure each concurrency in turn, stop the replica."""
    engine = EngineSettings(
        max_num_seqs=max(256, *args.concurrency),
        step_base_ms=args.step_base_ms,
        step_per_seq_ms=args.step_per_seq_ms,
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="sim-throughput-") as tmp:
        port = free_port(HOST)
        cfg = Path(tmp) / "infermeter.yaml"
        model = write_config(cfg, args.replica, port, engine)
        log = Path(tmp) / "replica.log"
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("INFERMETER")}
        with log.open("wb") as err:
            if args.server_loop == "uvloop":
                cmd = [sys.executable, "-c", _UVLOOP_SERVER, str(cfg), args.replica]
            else:
                cmd = [sys.executable, "-m", "launcher", "simulate"]
                cmd += ["--config", str(cfg), "--replica", args.replica]
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )
        try:
            _wait_healthy(proc, port, log, timeout=30.0)
            for concurrency in args.concurrency:
                if proc.poll() is not None:
                    raise SystemExit(f"simulated replica exited:\n{log.read_text()[-2000:]}")
                results.append(_measure(proc.pid, port, model, concurrency, args, engine))
                if not args.json:
                    print(_row(results[-1]), flush=True)
                time.sleep(0.5)  # let aborted streams drain before the next level
        finally:
            _stop(proc)
    return results


# -- output --------------------------------------------------------------------------------------

_HEADER = (
    f"{'conc':>5} {'chunks/s':>10} {'req/s':>8} {'srv CPU/s':>10} {'us/chunk':>9} "
    f"{'srv wait/s':>10} {'cli CPU/s':>10} {'engine max':>11} {'errors':>6} {'load1':>6}"
)


def _row(r: Result) -> str:
    return (
        f"{r.concurrency:>5} {r.chunks_per_s:>10,.0f} {r.requests_per_s:>8.1f} "
        f"{r.server_cpu_per_s:>10.2f} {r.server_cpu_us_per_chunk:>9.1f} "
        f"{r.server_runq_wait_per_s:>10.2f} {r.client_cpu_per_s:>10.2f} {r.engine_ceiling_chunks_per_s:>11,.0f} "
        f"{r.errors:>6} {r.loadavg_1m:>6.2f}"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim_throughput",
        description="Streamed chunks/s and CPU per chunk of one simulated vLLM replica process.",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per level")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[16, 64, 256],
        help="concurrent streams to keep in flight; one measurement per value",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="load generator: lean raw-socket HTTP/1.1 (default) or httpx",
    )
    parser.add_argument(
        "--server-loop",
        choices=["cli", "uvloop"],
        default="cli",
        help="cli: run `infermeter simulate --replica` as shipped (default); uvloop: the same "
        "server forced onto uvloop, to size the event loop's share",
    )
    parser.add_argument("--replica", default="small-0", help="replica of defaults.yaml to serve")
    parser.add_argument("--step-base-ms", type=float, default=1.0, help="engine: fixed step time")
    parser.add_argument(
        "--step-per-seq-ms", type=float, default=0.02, help="engine: step time per running seq"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print a table (or JSON)."""
    args = build_parser().parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.max_tokens < 1:
        raise SystemExit("--duration and --max-tokens must be positive, --warmup non-negative")
    if any(c < 1 or c > 4096 for c in args.concurrency):
        raise SystemExit("--concurrency values must be between 1 and 4096")
    load_before = os.getloadavg()
    if not args.json:
        print(
            f"{os.cpu_count()} CPUs ({_cpu_model()}), load average {load_before[0]:.2f}; "
            f"client={args.client}, server={args.server_loop}, max_tokens={args.max_tokens}, {args.duration:g}s per level"
        )
        print(_HEADER, flush=True)
    results = run_benchmark(args)
    if args.json:
        doc = {
            "machine": {
                "cpus": os.cpu_count(),
                "cpu_model": _cpu_model(),
                "python": platform.python_version(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            },
            "settings": {
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "max_tokens": args.max_tokens,
                "client": args.client,
                "server_loop": args.server_loop,
                "replica": args.replica,
                "step_base_ms": args.step_base_ms,
                "step_per_seq_ms": args.step_per_seq_ms,
            },
            "results": [asdict(r) for r in results],
        }
        print(json.dumps(doc, indent=2))
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
