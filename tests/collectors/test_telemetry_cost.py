"""Telemetry that misbehaves, end to end: a dcgm-exporter page read over HTTP, the samples
ingested by billing over HTTP into a DuckDB file, and the month's statement read back."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.api import create_app
from collectors.dcgm import DcgmSource
from collectors.loop import Batch, FleetCollector
from infermeter.config import Config
from infermeter.months import month_of
from tests.billing.conftest import usage
from tests.collectors.fakes import Receive, Scope, Send, text_app
from tests.conftest import config_ledger
from tests.servers import serving

INGEST, ADMIN = "im-demo-ingest", "im-demo-admin"
H100 = 'gpu="0",UUID="GPU-h100-0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"'


def page(energy_mj: float, power_watts: float = 300.0, labels: str = H100) -> bytes:
    """node-a's exporter page: one H100 at ``power_watts``, its counter at ``energy_mj``."""
    return (
        f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 50\n"
        f"DCGM_FI_DEV_POWER_USAGE{{{labels}}} {power_watts}\n"
        f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{labels}}} {energy_mj:.0f}\n"
        f"DCGM_FI_DEV_FB_USED{{{labels}}} 1000\n"
        f"DCGM_FI_DEV_FB_FREE{{{labels}}} 80000\n"
    ).encode()


@dataclass
class Run:
    """What the collector sampled and what billing answered for it."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    statement: dict[str, Any] = field(default_factory=dict)
    refused_values: int = 0
    energy_total: float = 0.0

    @property
    def energy(self) -> list[tuple[float, float | None]]:
        """Each sample's interval and energy, in order."""
        return [(s["interval_seconds"], s["energy_joules"]) for s in self.samples]

    def billed(self) -> tuple[float, float]:
        """The statement's GPU-seconds and joules (its node pools': idle capacity included)."""
        pools = self.statement["pools"]
        return (
            round(sum(p["gpu_hours"] for p in pools) * 3600, 6),
            round(sum(p["energy_kwh"] for p in pools) * 3.6e6, 3),
        )

    def reconciles(self) -> bool:
        """The lines sum to the fleet's cost to the cent, and billing says the month reconciles."""
        st = self.statement
        lines = sum(line["total_cents"] for line in st["lines"])
        return bool(st["reconciles"]) and lines == st["total_cents"] == st["fleet_cents"]


@asynccontextmanager
async def _billing(config: Config, path: Path) -> AsyncIterator[str]:
    ledger = config_ledger(config, path)
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            yield url
    finally:
        ledger.close()


async def run_pages(
    config: Config,
    tmp_path: Path,
    pages: list[bytes],
    step: float = 5.0,
    usage: list[dict[str, Any]] | None = None,
) -> Run:
    """Serve ``pages`` one per round ``step`` s apart, ship each round's samples to billing.

    ``usage``: records to ingest too, their times counted from the first page's (``start``).
    """
    served = list(pages)

    async def exporter(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await text_app(served.pop(0))(scope, receive, send)

    start = math.floor(time.time() / 3600) * 3600 - 3600.0  # the last whole hour
    t = [start]
    out = Run()
    async with (
        _billing(config, tmp_path / "ledger.duckdb") as billing,
        serving(exporter) as url,
        httpx.AsyncClient(base_url=billing) as client,
    ):
        source = DcgmSource("node-a", f"{url}/metrics", client, 2.0)
        collector = FleetCollector(config, [source], [], clock=lambda: t[0], monotonic=lambda: t[0])
        for _ in pages:
            batch: Batch = await collector.scrape_once()
            records = [s.to_json() for s in batch.gpus]
            out.samples.extend(records)
            if records:
                answer = await client.post(
                    "/v1/ingest",
                    json={"gpu_samples": records},
                    headers={"Authorization": f"Bearer {INGEST}"},
                )
                assert answer.status_code == 200, answer.text
                out.rejected.extend(answer.json()["rejected"])
                out.quarantined.extend(answer.json()["quarantined"])
            t[0] += step
        if usage:
            shifted = [
                u | {k: u[k] + start for k in ("received_at", "first_token_at", "finished_at")}
                for u in usage
            ]
            answer = await client.post(
                "/v1/ingest",
                json={"usage": shifted},
                headers={"Authorization": f"Bearer {INGEST}"},
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["accepted"] == len(usage), answer.text
        month = month_of(start)
        got = await client.get(
            f"/v1/chargeback/{month}", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert got.status_code == 200, got.text
        out.statement = got.json()
        out.refused_values = collector.states[("node-a", "dcgm")].refused_values_total
        out.energy_total = sum(collector.gpu_energy_joules.values())
    return out


BASE = 5e9  # mJ: the counter 5 MJ after the driver loaded
STEP = 1.5e6  # mJ: 300 W for 5 s


async def test_a_counter_that_jumps_forward_is_measured_from_power_and_billed(config, tmp_path):
    """The counter jumps by 1e12 mJ for one reading and is back the next: neither the jump nor
    the fall after it (read as a reset: the whole since-boot counter) is billed; those intervals
    are measured from power, every second of GPU time is on the statement, and nothing is
    refused. Before, billing refused both samples: 10 of the 25 s were no one's, and the
    collector's energy total held 1e9 J for good."""
    counters = [BASE, BASE + STEP, BASE + 2 * STEP, BASE + 1e12, BASE + 4 * STEP, BASE + 5 * STEP]
    run = await run_pages(config, tmp_path, [page(c) for c in counters])
    assert run.rejected == []
    assert run.quarantined == []
    assert run.energy == [(0.0, 0.0)] + [(5.0, 1500.0)] * 5
    assert run.billed() == (25.0, 7500.0)
    assert run.energy_total == 7500.0
    assert run.refused_values == 1
    assert run.reconciles()


async def test_a_counter_that_steps_back_but_not_to_zero_is_no_reset(config, tmp_path):
    """An exporter restarted onto an older value (the counter 0.5 kJ lower, not near zero): the
    fall is no reset, whose new value counts from zero (5 MJ in 5 s is more than an H100 draws);
    it is measured from power, and the counter takes over again after it."""
    counters = [BASE, BASE + STEP, BASE + STEP - 5e5, BASE + 3 * STEP, BASE + 4 * STEP]
    run = await run_pages(config, tmp_path, [page(c) for c in counters])
    assert run.rejected == []
    assert run.energy == [(0.0, 0.0)] + [(5.0, 1500.0)] * 4
    assert run.billed() == (20.0, 6000.0)
    assert run.refused_values == 1
    assert run.reconciles()


async def test_a_reset_and_a_board_swapped_under_its_index_are_billed_once(config, tmp_path):
    """A driver reload resets the counter to near zero: its new value is the interval's energy.
    A board swapped under index 0 (a new UUID, its own counter) is a first reading: 0 s, 0 J,
    never the difference of two boards' counters. Nothing is refused or negative."""
    swapped = H100.replace("GPU-h100-0", "GPU-h100-new")
    pages = [page(BASE), page(BASE + STEP), page(1.2e6), page(1.2e6 + STEP)]
    pages += [page(7e9, labels=swapped), page(7e9 + STEP, labels=swapped)]
    run = await run_pages(config, tmp_path, pages)
    assert run.rejected == []
    old_board = [(0.0, 0.0), (5.0, 1500.0), (5.0, 1200.0), (5.0, 1500.0)]
    assert run.energy == [*old_board, (0.0, 0.0), (5.0, 1500.0)]
    assert run.billed() == (20.0, 5700.0)
    assert run.refused_values == 0
    assert run.reconciles()


async def test_a_power_no_board_can_draw_leaves_the_gpu_out_of_the_round(config, tmp_path):
    """5,000 W on an H100 (700 W, +25 %): the reading is refused as a NaN is, and the next good
    one measures the whole interval from the counter. Before, billing refused the sample, and
    its 5 s of GPU time were no one's."""
    pages = [page(BASE), page(BASE + STEP, power_watts=5000.0), page(BASE + 2 * STEP)]
    run = await run_pages(config, tmp_path, pages)
    assert run.rejected == []
    assert run.energy == [(0.0, 0.0), (10.0, 3000.0)]
    assert run.billed() == (10.0, 3000.0)
    assert run.refused_values == 1
    assert run.reconciles()


async def test_a_gpu_given_twice_with_different_values_is_refused_not_billed(config, tmp_path):
    """A page with two energy counters for one GPU (two exporters' lines merged, a stale series
    beside the live one): which is true cannot be told, so the GPU is left out of that round,
    with a reason naming the field and both values, and the next page measures across it. The
    same line twice with the same value is one reading. Before, the last line won, silently:
    here 3 kJ billed for 5 s at 300 W."""
    doubled = page(BASE + STEP) + page(BASE + 2 * STEP).splitlines(keepends=True)[2]
    same = page(BASE + 3 * STEP) * 2
    pages = [page(BASE), doubled, page(BASE + 2 * STEP), same]
    run = await run_pages(config, tmp_path, pages)
    assert run.rejected == []
    assert run.energy == [(0.0, 0.0), (10.0, 3000.0), (5.0, 1500.0)]
    assert run.billed() == (15.0, 4500.0)
    assert run.refused_values == 1
    assert run.reconciles()


async def test_a_utilization_over_100_percent_leaves_the_gpu_out_of_the_round(config, tmp_path):
    """DCGM_FI_DEV_GPU_UTIL 150 is no percentage: refused, the next reading measures across it.
    Before, billing refused the sample (utilization over 1) and its GPU time was no one's."""
    over = page(BASE + STEP).replace(b"DCGM_FI_DEV_GPU_UTIL{" + H100.encode() + b"} 50", b"")
    over = b"DCGM_FI_DEV_GPU_UTIL{" + H100.encode() + b"} 150\n" + over.lstrip(b"\n")
    run = await run_pages(config, tmp_path, [page(BASE), over, page(BASE + 2 * STEP)])
    assert run.rejected == []
    assert run.energy == [(0.0, 0.0), (10.0, 3000.0)]
    assert run.billed() == (10.0, 3000.0)
    assert run.refused_values == 1
    assert run.reconciles()


def stamped(body: bytes, ms: int) -> bytes:
    """``body`` with every sample stamped at ``ms`` (the text format's optional timestamp)."""
    return b"".join(line.rstrip(b"\n") + b" %d\n" % ms for line in body.splitlines())


async def test_an_exporters_own_timestamps_far_off_are_not_read(config, tmp_path):
    """Samples stamped by the exporter in 2286 and in 1970: the collector stamps each sample on
    its own clock and measures intervals on its monotonic one, so the timestamps move nothing;
    billing, which refuses a sample from the future, bills every second."""
    pages = [
        stamped(page(BASE), 9_999_999_999_999),
        stamped(page(BASE + STEP), 1),
        stamped(page(BASE + 2 * STEP), 9_999_999_999_999),
    ]
    run = await run_pages(config, tmp_path, pages)
    assert run.rejected == []
    assert run.energy == [(0.0, 0.0), (5.0, 1500.0), (5.0, 1500.0)]
    times = [s["timestamp"] for s in run.samples]
    assert [b - a for a, b in itertools.pairwise(times)] == [5.0, 5.0]
    assert time.time() - 7200 < times[0] < time.time()
    assert run.billed() == (10.0, 3000.0)
    assert run.reconciles()


def gpus_page(counters: dict[str, float]) -> bytes:
    """node-a's page with an H100 at each index of ``counters``, its counter at the value."""
    return b"".join(
        page(mj, labels=H100.replace('gpu="0"', f'gpu="{i}"').replace("h100-0", f"h100-{i}"))
        for i, mj in counters.items()
    )


async def test_idle_and_unallocated_gpus_are_on_the_statement_and_it_sums_to_the_cent(
    config, tmp_path
):
    """Three H100s of node-a for 50 s: large-0 (GPUs 0 and 1) serves one request of search for
    20 s, GPU 5 is no replica's. Every GPU-second and joule is on the statement: search pays
    its share, large-0's idle goes to its payers (``spread``), GPU 5 to the platform as
    (unallocated), and the lines sum to the fleet cost to the cent."""
    pages = [gpus_page(dict.fromkeys(("0", "1", "5"), BASE + i * STEP)) for i in range(11)]
    request = usage(team="search", start=10.0, seconds=20.0, replica="large-0", model="chat-large")
    run = await run_pages(config, tmp_path, pages, usage=[request])
    assert run.rejected == []
    assert run.billed() == (150.0, 45000.0)
    lines = {(line["team"], line["model"]): line for line in run.statement["lines"]}
    assert set(lines) == {("search", "chat-large"), ("platform", "(unallocated)")}
    # search held large-0 (two GPUs) for 20 s of the minute: 20/60 of its 100 GPU-seconds.
    assert lines["search", "chat-large"]["gpu_hours"] == pytest.approx(100 / 3 / 3600)
    # Its idle (the rest of large-0) goes to search, the one payer; GPU 5 is the platform's.
    assert lines["search", "chat-large"]["idle_cents"] > 0
    assert lines["platform", "(unallocated)"]["idle_cents"] > 0
    # 150 GPU-seconds at $3.90 an hour and 45 kJ at $0.14 x 1.35 a kWh: 16.49 cents.
    assert run.statement["fleet_cents"] == sum(p["list_cents"] for p in run.statement["pools"])
    assert run.statement["fleet_cents"] == 16
    assert run.reconciles()
