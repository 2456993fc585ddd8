"""The dashboard's WSGI server candidates, timed per dashboard callback: latency and server CPU.

Billing runs in this process on loopback over a fresh demo ledger; the dashboard runs in a
process of its own under each candidate in turn, with 16 worker threads as it is served:

- ``uvicorn``: uvicorn with a2wsgi's thread pool (how the dashboard was served before);
- ``waitress``: waitress, in-process (``waitress.create_server``);
- ``gunicorn``: gunicorn, one ``gthread`` worker with 16 threads (its own command line).

Each callback is POSTed to ``/_dash-update-component`` as the browser sends it, signed in as
the admin: ``summary`` (the row every page opens with: spend, statement and three queries from
billing) and ``layout`` (``GET /_dash-layout``, no billing call). ``--clients`` send at once; reported per candidate and callback: p50 and p95
milliseconds, and the server process's CPU milliseconds per request (from /proc, so Linux only).

    .venv/bin/python -m bench.dashboard_servers                    # ~1 min
    .venv/bin/python -m bench.dashboard_servers --requests 400 --clients 8 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from billing.api import create_app
from billing.serve import open_ledger
from infermeter.config import load_config
from infermeter.serving import free_port, server

__all__ = ["CANDIDATES", "main", "wsgi_app"]

CANDIDATES = ("uvicorn", "waitress", "gunicorn")
ADMIN = "im-demo-admin"
THREADS = 16
_AUTH: dict[str, Any] = {
    "token": ADMIN,
    "name": "admin",
    "team": None,
    "is_admin": True,
    "teams": [],
}


def wsgi_app() -> Any:
    """The dashboard's Flask app over ``$INFERMETER_BENCH_BILLING_URL`` (for gunicorn's loader)."""
    from dashboards.app import create_app as dashboard_app

    return dashboard_app(load_config(), os.environ["INFERMETER_BENCH_BILLING_URL"]).server


def _serve(candidate: str, port: int) -> None:
    """Serve the dashboard under ``candidate`` until SIGTERM (in the child process)."""
    app = wsgi_app()
    if candidate == "waitress":
        import waitress

        waitress.serve(app, host="127.0.0.1", port=port, threads=THREADS, _quiet=True)
    else:
        import asyncio

        from infermeter.serving import wsgi_server

        asyncio.run(wsgi_server(app, "127.0.0.1", port, THREADS).serve())


def _command(candidate: str, port: int) -> list[str]:
    if candidate == "gunicorn":
        return [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--worker-class",
            "gthread",
            "--threads",
            str(THREADS),
            "--log-level",
            "warning",
            "bench.dashboard_servers:wsgi_app()",
        ]
    return [
        sys.executable,
        "-m",
        "bench.dashboard_servers",
        "--serve",
        candidate,
        "--port",
        str(port),
    ]


@contextlib.contextmanager
def _dashboard(candidate: str, billing_url: str) -> Iterator[tuple[str, list[int]]]:
    """The dashboard under ``candidate``; yields its URL and the pids whose CPU counts."""
    port = free_port()
    env = {**os.environ, "INFERMETER_BENCH_BILLING_URL": billing_url}
    proc = subprocess.Popen(_command(candidate, port), env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/_dash-layout", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard under {candidate} did not start")
            time.sleep(0.2)
        yield url, [proc.pid, *_children(proc.pid)]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _cpu_ms(pids: list[int]) -> float:
    """User plus system CPU of ``pids`` so far, milliseconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return 1000 * total / ticks


def _callback(outputs: list[tuple[str, str]], inputs: list[tuple[str, str, Any]]) -> dict[str, Any]:
    """A ``/_dash-update-component`` body as Dash's renderer sends it."""
    multi = len(outputs) > 1
    names = [f"{i}.{p}" for i, p in outputs]
    output = f"..{'...'.join(names)}.." if multi else names[0]
    return {
        "output": output,
        "outputs": [{"id": i, "property": p} for i, p in outputs]
        if multi
        else {"id": outputs[0][0], "property": outputs[0][1]},
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": [f"{inputs[0][0]}.{inputs[0][1]}"],
        "state": [],
    }


CALLBACKS: dict[str, dict[str, Any] | None] = {
    "summary": _callback(
        [("summary", "children"), ("money", "data")],
        [
            ("tick", "n_intervals", 1),
            ("range", "value", "1h"),
            ("auth", "data", _AUTH),
            ("tz", "data", "UTC"),
        ],
    ),
    "layout": None,
}


def _time_one(client: httpx.Client, name: str) -> float:
    started = time.perf_counter()
    body = CALLBACKS[name]
    if body is None:
        r = client.get("/_dash-layout")
    else:
        r = client.post("/_dash-update-component", json=body)
    r.raise_for_status()
    return 1000 * (time.perf_counter() - started)


def measure(url: str, pids: list[int], name: str, requests: int, clients: int) -> dict[str, float]:
    """p50/p95 ms and server CPU ms per request of ``requests`` calls of callback ``name``."""
    with httpx.Client(base_url=url, timeout=60) as warm:
        for _ in range(5):
            _time_one(warm, name)
    local = threading.local()

    def one(_: int) -> float:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=60)
        return _time_one(local.client, name)

    before = _cpu_ms(pids)
    with ThreadPoolExecutor(clients) as pool:
        times = sorted(pool.map(one, range(requests)))
    cpu = _cpu_ms(pids) - before
    return {
        "p50_ms": round(statistics.median(times), 2),
        "p95_ms": round(times[int(0.95 * (len(times) - 1))], 2),
        "server_cpu_ms_per_request": round(cpu / requests, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    p.add_argument("--json", action="store_true")
    p.add_argument("--serve", choices=CANDIDATES, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        _serve(args.serve, args.port)
        return 0
    config = load_config()
    ledger = open_ledger(config, ":memory:")
    port = free_port()
    billing = server(create_app(config, ledger), "127.0.0.1", port, lifespan="off")
    thread = threading.Thread(target=billing.run, daemon=True)
    thread.start()
    while not billing.started:
        time.sleep(0.02)
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for candidate in args.candidates:
            with _dashboard(candidate, f"http://127.0.0.1:{port}") as (url, pids):
                results[candidate] = {
                    name: measure(url, pids, name, args.requests, args.clients)
                    for name in CALLBACKS
                }
    finally:
        billing.should_exit = True
        thread.join(10)
        ledger.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'server':10} {'callback':9} {'p50 ms':>8} {'p95 ms':>8} {'CPU ms/req':>11}")
    for candidate, rows in results.items():
        for name, r in rows.items():
            print(
                f"{candidate:10} {name:9} {r['p50_ms']:8.2f} {r['p95_ms']:8.2f} "
                f"{r['server_cpu_ms_per_request']:11.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
