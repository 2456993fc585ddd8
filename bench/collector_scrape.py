"""What one collector costs scraping a large fleet's dcgm-exporters: CPU and parse time.

A separate process serves ``--nodes`` fake dcgm-exporter endpoints (default 128, one loopback
port each, HTTP/1.1 keep-alive), each a pre-rendered page of ``--gpus`` boards (default 8) in
the simulator's exact dcgm-exporter format (25 fields, Kubernetes pod labels): cheap to serve,
so it does not compete for the collector's CPU more than it must. This process runs the real
collector loop (``collectors.loop.FleetCollector`` with one ``DcgmSource`` per node, GPU
attribution by pod label, energy accounting, and the real group-committed spool of
``GpuSample`` records in a temporary directory) every ``--interval`` seconds for ``--rounds``
rounds. The first round (connections opened, code warmed) is not measured.

Reported: the collector's CPU seconds per second as a percentage of one core over the measured
rounds (``time.process_time``: this process and its spool-writer threads), the parse time per
node page (``DcgmSource.last_parse_seconds``: mean, p50, p95), the wall time of a round, and
for comparison prometheus-client's ``text_string_to_metric_families`` on one node's page.

    .venv/bin/python -m bench.collector_scrape                  # 128 x 8, every 10 s, ~70 s
    .venv/bin/python -m bench.collector_scrape --rounds 4 --interval 5
    .venv/bin/python -m bench.collector_scrape --json > collector.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from collectors.dcgm import DcgmSource
from collectors.loop import Batch, FleetCollector
from collectors.serve import SpoolSink
from infermeter.config import Config
from simulator.dcgm import DcgmGpu, gpu_uuid, render


def node_page(node: int, gpus: int) -> str:
    """One node's dcgm-exporter page: busy boards, each held by replica r<node>'s pod."""
    boards = [
        DcgmGpu(
            index=i,
            uuid=gpu_uuid(7, f"node-{node}", i),
            model_name="NVIDIA H100 80GB HBM3",
            hostname=f"node-{node}",
            utilization_pct=40 + i,
            power_watts=350.5 + i,
            energy_mj=1_000_000_000 + node * 1000 + i,
            memory_used_mib=70_000,
            memory_free_mib=11_559,
            pod=("vllm", "inference", f"vllm-r{node}-0"),
        )
        for i in range(gpus)
    ]
    return render(boards)


def _serve_fakes(nodes: int, gpus: int, conn: Connection) -> None:
    asyncio.run(_fake_servers(nodes, gpus, conn))


async def _fake_servers(nodes: int, gpus: int, conn: Connection) -> None:
    servers, ports = [], []
    for node in range(nodes):
        body = node_page(node, gpus).encode()
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        response = head + body

        async def handle(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: bytes = response
        ) -> None:
            try:
                while await reader.readuntil(b"\r\n\r\n"):
                    writer.write(response)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        ports.append(server.sockets[0].getsockname()[1])
    conn.send(ports)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop


def fleet_config(ports: list[int], gpus: int, args: argparse.Namespace) -> Config:
    """One node per fake endpoint, one replica per node owning its boards by pod label."""
    return Config.model_validate(
        {
            "teams": [{"name": "t"}],
            "models": [{"name": "m", "approved_versions": ["m-v1"]}],
            "replicas": [
                {
                    "id": f"r{i}",
                    "model": "m",
                    "upstream_url": "http://127.0.0.1:9",
                    "node": f"node-{i}",
                    "gpu_model": "H100",
                    "gpu_count": gpus,
                }
                for i in range(len(ports))
            ],
            "nodes": [
                {"name": f"node-{i}", "dcgm_exporter_url": f"http://127.0.0.1:{p}/metrics"}
                for i, p in enumerate(ports)
            ],
            "prices": {"usd_per_gpu_hour": {"H100": 3.9}},
            "collector": {"scrape_interval_seconds": args.interval, "scrape_timeout_seconds": 5.0},
        }
    )


async def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Run the collector loop and return the figures."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # as serve.py
    samples = 0
    cpu_marks: list[float] = []
    wall_marks: list[float] = []
    parse: list[float] = []
    rounds: list[float] = []
    with tempfile.TemporaryDirectory() as spool_dir:
        sink = SpoolSink(Path(spool_dir))
        sink.open()
        async with httpx.AsyncClient(limits=limits) as client:
            sources = [
                DcgmSource(n.name, n.dcgm_exporter_url or "", client, 5.0) for n in config.nodes
            ]
            collector = FleetCollector(config, sources, [])
            scrape_once = collector.scrape_once

            async def timed_round() -> Batch:
                started = time.perf_counter()
                batch = await scrape_once()
                rounds.append(time.perf_counter() - started)
                return batch

            async def counting_sink(batch: Batch) -> None:
                nonlocal samples
                await sink(batch)
                if cpu_marks:  # the first round is warm-up
                    samples += len(batch.gpus)
                    parse.extend(s.last_parse_seconds for s in sources)
                cpu_marks.append(time.process_time())
                wall_marks.append(time.monotonic())

            collector.scrape_once = timed_round  # type: ignore[method-assign]
            await collector.run(counting_sink, rounds=args.rounds)
            down = [s.target for s in collector.states.values() if not s.up]
        await sink.close()
    window = wall_marks[-1] - wall_marks[0]
    page = node_page(0, args.gpus)
    started = time.perf_counter()
    for _ in range(20):
        list(text_string_to_metric_families(page))
    library_ms = (time.perf_counter() - started) / 20 * 1000
    parse_ms = sorted(p * 1000 for p in parse)
    return {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "lines_per_node": page.count("\n"),
        "bytes_per_node": len(page),
        "interval_s": args.interval,
        "measured_rounds": len(cpu_marks) - 1,
        "window_s": round(window, 1),
        "cpu_percent_of_one_core": round(100 * (cpu_marks[-1] - cpu_marks[0]) / window, 2),
        "cpu_ms_per_round": round(1000 * (cpu_marks[-1] - cpu_marks[0]) / (len(cpu_marks) - 1), 1),
        "parse_ms_per_node_mean": round(statistics.mean(parse_ms), 3),
        "parse_ms_per_node_p50": round(parse_ms[len(parse_ms) // 2], 3),
        "parse_ms_per_node_p95": round(parse_ms[int(len(parse_ms) * 0.95)], 3),
        "prometheus_client_parse_ms_per_node": round(library_ms, 2),
        "round_wall_ms_median": round(1000 * statistics.median(rounds[1:]), 1),
        "gpu_samples_spooled": samples,
        "targets_down": len(down),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def main() -> None:
    """Parse arguments, start the fakes, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=7, help="including 1 warm-up round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ours, theirs = multiprocessing.Pipe()
    fakes = multiprocessing.get_context("spawn").Process(
        target=_serve_fakes, args=(args.nodes, args.gpus, theirs), daemon=True
    )
    fakes.start()
    try:
        ports: list[int] = ours.recv()
        result = asyncio.run(measure(fleet_config(ports, args.gpus, args), args))
    finally:
        ours.send("stop")
        fakes.join(timeout=5)
        if fakes.is_alive():
            fakes.terminate()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        for key, value in result.items():
            print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
