"""What the sidecar costs on top of a direct connection, with an nginx reverse proxy as the floor.

One run, on this machine, loopback only. A simulated vLLM replica (``infermeter simulate
--replica small-0``, restarted with three engine profiles) is reached three ways:

- ``direct``: the client talks to the replica;
- ``nginx``: through nginx (one worker, ``proxy_buffering off``, HTTP/1.1 keep-alive upstream);
- ``sidecar``: through one ``infermeter sidecar`` process (team key ``im-demo-search``, model
  ``chat-small``), which authenticates, meters, rewrites and spools every request.

A separate client process (an asyncio ``Protocol`` on raw sockets, HTTP/1.1 keep-alive, scanning
bytes; the same lean design as ``bench/sim_throughput.py``) drives each phase, and the parent
reads the proxy's CPU time (``/proc/PID/task/*/schedstat``; nginx: master plus worker) and memory
(``VmRSS``) around each measured window. Phases, each on every path in turn:

1. ``ttft_c1`` (fast engine, 1 ms steps): sequential 16-token requests on one connection: TTFT.
   ``ttft_paired`` (same engine): the same requests, one connection per path, the three paths
   taking turns request by request (the order rotating each round). Added TTFT is each round's
   difference to direct, so the machine's drift, which moves a whole window of one path by
   milliseconds on a shared host, hits all paths alike. The c=1 target is judged on it.
2. ``c64_1tok`` (fast engine): 64 connections of 1-token requests: fixed CPU per request.
   ``c16_json`` (fast engine): 16 connections of non-streamed 16-token requests: CPU per
   request answered whole (the sidecar reads vLLM's stream and answers JSON, or relays JSON).
3. ``max_throughput`` (fast engine): 256 streams of 256 tokens: max chunks/s, CPU per chunk.
4. ``c64_16tok`` (the defaults' ``chat-small`` engine, ~60 tokens/s per stream at 64): 64 streams
   of 16 tokens, closed loop, starts staggered: TTFT at c=64. (On the fast engine any closed loop
   of 64 streams saturates the slowest process; phase 3 shows what TTFT then becomes.)
5. ``c64_64tok`` (same engine): 64 streams of 64 tokens: CPU per request and per chunk.
6. ``paced_500`` (50 ms steps, 0 per sequence: 20 tokens/s at any batch): 500 streams, CPU per
   chunk (nginx and sidecar).
7. ``rss_1000`` (same): 1000 open streams, proxy RSS.

TTFT is the time from sending the request to receiving the first SSE event that carries
``"content":`` and is not the ``"role"`` chunk; "added" TTFT is a path's figure minus direct's.

    .venv/bin/python -m bench.sidecar_overhead            # about 3 minutes
    .venv/bin/python -m bench.sidecar_overhead --quick    # about 1.5 minutes, shorter windows
    .venv/bin/python -m bench.sidecar_overhead --json > overhead.json

Every process it starts (replica, nginx, sidecar, client) is stopped when it ends, also on
Ctrl-C, SIGTERM or an error; they are also asked (``PR_SET_PDEATHSIG``) to exit if it dies.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import http.client
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any, cast

import yaml

from bench.otlp_sink import OtlpSink
from bench.rawload import RepeatingStream, run_connections
from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.serving import free_port
from simulator.replica import replica_spec

__all__ = ["main", "run_benchmark"]

HOST = "127.0.0.1"
REPLICA = "small-0"
SIDECAR_MODEL = "chat-small"
API_KEY = "im-demo-search"
PATHS = ("direct", "nginx", "sidecar")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1

# Targets of the data-plane issue, as ratios to nginx measured in the same run where they are.
TARGET_CPU_RATIO = 3.0  # sidecar CPU per 64-chunk request / nginx's
TARGET_JSON_RATIO = 5.0  # sidecar CPU per non-streamed 16-token request / nginx's
TARGET_ADDED_P50_C1_MS = 0.3
TARGET_ADDED_P99_C64_MS = 2.0
TARGET_PACED_RATIO = 1.5  # sidecar CPU per paced chunk / nginx's
TARGET_CHUNKS_PER_S = 50_000.0
TARGET_RSS_MB = 60.0


@dataclass(frozen=True)
class Engine:
    """The simulated engine profile given to the replica's model."""

    step_base_ms: float
    step_per_seq_ms: float
    max_num_seqs: int = 2048
    kv_cache_tokens: int = 200_000_000
    prefill_tokens_per_second: float = 1e9


FAST = Engine(step_base_ms=1.0, step_per_seq_ms=0.001)  # about 1,000 tokens/s per sequence
DEMO = Engine(step_base_ms=9.0, step_per_seq_ms=0.12)  # chat-small's profile in the defaults
PACED = Engine(step_base_ms=50.0, step_per_seq_ms=0.0)  # 20 tokens/s per sequence


@dataclass(frozen=True)
class Plan:
    """Sizes and durations of every phase."""

    c1_requests: int
    window_s: float
    warmup_s: float
    throughput_concurrency: int = 256
    paced_streams: int = 500
    rss_streams: int = 1000
    paced_window_s: float = 8.0
    rss_window_s: float = 3.0
    paired_rounds: int = 200


FULL = Plan(c1_requests=200, window_s=6.0, warmup_s=2.0)
QUICK = Plan(
    c1_requests=60,
    window_s=2.5,
    warmup_s=1.0,
    paced_window_s=4.0,
    rss_window_s=2.0,
    paired_rounds=80,
)


# -- client process ------------------------------------------------------------------------------

_DATA = b"data: "
_DONE = b"[DONE]"
_CONTENT = b'"content":'
_ROLE = b'"role"'


@dataclass(frozen=True)
class LoadSpec:
    """One phase as the client runs it."""

    port: int
    request: bytes
    concurrency: int
    warmup_s: float
    duration_s: float
    max_requests: int = 0  # end the window early once this many requests completed (0: never)
    stagger_s: float = 0.0  # spread the first requests of the streams over this many seconds
    wait_streaming: bool = False  # after warm-up, also wait until every stream has a token
    record_ttft: bool = True


@dataclass
class _Stats:
    """Counts shared by every connection of a phase."""

    chunks: int = 0
    requests: int = 0
    errors: int = 0
    streaming: int = 0  # connections that have received at least one token
    recording: bool = False
    ttft: list[float] = field(default_factory=list)
    enough: asyncio.Event = field(default_factory=asyncio.Event)
    goal: int = 0


class _Stream(RepeatingStream):
    """Counts chunks, requests and time to the first content chunk into the shared stats."""

    def __init__(self, request: bytes, stats: _Stats, stop: asyncio.Event) -> None:
        super().__init__(request, stop)
        self.stats = stats
        self.tail = b""
        self.sent_at = 0.0
        self.first = False
        self.content = 0
        self.role = 0
        self.ever_streamed = False

    def on_send(self) -> None:
        self.tail, self.first, self.content, self.role = b"", False, 0, 0
        self.sent_at = time.perf_counter()

    def on_error(self) -> None:
        self.stats.errors += 1

    def on_body(self, data: bytes) -> None:
        now = time.perf_counter()
        stats = self.stats
        tail = self.tail
        joined = tail + data
        # Count what ends in this read: occurrences inside the kept tail were counted before.
        stats.chunks += (
            joined.count(_DATA) - tail.count(_DATA) - joined.count(_DONE) + tail.count(_DONE)
        )
        if not self.first:
            self.content += joined.count(_CONTENT) - tail.count(_CONTENT)
            self.role += joined.count(_ROLE) - tail.count(_ROLE)
            if self.content > self.role:  # a content event that is not the role chunk
                self.first = True
                if stats.recording:
                    stats.ttft.append(now - self.sent_at)
                if not self.ever_streamed:
                    self.ever_streamed = True
                    stats.streaming += 1
        self.tail = joined[-12:]

    def on_done(self) -> None:
        stats = self.stats
        stats.requests += 1
        if stats.goal and stats.requests >= stats.goal:
            stats.enough.set()


async def _worker(
    spec: LoadSpec, delay: float, stats: _Stats, stop: asyncio.Event, live: set[RepeatingStream]
) -> None:
    if delay > 0:
        await asyncio.sleep(delay)

    def on_connect_error() -> None:
        stats.errors += 1

    await run_connections(
        lambda: _Stream(spec.request, stats, stop), HOST, spec.port, stop, on_connect_error, live
    )


async def _phase(conn: Connection, spec: LoadSpec) -> None:
    stats = _Stats()
    stop = asyncio.Event()
    live: set[RepeatingStream] = set()
    step = spec.stagger_s / spec.concurrency
    tasks = [
        asyncio.create_task(_worker(spec, i * step, stats, stop, live))
        for i in range(spec.concurrency)
    ]
    try:
        await asyncio.sleep(spec.warmup_s)
        if spec.wait_streaming:
            deadline = time.monotonic() + 60.0
            while stats.streaming < spec.concurrency and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        c0, r0, e0 = stats.chunks, stats.requests, stats.errors
        cpu0, t0 = time.process_time(), time.monotonic()
        stats.recording = True
        if spec.max_requests:
            stats.goal = r0 + spec.max_requests
        conn.send(("start",))
        if spec.max_requests:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stats.enough.wait(), spec.duration_s)
        else:
            await asyncio.sleep(spec.duration_s)
        stats.recording = False
        window = time.monotonic() - t0
        out = {
            "chunks": stats.chunks - c0,
            "requests": stats.requests - r0,
            "errors": stats.errors - e0,
            "window_s": window,
            "client_cpu_s": time.process_time() - cpu0,
            "streaming": stats.streaming,
            "ttft_s": stats.ttft if spec.record_ttft else [],
        }
        conn.send(("end", out))
        # Keep the streams open until the parent has read memory and CPU.
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    finally:
        stop.set()
        for proto in list(live):
            if proto.transport is not None:
                proto.transport.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    conn.send(("closed",))


@dataclass(frozen=True)
class PairedSpec:
    """Sequential requests on one connection per path, the paths taking turns each round."""

    requests: dict[str, tuple[int, bytes]]  # path -> (port, request)
    rounds: int
    warmup_rounds: int


async def _ttft_once(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> float:
    """Send ``request``, read its chunked response to the end; seconds to the first content."""
    sent = time.perf_counter()
    writer.write(request)
    await reader.readuntil(b"\r\n\r\n")
    seen, first = b"", None
    while not seen.endswith(b"\r\n0\r\n\r\n"):
        block = await reader.read(65536)
        if not block:
            raise ConnectionError("the proxy closed the connection mid-response")
        seen += block
        if first is None and seen.count(_CONTENT) > seen.count(_ROLE):
            first = time.perf_counter() - sent
    if first is None:
        raise ConnectionError("a response without a content event")
    return first


async def _paired(conn: Connection, spec: PairedSpec) -> None:
    """TTFT of every path, round by round, so that the machine's drift hits all paths alike."""
    streams = {
        path: await asyncio.open_connection(HOST, port) for path, (port, _) in spec.requests.items()
    }
    paths = list(spec.requests)
    ttft: dict[str, list[float]] = {path: [] for path in paths}
    try:
        for i in range(spec.warmup_rounds + spec.rounds):
            # The order rotates, so that no path always follows the same one.
            for path in paths[i % len(paths) :] + paths[: i % len(paths)]:
                reader, writer = streams[path]
                took = await _ttft_once(reader, writer, spec.requests[path][1])
                if i >= spec.warmup_rounds:
                    ttft[path].append(took)
    finally:
        for _, writer in streams.values():
            writer.close()
    conn.send(("paired", ttft))


def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM to this process when its parent dies (best effort)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _client_main(conn: Connection) -> None:
    """Entry point of the load-generating process: run phases until told to quit."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "phase":
                runner.run(_phase(conn, cast(LoadSpec, msg[1])))
            elif msg[0] == "paired":
                runner.run(_paired(conn, cast(PairedSpec, msg[1])))
            else:
                return


# -- processes -----------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid``."""
    text = _read(f"/proc/{pid}/task/{pid}/children")
    if text is not None:
        return [int(x) for x in text.split()]
    found = []
    for entry in os.listdir("/proc"):
        stat = _read(f"/proc/{entry}/stat") if entry.isdigit() else None
        if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds used so far by ``pids``: every thread's ``schedstat`` run time (ns precise),
    or utime+stime from ``/proc/PID/stat`` (clock ticks) where schedstat is missing."""
    total = 0.0
    for pid in pids:
        ns, ok = 0, False
        with contextlib.suppress(OSError, ValueError, IndexError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                text = _read(f"/proc/{pid}/task/{tid}/schedstat")
                if text:
                    ns += int(text.split()[0])
                    ok = True
        if ok:
            total += ns / 1e9
            continue
        stat = _read(f"/proc/{pid}/stat")
        if stat:
            fields = stat[stat.rindex(")") + 2 :].split()
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def user_sys_ticks(pids: Sequence[int]) -> tuple[int, int]:
    """utime and stime so far (clock ticks) over every thread of ``pids``."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = _read(f"/proc/{pid}/task/{tid}/stat")
                if stat:
                    fields = stat[stat.rindex(")") + 2 :].split()
                    user, system = user + int(fields[11]), system + int(fields[12])
    return user, system


def io_calls(pids: Sequence[int]) -> tuple[int, int]:
    """Read and write system calls so far (``syscr``, ``syscw`` of ``/proc/PID/io``) over ``pids``."""
    reads = writes = 0
    for pid in pids:
        for line in (_read(f"/proc/{pid}/io") or "").splitlines():
            name, _, value = line.partition(": ")
            if name == "syscr":
                reads += int(value)
            elif name == "syscw":
                writes += int(value)
    return reads, writes


def minor_faults(pids: Sequence[int]) -> int:
    """Minor page faults so far (``minflt`` of ``/proc/PID/stat``) over ``pids``."""
    total = 0
    for pid in pids:
        stat = _read(f"/proc/{pid}/stat")
        if stat:
            total += int(stat[stat.rindex(")") + 2 :].split()[7])
    return total


def rss_kib(pids: Sequence[int], key: str = "VmRSS") -> int:
    """Sum of ``key`` (VmRSS, VmHWM) in KiB over ``pids``."""
    total = 0
    for pid in pids:
        for line in (_read(f"/proc/{pid}/status") or "").splitlines():
            if line.startswith(key + ":"):
                total += int(line.split()[1])
    return total


def _healthy(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=1.0)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class Service:
    """A subprocess this benchmark started; ``stop`` is safe to call more than once."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,  # the parent is single-threaded here
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pids(self) -> list[int]:
        """The process and its direct children (nginx's workers)."""
        return [self.pid, *children(self.pid)]

    def wait_ready(self, port: int, path: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"{self.name} exited with {self.proc.returncode}:\n"
                    f"{self.log.read_text(errors='replace')[-2000:]}"
                )
            if _healthy(port, path):
                return
            time.sleep(0.1)
        raise SystemExit(f"{self.name} not ready after {timeout:.0f}s")

    def stop(self, sig: signal.Signals = signal.SIGINT) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def write_config(
    path: Path, tmp: Path, replica_port: int, engine: Engine, sidecar: dict[str, Any] | None = None
) -> str:
    """The embedded defaults with ``REPLICA`` on ``replica_port``, ``engine`` as its model's
    profile, teams without limits, the spool in ``tmp`` and ``sidecar`` settings applied;
    returns the served model name."""
    raw: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text(encoding="utf-8"))
    replica = next(r for r in raw["replicas"] if r["id"] == REPLICA)
    replica["upstream_url"] = f"http://{HOST}:{replica_port}"
    replica["max_num_seqs"] = engine.max_num_seqs
    replica.pop("sidecar_listen", None)
    for team in raw["teams"]:
        team["limits"] = {}
    raw.setdefault("sidecar", {})["spool_dir"] = str(tmp / "spool")
    raw["sidecar"].update(sidecar or {})
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
    spec = replica_spec(load_config(path, environ={}), REPLICA)
    if spec.engine.max_num_seqs != engine.max_num_seqs:
        raise SystemExit(f"replica {REPLICA} would run max_num_seqs={spec.engine.max_num_seqs}")
    return spec.served_model


NGINX_CONF = """\
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log {tmp}/nginx-access.log;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    keepalive_requests 1000000;
    upstream replica {{
        server {host}:{upstream};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen {host}:{port} backlog=4096;
        location / {{
            proxy_pass http://replica;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
        location = /nginx-health {{ return 200 "ok"; }}
    }}
}}
"""


@dataclass
class Stack:
    """The replica and the two proxies in front of it."""

    replica: Service
    nginx: Service
    sidecar: Service
    ports: dict[str, int]
    served_model: str

    def proxy(self, path: str) -> Service:
        return {"direct": self.replica, "nginx": self.nginx, "sidecar": self.sidecar}[path]


def _env() -> dict[str, str]:
    # No INFERMETER__ overrides from the caller's shell, and no OTel export: the defaults.
    drop = ("INFERMETER", "OTEL_")
    return {k: v for k, v in os.environ.items() if not k.upper().startswith(drop)}


@contextlib.contextmanager
def stack(
    tmp: Path,
    engine: Engine,
    nginx_bin: str,
    tag: str,
    launcher: Path | None = None,
    sidecar_settings: dict[str, Any] | None = None,
    sidecar_env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """Start replica, nginx and sidecar; stop all three on the way out, whatever happens.

    ``launcher``: a Python script run instead of ``-m launcher`` for the sidecar only, with
    the same arguments (to measure a patched sidecar, or one on another event loop);
    ``sidecar_env``: variables for the sidecar only (the OTEL_* ones of ``--otlp-metrics``)."""
    base = tmp / tag
    base.mkdir()
    ports = {path: free_port(HOST) for path in PATHS}
    cfg = base / "infermeter.yaml"
    model = write_config(cfg, base, ports["direct"], engine, sidecar_settings)
    conf = base / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(tmp=base, host=HOST, upstream=ports["direct"], port=ports["nginx"])
    )
    env = _env()
    py = [sys.executable, "-m", "launcher"]
    started: list[Service] = []
    try:
        replica = Service(
            "replica",
            [*py, "simulate", "--config", str(cfg), "--replica", REPLICA],
            base / "replica.log",
            env,
        )
        started.append(replica)
        nginx_cmd = [nginx_bin, "-p", str(base), "-c", str(conf)]
        nginx_cmd += ["-e", str(base / "nginx-error.log"), "-g", "daemon off;"]
        nginx = Service(
            "nginx",
            nginx_cmd,
            base / "nginx.out",
            env,
        )
        started.append(nginx)
        side_cmd = [sys.executable, str(launcher)] if launcher else [*py]
        side_cmd += ["sidecar", "--config", str(cfg), "--replica", REPLICA]
        side_cmd += ["--listen", f"{HOST}:{ports['sidecar']}"]
        sidecar = Service(
            "sidecar",
            side_cmd,
            base / "sidecar.log",
            {**env, **(sidecar_env or {})},
        )
        started.append(sidecar)
        replica.wait_ready(ports["direct"], "/health")
        nginx.wait_ready(ports["nginx"], "/nginx-health")
        sidecar.wait_ready(ports["sidecar"], "/healthz")
        yield Stack(replica, nginx, sidecar, ports, model)
    finally:
        for service in reversed(started):
            # nginx: SIGQUIT is a graceful stop, SIGTERM/SIGINT a fast one; fast is what we want.
            service.stop(signal.SIGTERM if service.name == "nginx" else signal.SIGINT)


def request_bytes(
    port: int, model: str, max_tokens: int, key: str | None, stream: bool = True
) -> bytes:
    """A chat completion (streamed unless ``stream`` is false) as raw HTTP/1.1 bytes."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Count to a large number, please."}],
            "stream": stream,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    ).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# -- measurement ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One measured window of one phase on one path."""

    phase: str
    path: str
    concurrency: int
    max_tokens: int
    window_s: float
    chunks: int
    requests: int
    errors: int
    proxy_cpu_s: float | None  # None on the direct path: there is no proxy
    replica_cpu_s: float
    client_cpu_s: float
    proxy_rss_mb: float | None
    proxy_hwm_mb: float | None
    streaming: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_samples: int
    loadavg_1m: float
    # The kernel's share of the proxy's CPU in the window (utime/stime ticks): system calls
    # and wake-ups, against the proxy's own code.
    proxy_sys_share: float | None = None
    # The proxy's read and write system calls in the window (``/proc/PID/io``: syscr, syscw;
    # every call that reads or writes, sockets and files alike).
    proxy_reads: int | None = None
    proxy_writes: int | None = None
    # The proxy's minor page faults in the window (memory the kernel had to map on first touch).
    proxy_faults: int | None = None

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.window_s if self.window_s else 0.0

    @property
    def chunks_per_request(self) -> float:
        return self.chunks / self.requests if self.requests else 0.0

    @property
    def proxy_cpu_per_s(self) -> float | None:
        if self.proxy_cpu_s is None or not self.window_s:
            return None
        return self.proxy_cpu_s / self.window_s

    @property
    def us_per_chunk(self) -> float | None:
        if self.proxy_cpu_s is None or not self.chunks:
            return None
        return 1e6 * self.proxy_cpu_s / self.chunks

    @property
    def us_per_request(self) -> float | None:
        if self.proxy_cpu_s is None or not self.requests:
            return None
        return 1e6 * self.proxy_cpu_s / self.requests

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            chunks_per_s=round(self.chunks_per_s, 1),
            proxy_cpu_per_s=_r(self.proxy_cpu_per_s, 3),
            replica_cpu_per_s=round(self.replica_cpu_s / self.window_s, 3),
            client_cpu_per_s=round(self.client_cpu_s / self.window_s, 3),
            proxy_us_per_chunk=_r(self.us_per_chunk, 2),
            proxy_us_per_request=_r(self.us_per_request, 1),
        )
        return out


def _r(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


def _quantile(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    i = min(len(sorted_s) - 1, max(0, math.ceil(q * len(sorted_s)) - 1))
    return 1000.0 * sorted_s[i]


class Client:
    """The load-generating process and its pipe."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def receive(self, limit: float, tick: Callable[[], None] | None = None) -> Any:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.conn.poll(0.2):
                try:
                    return self.conn.recv()
                except EOFError:
                    break
            if tick is not None:
                tick()
            if not self.proc.is_alive():
                break
        raise SystemExit(f"load generator failed or stalled (exit code {self.proc.exitcode})")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("quit",))
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


@dataclass
class Profiler:
    """Optional py-spy recording of the sidecar during chosen phases."""

    directory: Path | None
    exe: str | None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, pid: int, seconds: float) -> None:
        if self.directory is None or self.exe is None:
            return
        out = self.directory / f"{name}.txt"
        cmd = [
            self.exe,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--nonblocking",
            "--format",
            "raw",
            "--duration",
            str(max(1, int(seconds))),
            "-o",
            str(out),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append((name, proc))

    def finish(self) -> None:
        for _, proc in self.procs:
            # The window is over (a phase with a request count ends before its duration): py-spy
            # writes what it recorded when interrupted, and nothing when killed.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()


def measure(
    client: Client,
    st: Stack,
    path: str,
    phase: str,
    spec: LoadSpec,
    max_tokens: int,
    profiler: Profiler | None = None,
) -> Window:
    """Run one phase on one path and read the proxy's CPU and memory around its window."""
    proxy = st.proxy(path)
    client.conn.send(("phase", spec))
    limit = spec.warmup_s + spec.stagger_s + 90.0
    client.receive(limit)  # "start"
    pids = proxy.pids() if path != "direct" else []
    cpu0, rep0 = cpu_seconds(pids), cpu_seconds([st.replica.pid])
    ticks0, io0, faults0 = user_sys_ticks(pids), io_calls(pids), minor_faults(pids)
    if profiler is not None and path == "sidecar":
        profiler.start(phase, st.sidecar.pid, spec.duration_s)
    peak = 0

    def sample() -> None:
        nonlocal peak
        peak = max(peak, rss_kib(pids))

    msg = client.receive(spec.duration_s + 30.0, sample)  # "end"
    cpu1, rep1 = cpu_seconds(pids), cpu_seconds([st.replica.pid])
    ticks1, io1, faults1 = user_sys_ticks(pids), io_calls(pids), minor_faults(pids)
    sample()
    hwm = rss_kib(pids, "VmHWM")
    client.conn.send(("close",))
    client.receive(30.0)  # "closed"
    if profiler is not None:
        profiler.finish()
    out: dict[str, Any] = msg[1]
    ttft = sorted(out["ttft_s"])
    return Window(
        phase=phase,
        path=path,
        concurrency=spec.concurrency,
        max_tokens=max_tokens,
        window_s=round(out["window_s"], 3),
        chunks=out["chunks"],
        requests=out["requests"],
        errors=out["errors"],
        proxy_cpu_s=round(cpu1 - cpu0, 4) if pids else None,
        replica_cpu_s=round(rep1 - rep0, 4),
        client_cpu_s=round(out["client_cpu_s"], 4),
        proxy_rss_mb=round(peak / 1024, 1) if pids else None,
        proxy_hwm_mb=round(hwm / 1024, 1) if pids else None,
        streaming=out["streaming"],
        ttft_p50_ms=_r(_quantile(ttft, 0.50), 3),
        ttft_p99_ms=_r(_quantile(ttft, 0.99), 3),
        ttft_samples=len(ttft),
        loadavg_1m=round(os.getloadavg()[0], 2),
        proxy_sys_share=_share(ticks1[1] - ticks0[1], ticks1[0] - ticks0[0]) if pids else None,
        proxy_reads=io1[0] - io0[0] if pids else None,
        proxy_writes=io1[1] - io0[1] if pids else None,
        proxy_faults=faults1 - faults0 if pids else None,
    )


def _share(system: int, user: int) -> float | None:
    return round(system / (system + user), 2) if system + user else None


PHASES = (
    "ttft_c1",
    "ttft_paired",
    "c64_1tok",
    "c16_json",
    "max_throughput",
    "c64_16tok",
    "c64_64tok",
    "paced_500",
    "rss_1000",
)
_PROFILED = frozenset(
    {"ttft_c1", "c64_1tok", "c16_json", "max_throughput", "c64_64tok", "paced_500"}
)


def _settle(seconds: float = 0.5) -> None:
    time.sleep(seconds)  # let aborted streams drain before the next window


def run_benchmark(
    plan: Plan,
    nginx_bin: str,
    profile_dir: Path | None,
    echo: Callable[[str], None],
    launcher: Path | None = None,
    sidecar_settings: dict[str, Any] | None = None,
    phases: frozenset[str] | None = None,
    sidecar_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every phase (or those in ``phases``) on every path; returns the windows and the
    sidecar's idle RSS."""
    windows: list[Window] = []
    profiler = Profiler(profile_dir, shutil.which("py-spy") or _venv_tool("py-spy"))
    idle_rss: dict[str, float] = {}
    paired: dict[str, list[float]] = {}

    def run(
        st: Stack, phase: str, paths: Sequence[str], tokens: int, stream: bool = True, **kw: Any
    ) -> None:
        if phases is not None and phase not in phases:
            return
        for path in paths:
            spec = LoadSpec(st.ports[path], req(st, path, tokens, stream), **kw)
            profiled = profiler if phase in _PROFILED else None
            w = measure(client, st, path, phase, spec, tokens, profiled)
            windows.append(w)
            echo(_row(w))
            _settle()

    def wanted(*names: str) -> bool:
        return phases is None or not phases.isdisjoint(names)

    def req(st: Stack, path: str, max_tokens: int, stream: bool) -> bytes:
        port = st.ports[path]
        if path == "sidecar":
            return request_bytes(port, SIDECAR_MODEL, max_tokens, API_KEY, stream)
        return request_bytes(port, st.served_model, max_tokens, None, stream)

    p = plan
    client = Client()
    try:
        with tempfile.TemporaryDirectory(prefix="sidecar-overhead-") as tmp_name:
            tmp = Path(tmp_name)
            echo(_HEADER)
            if wanted("ttft_c1", "ttft_paired", "c64_1tok", "c16_json", "max_throughput"):
                with stack(
                    tmp, FAST, nginx_bin, "fast", launcher, sidecar_settings, sidecar_env
                ) as st:
                    idle_rss = {
                        path: round(rss_kib(st.proxy(path).pids()) / 1024, 1) for path in PATHS
                    }
                    run(
                        st,
                        "ttft_c1",
                        PATHS,
                        16,
                        concurrency=1,
                        warmup_s=0.5,
                        duration_s=60.0,
                        max_requests=p.c1_requests,
                    )
                    if wanted("ttft_paired"):
                        requests = {
                            path: (st.ports[path], req(st, path, 16, True)) for path in PATHS
                        }
                        client.conn.send(("paired", PairedSpec(requests, p.paired_rounds, 5)))
                        paired = client.receive(600.0)[1]
                        echo(_paired_row(paired))
                        _settle()
                    run(
                        st,
                        "c64_1tok",
                        PATHS,
                        1,
                        concurrency=64,
                        warmup_s=p.warmup_s / 2,
                        duration_s=p.window_s * 0.6,
                        stagger_s=0.05,
                        record_ttft=False,
                    )
                    run(
                        st,
                        "c16_json",
                        PATHS,
                        16,
                        stream=False,
                        concurrency=16,
                        warmup_s=p.warmup_s / 2,
                        duration_s=p.window_s * 0.6,
                        stagger_s=0.05,
                        record_ttft=False,
                    )
                    run(
                        st,
                        "max_throughput",
                        PATHS,
                        256,
                        concurrency=p.throughput_concurrency,
                        warmup_s=p.warmup_s,
                        duration_s=p.window_s,
                        stagger_s=0.3,
                    )
            if wanted("c64_16tok", "c64_64tok"):
                with stack(
                    tmp, DEMO, nginx_bin, "demo", launcher, sidecar_settings, sidecar_env
                ) as st:
                    run(
                        st,
                        "c64_16tok",
                        PATHS,
                        16,
                        concurrency=64,
                        warmup_s=p.warmup_s,
                        duration_s=p.window_s,
                        stagger_s=0.3,
                    )
                    run(
                        st,
                        "c64_64tok",
                        PATHS,
                        64,
                        concurrency=64,
                        warmup_s=p.warmup_s,
                        duration_s=p.window_s,
                        stagger_s=1.0,
                    )
            if wanted("paced_500", "rss_1000"):
                with stack(
                    tmp, PACED, nginx_bin, "paced", launcher, sidecar_settings, sidecar_env
                ) as st:
                    tokens = int(20 * (p.paced_window_s + p.warmup_s + 10))
                    run(
                        st,
                        "paced_500",
                        ("nginx", "sidecar"),
                        tokens,
                        concurrency=p.paced_streams,
                        warmup_s=p.warmup_s,
                        duration_s=p.paced_window_s,
                        stagger_s=1.0,
                        wait_streaming=True,
                        record_ttft=False,
                    )
                    tokens = int(20 * (p.rss_window_s + p.warmup_s + 20))
                    run(
                        st,
                        "rss_1000",
                        ("nginx", "sidecar"),
                        tokens,
                        concurrency=p.rss_streams,
                        warmup_s=p.warmup_s,
                        duration_s=p.rss_window_s,
                        stagger_s=2.0,
                        wait_streaming=True,
                        record_ttft=False,
                    )
    finally:
        client.close()
    return {"windows": windows, "idle_rss_mb": idle_rss, "paired_ttft_s": paired}


def paired_added_ms(paired: dict[str, list[float]], path: str, q: float) -> float | None:
    """The ``q`` quantile over rounds of ``path``'s TTFT minus direct's in the same round, ms."""
    mine, direct = paired.get(path), paired.get("direct")
    if not mine or not direct:
        return None
    return _quantile(sorted(a - b for a, b in zip(mine, direct, strict=True)), q)


def _paired_row(paired: dict[str, list[float]]) -> str:
    parts = []
    for path in ("nginx", "sidecar"):
        p50, p90 = paired_added_ms(paired, path, 0.5), paired_added_ms(paired, path, 0.9)
        parts.append(f"{path} {_fmt(p50, '.3f')} / {_fmt(p90, '.3f')} ms")
    rounds = len(paired.get("direct", []))
    return f"ttft_paired     {rounds} rounds, added TTFT p50 / p90 over rounds: " + ", ".join(parts)


def _venv_tool(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


# -- summary -------------------------------------------------------------------------------------


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def summarize(
    windows: list[Window], idle_rss: dict[str, float], paired: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """Per-path figures and the verdict on each target.

    Added TTFT at c=1 is judged on the paired phase when it ran (each round's difference to
    direct, taken in the same round), else on the ``ttft_c1`` windows, one path after another.
    """
    per_path: dict[str, dict[str, Any]] = {}

    def get(phase: str, path: str) -> Window | None:
        return next((w for w in windows if w.phase == phase and w.path == path), None)

    def added(phase: str, path: str, key: str) -> float | None:
        mine, direct = get(phase, path), get(phase, "direct")
        if mine is None or direct is None:
            return None
        return _sub(getattr(mine, key), getattr(direct, key))

    for path in PATHS:
        c1, one, top = get("ttft_c1", path), get("c64_1tok", path), get("max_throughput", path)
        whole = get("c16_json", path)
        c16, c64 = get("c64_16tok", path), get("c64_64tok", path)
        paced, mem = get("paced_500", path), get("rss_1000", path)
        marginal = None
        if c16 and c64 and c16.us_per_request is not None and c64.us_per_request is not None:
            extra_chunks = c64.chunks_per_request - c16.chunks_per_request
            marginal = (c64.us_per_request - c16.us_per_request) / extra_chunks
        per_path[path] = {
            "cpu_us_per_64tok_request": _r(c64.us_per_request, 1) if c64 else None,
            "cpu_us_per_chunk_64tok": _r(c64.us_per_chunk, 2) if c64 else None,
            "chunks_per_64tok_request": round(c64.chunks_per_request, 1) if c64 else None,
            "cpu_us_per_16tok_request": _r(c16.us_per_request, 1) if c16 else None,
            "cpu_us_marginal_per_chunk": _r(marginal, 2),
            "cpu_us_per_1tok_request": _r(one.us_per_request, 1) if one else None,
            "cpu_us_per_json_request": _r(whole.us_per_request, 1) if whole else None,
            "ttft_c1_p50_ms": c1.ttft_p50_ms if c1 else None,
            "ttft_c1_p99_ms": c1.ttft_p99_ms if c1 else None,
            "ttft_c64_p50_ms": c16.ttft_p50_ms if c16 else None,
            "ttft_c64_p99_ms": c16.ttft_p99_ms if c16 else None,
            "added_ttft_c1_p50_ms": added("ttft_c1", path, "ttft_p50_ms"),
            "added_ttft_c1_p99_ms": added("ttft_c1", path, "ttft_p99_ms"),
            "paired_added_ttft_c1_p50_ms": _r(paired_added_ms(paired or {}, path, 0.5), 3),
            "paired_added_ttft_c1_p90_ms": _r(paired_added_ms(paired or {}, path, 0.9), 3),
            "added_ttft_c64_p50_ms": added("c64_16tok", path, "ttft_p50_ms"),
            "added_ttft_c64_p99_ms": added("c64_16tok", path, "ttft_p99_ms"),
            "max_chunks_per_s": round(top.chunks_per_s) if top else None,
            "max_proxy_cpu_per_s": _r(top.proxy_cpu_per_s, 2) if top else None,
            "max_replica_cpu_per_s": round(top.replica_cpu_s / top.window_s, 2) if top else None,
            "max_cpu_us_per_chunk": _r(top.us_per_chunk, 2) if top else None,
            "max_chunks_per_s_one_core": round(1e6 / top.us_per_chunk)
            if top and top.us_per_chunk
            else None,
            "saturated_ttft_p50_ms": top.ttft_p50_ms if top else None,
            "saturated_ttft_p99_ms": top.ttft_p99_ms if top else None,
            "paced_chunks_per_s": round(paced.chunks_per_s) if paced else None,
            "paced_tokens_per_s_per_stream": round(paced.chunks_per_s / paced.concurrency, 1)
            if paced
            else None,
            "paced_cpu_per_s": _r(paced.proxy_cpu_per_s, 2) if paced else None,
            "paced_cpu_us_per_chunk": _r(paced.us_per_chunk, 2) if paced else None,
            "idle_rss_mb": idle_rss.get(path),
            "rss_1000_streams_mb": mem.proxy_rss_mb if mem else None,
            "rss_1000_streams_streaming": mem.streaming if mem else None,
        }
    side, ngx = per_path["sidecar"], per_path["nginx"]
    ratio = (
        round(side["cpu_us_per_64tok_request"] / ngx["cpu_us_per_64tok_request"], 1)
        if side["cpu_us_per_64tok_request"] and ngx["cpu_us_per_64tok_request"]
        else None
    )
    json_ratio = (
        round(side["cpu_us_per_json_request"] / ngx["cpu_us_per_json_request"], 1)
        if side["cpu_us_per_json_request"] and ngx["cpu_us_per_json_request"]
        else None
    )
    paced_ratio = (
        round(side["paced_cpu_us_per_chunk"] / ngx["paced_cpu_us_per_chunk"], 2)
        if side["paced_cpu_us_per_chunk"] and ngx["paced_cpu_us_per_chunk"]
        else None
    )

    def verdict(value: float | None, limit: float, higher_is_better: bool = False) -> str:
        if value is None:
            return "not measured"
        ok = value >= limit if higher_is_better else value <= limit
        return "met" if ok else "not met"

    c1_added = side["paired_added_ttft_c1_p50_ms"]
    if c1_added is None:
        c1_added = side["added_ttft_c1_p50_ms"]
    # The whole-process ceiling: chunks/s if the sidecar had one core to itself at the cost
    # per chunk it showed at maximum load (the measured figure when it did pin a core).
    ceiling = side["max_chunks_per_s_one_core"]
    targets = [
        {
            "target": f"sidecar CPU per 64-chunk request <= {TARGET_CPU_RATIO:g}x nginx's",
            "value": ratio,
            "unit": "x",
            "verdict": verdict(ratio, TARGET_CPU_RATIO),
        },
        {
            "target": f"sidecar CPU per non-streamed request <= {TARGET_JSON_RATIO:g}x nginx's",
            "value": json_ratio,
            "unit": "x",
            "verdict": verdict(json_ratio, TARGET_JSON_RATIO),
        },
        {
            "target": f"added TTFT p50 <= {TARGET_ADDED_P50_C1_MS} ms at c=1"
            + (" (paired rounds)" if side["paired_added_ttft_c1_p50_ms"] is not None else ""),
            "value": c1_added,
            "unit": "ms",
            "verdict": verdict(c1_added, TARGET_ADDED_P50_C1_MS),
        },
        {
            "target": f"added TTFT p99 <= {TARGET_ADDED_P99_C64_MS} ms at c=64",
            "value": side["added_ttft_c64_p99_ms"],
            "unit": "ms",
            "verdict": verdict(side["added_ttft_c64_p99_ms"], TARGET_ADDED_P99_C64_MS),
        },
        {
            "target": f"CPU per chunk <= {TARGET_PACED_RATIO:g}x nginx's, 500 streams at 20 tok/s",
            "value": paced_ratio,
            "unit": "x",
            "verdict": verdict(paced_ratio, TARGET_PACED_RATIO),
        },
        {
            "target": f">= {TARGET_CHUNKS_PER_S:,.0f} chunks/s per sidecar process (one full core)",
            "value": ceiling,
            "unit": "chunks/s",
            "verdict": verdict(ceiling, TARGET_CHUNKS_PER_S, higher_is_better=True),
        },
        {
            "target": f"RSS <= {TARGET_RSS_MB:g} MB at 1000 streams",
            "value": side["rss_1000_streams_mb"],
            "unit": "MB",
            "verdict": verdict(side["rss_1000_streams_mb"], TARGET_RSS_MB),
        },
    ]
    return {"paths": per_path, "cpu_ratio_sidecar_to_nginx": ratio, "targets": targets}


_HEADER = (
    f"{'phase':<15} {'path':<8} {'conc':>5} {'req':>6} {'chunks/s':>9} {'proxy CPU/s':>11} "
    f"{'us/req':>8} {'us/chunk':>8} {'TTFT p50':>9} {'p99 ms':>8} {'RSS MB':>7} "
    f"{'repl CPU/s':>10} {'cli CPU/s':>9} {'err':>4} {'load1':>5} {'sys%':>4}"
)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _row(w: Window) -> str:
    return (
        f"{w.phase:<15} {w.path:<8} {w.concurrency:>5} {w.requests:>6} {w.chunks_per_s:>9,.0f} "
        f"{_fmt(w.proxy_cpu_per_s, '11.3f'):>11} {_fmt(w.us_per_request, '8.0f'):>8} "
        f"{_fmt(w.us_per_chunk, '8.1f'):>8} {_fmt(w.ttft_p50_ms, '9.3f'):>9} "
        f"{_fmt(w.ttft_p99_ms, '8.3f'):>8} {_fmt(w.proxy_rss_mb, '7.1f'):>7} "
        f"{w.replica_cpu_s / w.window_s:>10.2f} {w.client_cpu_s / w.window_s:>9.2f} "
        f"{w.errors:>4} {w.loadavg_1m:>5.2f} "
        f"{_fmt(None if w.proxy_sys_share is None else 100 * w.proxy_sys_share, '4.0f'):>4}"
    )


_SUMMARY_ROWS = (
    ("CPU us / 64-token request (c=64)", "cpu_us_per_64tok_request", ".0f"),
    ("  chunks per request", "chunks_per_64tok_request", ".1f"),
    ("  CPU us per chunk", "cpu_us_per_chunk_64tok", ".1f"),
    ("CPU us / 16-token request (c=64)", "cpu_us_per_16tok_request", ".0f"),
    ("marginal CPU us per extra chunk", "cpu_us_marginal_per_chunk", ".1f"),
    ("CPU us / 1-token request (c=64)", "cpu_us_per_1tok_request", ".0f"),
    ("CPU us / non-streamed request (c=16)", "cpu_us_per_json_request", ".0f"),
    ("TTFT p50 / p99 ms, c=1", ("ttft_c1_p50_ms", "ttft_c1_p99_ms"), ".3f"),
    ("TTFT p50 / p99 ms, c=64", ("ttft_c64_p50_ms", "ttft_c64_p99_ms"), ".3f"),
    ("added TTFT p50 / p99 ms, c=1", ("added_ttft_c1_p50_ms", "added_ttft_c1_p99_ms"), ".3f"),
    (
        "  paired rounds: p50 / p90 ms",
        ("paired_added_ttft_c1_p50_ms", "paired_added_ttft_c1_p90_ms"),
        ".3f",
    ),
    ("added TTFT p50 / p99 ms, c=64", ("added_ttft_c64_p50_ms", "added_ttft_c64_p99_ms"), ".3f"),
    ("max chunks/s (256 streams)", "max_chunks_per_s", ",.0f"),
    ("proxy / replica CPU s/s there", ("max_proxy_cpu_per_s", "max_replica_cpu_per_s"), ".2f"),
    ("CPU us per chunk there", "max_cpu_us_per_chunk", ".1f"),
    ("chunks/s one core would relay", "max_chunks_per_s_one_core", ",.0f"),
    ("TTFT p50 / p99 ms there", ("saturated_ttft_p50_ms", "saturated_ttft_p99_ms"), ".1f"),
    ("paced 500x20 tok/s: chunks/s", "paced_chunks_per_s", ",.0f"),
    ("  tokens/s per stream reached", "paced_tokens_per_s_per_stream", ".1f"),
    ("paced: CPU s/s, us per chunk", ("paced_cpu_per_s", "paced_cpu_us_per_chunk"), ".2f"),
    ("RSS MB idle", "idle_rss_mb", ".1f"),
    ("RSS MB, 1000 open streams", "rss_1000_streams_mb", ".1f"),
)


def render_summary(summary: dict[str, Any]) -> str:
    """The per-path table and the targets, as text."""
    paths: dict[str, dict[str, Any]] = summary["paths"]
    lines = [f"{'':<34} " + " ".join(f"{p:>19}" for p in PATHS)]
    for label, key, spec in _SUMMARY_ROWS:
        cells = []
        for path in PATHS:
            if isinstance(key, tuple):
                cells.append(" / ".join(_fmt(paths[path][k], spec) for k in key))
            else:
                cells.append(_fmt(paths[path][key], spec))
        lines.append(f"{label:<34} " + " ".join(f"{c:>19}" for c in cells))
    lines.append("")
    for t in summary["targets"]:
        value = _fmt(t["value"], ",.2f" if t["unit"] != "chunks/s" else ",.0f")
        lines.append(f"{t['verdict']:>12}: {t['target']} (measured {value} {t['unit']})")
    return "\n".join(lines)


_LAYERS = (
    ("sidecar/", "sidecar code (sidecar/)"),
    ("sidecar/http_server.py", "client-facing server: sidecar.http_server, httptools"),
    ("infermeter/", "infermeter package (spool, records)"),
    ("httpx/", "upstream client: httpx, httpcore, h11, anyio, sniffio"),
    ("httpcore/", "upstream client: httpx, httpcore, h11, anyio, sniffio"),
    ("h11/", "upstream client: httpx, httpcore, h11, anyio, sniffio"),
    ("anyio/", "upstream client: httpx, httpcore, h11, anyio, sniffio"),
    ("sniffio/", "upstream client: httpx, httpcore, h11, anyio, sniffio"),
    ("uvicorn/", "client-facing server: uvicorn, httptools (before sidecar.http_server)"),
    ("httptools/", "client-facing server: sidecar.http_server, httptools"),
    ("concurrent/", "thread pool (spool write + fsync)"),
    ("threading.py", "thread pool (spool write + fsync)"),
)


def _layer(frame: str) -> str:
    """Which layer the leaf frame of a sample belongs to (py-spy paths are module-relative)."""
    name, _, where = frame.partition(" (")
    if name == "_SelectorSocketTransport.write":
        return "socket send() to clients (asyncio transport write)"
    for prefix, layer in _LAYERS:
        if where.startswith(prefix):
            return layer
    return "asyncio event loop, contextlib, other stdlib"


def _profile_report(directory: Path, top: int = 12) -> str:
    """Self share of samples by layer and by function, and inclusive share of the functions
    below the event loop, from py-spy's raw (collapsed stacks) output."""
    lines = []
    for path in sorted(directory.glob("*.txt")):
        inclusive: collections.Counter[str] = collections.Counter()
        own: collections.Counter[str] = collections.Counter()
        layers: collections.Counter[str] = collections.Counter()
        total = 0
        for line in path.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            total += count
            raw = [f for f in stack.split(";") if f]
            frames = [_frame_name(f) for f in raw]
            for name in set(frames):
                inclusive[name] += count
            if frames:
                own[frames[-1]] += count
                layers[_layer(raw[-1])] += count
        if not total:
            continue
        # Frames at or above the event loop's callback runner are in (almost) every sample.
        loop = inclusive.get("Handle._run (asyncio/events.py)", total)
        below = [(f, n) for f, n in inclusive.most_common() if n < loop][:top]
        lines.append(f"py-spy {path.stem}: {total} samples")
        lines.append("  self, by layer:")
        lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in layers.most_common()]
        lines.append("  self, by function:")
        lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
        lines.append("  inclusive, below the event loop:")
        lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in below]
    return "\n".join(lines)


def _frame_name(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"; thread/process frames stay as they are.
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    short = "/".join(file.split("/")[-2:]) if file else ""
    return f"{name} ({short})" if short else name


def _cpu_model() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.sidecar_overhead",
        description="CPU, TTFT, throughput and memory of the sidecar against a direct "
        "connection and an nginx reverse proxy, on loopback.",
    )
    parser.add_argument("--quick", action="store_true", help="shorter windows (about 1.5 minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--nginx", default="nginx", help="nginx binary (default: from PATH)")
    parser.add_argument(
        "--sidecar-launcher",
        metavar="SCRIPT",
        type=Path,
        help="run `python SCRIPT sidecar ARGS` instead of `python -m launcher sidecar ARGS` "
        "(to measure a patched sidecar, or the same one on another event loop)",
    )
    parser.add_argument(
        "--phases",
        metavar="NAMES",
        help=f"only these phases, comma-separated (of {', '.join(PHASES)}); the targets of the "
        "others are reported as not measured",
    )
    parser.add_argument(
        "--otlp-metrics",
        action="store_true",
        help="the sidecar exports its GenAI metrics (not spans) over OTLP every second, to a sink "
        "this benchmark runs (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_EXPORTER=none, "
        "OTEL_METRIC_EXPORT_INTERVAL=1000)",
    )
    parser.add_argument(
        "--sealed",
        action="store_true",
        help="the sidecar holds a writer credential (sidecar.credential_env), so every usage "
        "record it spools carries its seal (one HMAC per record), as in a fleet with credentials",
    )
    parser.add_argument(
        "--py-spy",
        metavar="DIR",
        type=Path,
        help="also record the sidecar with py-spy during its windows into DIR and print the "
        "top functions (perturbs the sidecar's own figures a little)",
    )
    return parser


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print tables (or JSON)."""
    args = build_parser().parse_args(argv)
    nginx_bin = shutil.which(args.nginx) or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx_bin is None:
        raise SystemExit("nginx not found: apt-get install -y nginx (or pass --nginx PATH)")
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so every `finally` stops what it started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    plan = QUICK if args.quick else FULL
    load_before = os.getloadavg()

    def echo(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    echo(
        f"{os.cpu_count()} CPUs ({_cpu_model()}), load average {load_before[0]:.2f}; "
        f"{'quick' if args.quick else 'full'} run, nginx {nginx_bin}"
    )
    started = time.monotonic()
    try:
        settings: dict[str, Any] | None = None
        phases = None if args.phases is None else frozenset(args.phases.split(","))
        with contextlib.ExitStack() as exits:
            sidecar_env: dict[str, str] | None = None
            if args.sealed:
                from infermeter.writers import Writer, issue

                writer = Writer.for_instance(REPLICA, REPLICA)
                sidecar_env = {"INFERMETER_WRITER_CREDENTIAL": issue(b"bench", writer).token}
            if args.otlp_metrics:
                sink = exits.enter_context(OtlpSink())
                # Metrics only: the endpoint alone would turn span export on too.
                sidecar_env = {
                    **(sidecar_env or {}),
                    "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                    "OTEL_TRACES_EXPORTER": "none",
                    "OTEL_METRIC_EXPORT_INTERVAL": "1000",
                }
            result = run_benchmark(
                plan,
                nginx_bin,
                args.py_spy,
                echo,
                args.sidecar_launcher,
                settings,
                phases,
                sidecar_env,
            )
            if args.otlp_metrics:
                echo(
                    f"OTLP exports received: {sink.exports} ({sink.bytes} bytes), "
                    f"of which span batches: {sink.traces}"
                )
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    windows: list[Window] = result["windows"]
    summary = summarize(windows, result["idle_rss_mb"], result["paired_ttft_s"])
    elapsed = time.monotonic() - started
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
                "quick": args.quick,
                **asdict(plan),
                "fast_engine": asdict(FAST),
                "paced_engine": asdict(PACED),
                "elapsed_s": round(elapsed, 1),
            },
            "windows": [w.as_dict() for w in windows],
            **summary,
        }
        print(json.dumps(doc, indent=2))
    else:
        print()
        print(render_summary(summary))
        print(f"\n{elapsed:.0f} s, load average after {os.getloadavg()[0]:.2f}")
        if args.py_spy is not None:
            print(_profile_report(args.py_spy))
    return 1 if any(w.errors for w in windows) else 0


if __name__ == "__main__":
    sys.exit(main())
