"""The scrape loop over real loopback HTTP: joined samples, true energy, and failing targets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from collectors.dcgm import DcgmSource, dcgm_readings, fetch_text
from collectors.exposition import ExpositionError, parse_samples
from collectors.loop import Batch, FleetCollector, board_homes
from collectors.metrics import FleetMetrics
from collectors.serve import SpoolSink, build_collector
from collectors.sources import GpuReading, ScrapeError
from collectors.targets import EngineTarget, placements
from collectors.vllm import VllmSource
from infermeter.config import Config
from infermeter.records import GpuSample
from infermeter.spool import SpoolError, read_segment
from simulator.replica import ReplicaSim, replica_spec
from tests.collectors.fakes import (
    FakeGpuSource,
    Receive,
    Scope,
    Send,
    hanging_app,
    reading,
    shared_board_page,
    text_app,
)
from tests.servers import serving


def _by_replica(batch: Batch) -> dict[str | None, list[str]]:
    out: dict[str | None, list[str]] = {}
    for s in batch.gpus:
        out.setdefault(s.replica, []).append(f"{s.node}/{s.gpu}")
    return out


async def test_simulated_fleet_is_scraped_and_joined_by_config(fleet_config, running_fleet):
    """node-b's boards join small-0 and small-1 by config; small-0's engine state is read."""
    cfg = fleet_config()
    async with running_fleet(cfg), httpx.AsyncClient() as client:
        collector = build_collector(cfg, client)
        batch = await collector.scrape_once()
    assert _by_replica(batch) == {"small-0": ["node-b/0"], "small-1": ["node-b/1"]}
    [gpu] = [s for s in batch.gpus if s.replica == "small-0"]
    assert (gpu.model, gpu.gpu_model, gpu.gap) == ("chat-small", "L40S", False)
    assert gpu.power_watts >= 35
    assert [e.replica for e in batch.engines] == ["small-0"]
    assert batch.engines[0].model == "chat-small"
    up = {k: s.up for k, s in collector.states.items()}
    assert up == {
        ("node-a", "dcgm"): False,
        ("node-b", "dcgm"): True,
        ("large-0", "vllm"): False,
        ("small-0", "vllm"): True,
        ("small-1", "vllm"): False,
    }


async def test_gpus_join_by_pod_label_when_config_lists_none(fleet_config, running_fleet):
    """With no gpus in its config, small-0's board is found through pod vllm-small-0-0."""
    cfg = fleet_config(small_gpus=[])
    async with running_fleet(cfg) as fleet:
        source = DcgmSource("node-b", fleet.dcgm_url, fleet.client, 2.0)
        [owned] = [r for r in await source.read() if r.pod]
        assert owned.pod == "vllm-small-0-0"
        batch = await FleetCollector(cfg, [source], []).scrape_once()
    assert _by_replica(batch)["small-0"] == ["node-b/0"]


async def test_energy_equals_what_the_simulator_drew(fleet_config, running_fleet):
    """Under load, energy from the dcgm counter is what /_sim/gpus drew between the two scrapes.

    The simulator's counter is read just before and just after each scrape, so the collector's
    figure must lie between the least and the most it could have drawn; how wide that bracket is
    depends only on how long the scrapes took, not on the collector.
    """
    cfg = fleet_config()
    async with running_fleet(cfg) as fleet:
        collector = FleetCollector(
            cfg, [DcgmSource("node-b", fleet.dcgm_url, fleet.client, 2.0)], []
        )

        async def truth() -> float:
            rows = (await fleet.client.get(f"{fleet.replica_url}/_sim/gpus")).json()
            return float(rows[0]["energy_joules"])

        body = {"prompt": "p " * 50, "max_tokens": 150, "ignore_eos": True}
        load = [
            asyncio.create_task(fleet.client.post(f"{fleet.replica_url}/v1/completions", json=body))
            for _ in range(16)
        ]
        start_before = await truth()
        await collector.scrape_once()
        start_after = await truth()
        await asyncio.sleep(1.5)
        end_before = await truth()
        batch = await collector.scrape_once()
        end_after = await truth()
        await asyncio.gather(*load)
    [gpu] = [s for s in batch.gpus if s.replica == "small-0"]
    assert gpu.energy_joules is not None
    assert end_before - start_after <= gpu.energy_joules <= end_after - start_before
    assert end_before - start_after > 35 * 1.5  # it was busy: above idle power over the window


async def test_hung_target_is_marked_down_and_the_loop_goes_on(fleet_config, running_fleet):
    """A node that never answers times out each due round; the others are scraped every round."""
    cfg = fleet_config(
        scrape_interval_seconds=0.2, scrape_timeout_seconds=0.3, max_backoff_seconds=0.4
    )
    async with running_fleet(cfg) as fleet, serving(hanging_app) as hung_url:
        hung = DcgmSource("node-a", f"{hung_url}/metrics", fleet.client, 0.3)
        good = DcgmSource("node-b", fleet.dcgm_url, fleet.client, 0.3)
        engine = VllmSource("small-0", f"{fleet.replica_url}/metrics", fleet.client, 0.3)
        collector = FleetCollector(cfg, [hung, good], [engine])
        batches: list[Batch] = []

        async def sink(batch: Batch) -> None:
            batches.append(batch)

        started = time.monotonic()
        await asyncio.wait_for(collector.run(sink, rounds=6), 10)
        # Taken before the hung server's graceful shutdown, which waits for its open requests.
        took = time.monotonic() - started
    state = collector.states[("node-a", "dcgm")]
    assert not state.up
    assert state.last_error == "no answer within 0.3 s"
    assert 2 <= state.errors_total < 6  # backed off: not every round
    assert collector.states[("node-b", "dcgm")].up
    assert len(batches) == 6
    assert all(b.engines and {s.node for s in b.gpus} == {"node-b"} for b in batches)
    assert took < 6 * 0.2 + 3 * 0.3 + 1.0


async def test_an_engine_started_after_the_collector_is_read_within_two_intervals(fleet_config):
    """small-0 refused for many rounds, then starts: its first reading comes within two intervals.

    With the doubling back-off every refused read used to take, the collector would by then be
    waiting 2**9 intervals between tries (the demo's 4 min 20 s before a first good scrape).
    """
    interval = 0.2
    cfg = fleet_config(scrape_interval_seconds=interval, max_backoff_seconds=300.0)
    replica = cfg.replica("small-0")
    port = int(replica.upstream_url.rsplit(":", 1)[1])
    started_at: list[float] = []
    read_at: list[float] = []

    async def sink(batch: Batch) -> None:
        if batch.engines and not read_at:
            read_at.append(time.monotonic())

    async with httpx.AsyncClient() as client:
        engine = VllmSource("small-0", f"{replica.upstream_url}/metrics", client, 1.0)
        collector = FleetCollector(cfg, [], [engine])
        loop = asyncio.create_task(collector.run(sink))
        try:
            await asyncio.sleep(10 * interval)
            state = collector.states[("small-0", "vllm")]
            assert not state.up
            assert state.failures == collector.rounds >= 8, state  # tried every round
            assert "ConnectError" in (state.last_error or "")
            async with serving(ReplicaSim(replica_spec(cfg, "small-0")), port):
                started_at.append(time.monotonic())
                for _ in range(100):
                    if read_at:
                        break
                    await asyncio.sleep(interval / 10)
                up = collector.states[("small-0", "vllm")].up
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
    assert read_at, "the engine was never read"
    assert read_at[0] - started_at[0] <= 2 * interval
    assert up


async def test_garbage_target_is_down_with_the_reason(config):
    """An HTML error page where dcgm-exporter should be: down, with the first bad line quoted."""
    async with (
        serving(text_app(b"<html>oops</html>\n")) as url,
        httpx.AsyncClient() as client,
    ):
        collector = FleetCollector(
            config, [DcgmSource("node-a", f"{url}/metrics", client, 1.0)], []
        )
        batch = await collector.scrape_once()
    state = collector.states[("node-a", "dcgm")]
    assert batch.gpus == []
    assert not state.up
    assert state.last_error is not None
    assert "not a dcgm-exporter page: line 1 is not a metric sample: '<html>oops</html>'" in (
        state.last_error
    )


async def test_counter_reset_and_gap_through_the_loop(config):
    """A reboot's reset counts from zero; a missed stretch is a gap with no energy."""
    t = [1000.0]
    script: list[list[GpuReading] | ScrapeError] = [
        [reading(node="node-a", gpu="0", energy_mj=9_000_000.0)],
        [reading(node="node-a", gpu="0", energy_mj=9_500_000.0)],
        [reading(node="node-a", gpu="0", energy_mj=200_000.0)],
        ScrapeError("down"),
        [reading(node="node-a", gpu="0", energy_mj=900_000.0)],
        [reading(node="node-a", gpu="0", energy_mj=1_000_000.0)],
    ]
    source = FakeGpuSource("node-a", script)
    collector = FleetCollector(config, [source], [], clock=lambda: t[0], monotonic=lambda: t[0])
    energies = []
    for step in (0, 10, 10, 10, 40, 10):
        t[0] += step
        batch = await collector.scrape_once()
        energies.append([(s.energy_joules, s.gap) for s in batch.gpus])
    assert energies == [
        [(0.0, False)],
        [(500.0, False)],
        [(200.0, False)],
        [],
        [(None, True)],
        [(100.0, False)],
    ]
    assert collector.gaps_total == 1
    assert collector.replica_energy_joules == {"large-0": 800.0}


async def test_spool_sink_writes_one_directory_per_kind(config, tmp_path):
    """Samples land as JSON lines under gpu_samples/ and engine_samples/."""
    sink = SpoolSink(tmp_path)
    sink.open()
    collector = FleetCollector(config, [FakeGpuSource("node-a", [[reading()]])], [])
    await sink(await collector.scrape_once())
    await sink.close()
    [segment] = (tmp_path / "gpu_samples").glob("seg-*.jsonl")
    records, torn = read_segment(segment)
    assert torn == 0
    assert records[0]["replica"] == "large-0"
    assert orjson.loads(orjson.dumps(records[0]))["gap"] is False
    assert (tmp_path / "engine_samples").is_dir()


async def test_a_spool_that_cannot_be_written_does_not_stop_the_loop(fleet_config, tmp_path):
    """Samples that cannot be spooled are counted, and every round still scrapes."""
    sink = SpoolSink(tmp_path)
    sink.open()
    (tmp_path / "gpu_samples").rmdir()  # a new segment file cannot be created any more
    (tmp_path / "gpu_samples").write_text("not a directory")
    collector = FleetCollector(
        fleet_config(scrape_interval_seconds=0.05), [FakeGpuSource("node-a", [[reading()]])], []
    )
    await asyncio.wait_for(collector.run(sink, rounds=3), 10)
    await sink.close()
    assert collector.rounds == 3
    assert collector.sink_errors_total == 3


def test_a_samples_json_is_its_fields(config):
    """``to_json`` (what the sink spools) is the sample's fields, as ``dataclasses.asdict`` has them."""
    import dataclasses

    collector = FleetCollector(
        config, [FakeGpuSource("node-a", [[reading(mig_profile="1g.10gb")]])], []
    )
    sample: GpuSample = asyncio.run(collector.scrape_once()).gpus[0]
    assert sample.to_json() == dataclasses.asdict(sample)


async def test_a_time_sliced_board_counts_once_split_among_its_pods(config):
    """Two pods sharing one board: one sample each, half the board's time and energy each."""
    t = [1000.0]
    placed = placements(
        {
            "a": EngineTarget(
                "small-0",
                "http://10.0.0.1:9000/engine/metrics",
                "pod-a",
                node="node-a",
                namespace="ns",
            ),
            "b": EngineTarget(
                "small-1",
                "http://10.0.0.2:9000/engine/metrics",
                "pod-b",
                node="node-a",
                namespace="ns",
            ),
        }
    )
    shared: list[list[GpuReading] | ScrapeError] = [
        [
            reading(gpu="3", uuid="GPU-3333", pod=pod, namespace="ns", energy_mj=e)
            for pod in ("pod-a", "pod-b")
        ]
        for e in (1_000_000.0, 1_600_000.0)
    ]
    collector = FleetCollector(
        config, [FakeGpuSource("node-a", shared)], [], clock=lambda: t[0], monotonic=lambda: t[0]
    )
    collector.place(placed)
    await collector.scrape_once()
    t[0] += 10
    batch = await collector.scrape_once()
    assert sorted(
        (s.instance, s.replica, s.share, s.energy_joules, s.power_watts) for s in batch.gpus
    ) == [("pod-a", "small-0", 0.5, 300.0, 150.0), ("pod-b", "small-1", 0.5, 300.0, 150.0)]
    assert len({s.sample_id for s in batch.gpus}) == 2
    assert collector.gpu_energy_joules[("node-a", "3")] == 600.0


async def test_a_gpu_seen_before_its_pod_was_discovered_is_joined_once_it_is(config):
    """The owner looked up while discovery did not know the pod is not kept once it does."""
    script: list[list[GpuReading] | ScrapeError] = [
        [reading(gpu="3", uuid="GPU-3333", pod="chat-0", namespace="ns")]
    ]
    collector = FleetCollector(config, [FakeGpuSource("node-a", script)], [])
    collector.place(placements({}))
    first = await collector.scrape_once()
    collector.place(
        placements(
            {
                "x": EngineTarget(
                    "small-0",
                    "http://10.0.0.1:9000/engine/metrics",
                    "chat-0",
                    node="node-a",
                    namespace="ns",
                )
            }
        )
    )
    second = await collector.scrape_once()
    assert [(s.replica, s.instance) for s in first.gpus] == [(None, None)]
    assert [(s.replica, s.instance) for s in second.gpus] == [("small-0", "chat-0")]


class _Broken:
    """A node whose source fails in a way it did not foresee."""

    target, kind = "node-b", "fake"

    async def read(self) -> list[GpuReading]:
        """Raise what a parser bug would."""
        raise ValueError("invalid literal for int() with base 10: '\u00b2'")


async def test_a_source_that_raises_unexpectedly_fails_alone(config):
    """One target's unforeseen error marks it down; the other nodes' samples are still taken."""
    collector = FleetCollector(config, [FakeGpuSource("node-a", [[reading()]]), _Broken()], [])
    batch = await collector.scrape_once()
    assert [s.node for s in batch.gpus] == ["node-a"]
    state = collector.states[("node-b", "fake")]
    assert (state.up, state.errors_total) == (False, 1)
    assert (
        state.last_error
        == "unreadable: ValueError: invalid literal for int() with base 10: '\u00b2'"
    )
    assert collector.states[("node-a", "fake")].up


async def test_a_hostile_engine_page_costs_no_other_target_its_samples(config):
    """Over loopback: a vLLM page with a '\u00b2' block count, beside a node and a good engine, all read."""
    good = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"
    evil = good + 'vllm:cache_config_info{num_gpu_blocks="\u00b2",block_size="16"} 1\n'.encode()
    dcgm = b'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 50\nDCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a"} NaN\n'
    dcgm += b'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a"} 100\n'
    async with (
        serving(text_app(good)) as good_url,
        serving(text_app(evil)) as evil_url,
        serving(text_app(dcgm)) as dcgm_url,
        serving(text_app(dcgm.replace(b"NaN", b"0"))) as dcgm_ok_url,
        httpx.AsyncClient() as client,
    ):
        collector = FleetCollector(
            config,
            [
                DcgmSource("node-a", f"{dcgm_url}/metrics", client, 2.0),
                DcgmSource("node-b", f"{dcgm_ok_url}/metrics", client, 2.0),
            ],
            [
                VllmSource("small-0", f"{good_url}/metrics", client, 2.0),
                VllmSource("small-1", f"{evil_url}/metrics", client, 2.0),
            ],
        )
        batch = await collector.scrape_once()
    assert [s.node for s in batch.gpus] == ["node-b"]
    assert sorted(e.replica for e in batch.engines) == ["small-0", "small-1"]
    assert [e.kv_cache_tokens for e in batch.engines] == [None, None]
    node_a = collector.states[("node-a", "dcgm")]
    assert not node_a.up
    assert "not a dcgm-exporter page: GPU GPU-a: XID nan is not an XID code" in (
        node_a.last_error or ""
    )


async def test_a_nan_power_is_refused_and_the_next_reading_measures_the_whole_interval(config):
    """A NaN power leaves the GPU out of that round; energy and the totals stay true and finite."""
    t = [1000.0]
    script: list[list[GpuReading] | ScrapeError] = [
        [reading(energy_mj=None, power_watts=w)] for w in (300.0, float("nan"), 300.0, 300.0)
    ]
    collector = FleetCollector(
        config, [FakeGpuSource("node-a", script)], [], clock=lambda: t[0], monotonic=lambda: t[0]
    )
    rounds = []
    for step in (0, 5, 5, 5):
        t[0] += step
        batch = await collector.scrape_once()
        rounds.append([(s.interval_seconds, s.energy_joules, s.power_watts) for s in batch.gpus])
    assert rounds == [[(0.0, 0.0, 300.0)], [], [(10.0, 3000.0, 300.0)], [(5.0, 1500.0, 300.0)]]
    assert collector.gpu_energy_joules == {("node-a", "0"): 4500.0}
    assert collector.replica_energy_joules == {"large-0": 4500.0}
    state = collector.states[("node-a", "fake")]
    assert (state.refused_values_total, state.refusing, state.up) == (1, None, True)


async def test_an_impossible_energy_counter_is_refused_and_power_measures_instead(config):
    """A negative or NaN counter is no reset: the interval's energy comes from power, never < 0."""
    t = [1000.0]
    script: list[list[GpuReading] | ScrapeError] = [
        [reading(energy_mj=e, power_watts=300.0)] for e in (1_000_000.0, -5_000_000.0, float("nan"))
    ]
    collector = FleetCollector(
        config, [FakeGpuSource("node-a", script)], [], clock=lambda: t[0], monotonic=lambda: t[0]
    )
    energies: list[tuple[float | None, bool]] = []
    for step in (0, 5, 5):
        t[0] += step
        batch = await collector.scrape_once()
        energies.extend((s.energy_joules, s.gap) for s in batch.gpus)
    assert energies == [(0.0, False), (1500.0, False), (1500.0, False)]
    assert collector.states[("node-a", "fake")].refused_values_total == 2


async def test_an_engine_page_with_a_nan_queue_is_down_and_spools_nothing(config):
    """Over loopback: a NaN queue marks that engine down with the series named; no sample of it."""
    good = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"
    async with (
        serving(text_app(good)) as good_url,
        serving(text_app(good.replace(b"waiting 2", b"waiting NaN"))) as nan_url,
        httpx.AsyncClient() as client,
    ):
        collector = FleetCollector(
            config,
            [],
            [
                VllmSource("small-0", f"{good_url}/metrics", client, 2.0),
                VllmSource("small-1", f"{nan_url}/metrics", client, 2.0),
            ],
        )
        batch = await collector.scrape_once()
    assert [(e.replica, e.requests_waiting) for e in batch.engines] == [("small-0", 2.0)]
    state = collector.states[("small-1", "vllm")]
    assert not state.up
    assert "vllm:num_requests_waiting is nan" in (state.last_error or "")


async def test_a_time_sliced_board_from_a_real_page_is_split_among_its_pods(config):
    """Over loopback, dcgm-exporter's page of a board shared by two pods: half the board each."""
    pages = [shared_board_page(1_000_000).encode(), shared_board_page(1_600_000).encode()]

    async def exporter(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await text_app(pages.pop(0) if len(pages) > 1 else pages[0])(scope, receive, send)

    placed = placements(
        {
            pod: EngineTarget(
                replica,
                f"http://10.0.0.{i}:9000/engine/metrics",
                pod,
                node="node-a",
                namespace="ns",
            )
            for i, (pod, replica) in enumerate((("pod-a", "small-0"), ("pod-b", "small-1")))
        }
    )
    t = [1000.0]
    async with serving(exporter) as url, httpx.AsyncClient() as client:
        source = DcgmSource("node-a", f"{url}/metrics", client, 2.0)
        collector = FleetCollector(config, [source], [], clock=lambda: t[0], monotonic=lambda: t[0])
        collector.place(placed)
        await collector.scrape_once()
        t[0] += 10
        batch = await collector.scrape_once()
    assert sorted(
        (s.instance, s.replica, s.share, s.energy_joules, s.power_watts) for s in batch.gpus
    ) == [("pod-a", "small-0", 0.5, 300.0, 150.0), ("pod-b", "small-1", 0.5, 300.0, 150.0)]
    assert collector.replica_energy_joules == {"small-0": 300.0, "small-1": 300.0}


def _mig_page(slices: list[tuple[str, str]], board_mj: int) -> str:
    """One A100 in the given (GPU_I_ID, profile) slices, its counter at ``board_mj``."""
    lines = []
    for gi, profile in slices:
        lab = f'gpu="0",UUID="GPU-mig",modelName="NVIDIA A100",GPU_I_PROFILE="{profile}",GPU_I_ID="{gi}"'
        lines += [
            f"DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{lab}}} 0.5",
            f"DCGM_FI_DEV_POWER_USAGE{{{lab}}} 300",
            f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{lab}}} {board_mj}",
        ]
    return "\n".join(lines) + "\n"


TWO_SLICES = [("1", "3g.40gb"), ("2", "4g.40gb")]
THREE_SLICES = [*TWO_SLICES, ("3", "1g.10gb")]


async def _mig_rounds(
    config: Config, layouts: list[list[tuple[str, str]]], steps: Sequence[float]
) -> tuple[list[list[GpuSample]], FleetCollector]:
    """The GPU samples of one round per layout of an A100 on node-a, its counter rising 1500 J
    a round from about 8 days at 700 W, ``steps`` seconds before each round; and the collector."""
    boot_mj, step_mj = 500_000_000_000, 1_500_000
    script: list[list[GpuReading] | ScrapeError] = [
        dcgm_readings(_mig_page(slices, boot_mj + i * step_mj), "node-a")
        for i, slices in enumerate(layouts)
    ]
    t = [1000.0]
    collector = FleetCollector(
        config, [FakeGpuSource("node-a", script)], [], clock=lambda: t[0], monotonic=lambda: t[0]
    )
    rounds = []
    for step in steps:
        t[0] += step
        rounds.append((await collector.scrape_once()).gpus)
    return rounds, collector


@pytest.mark.parametrize(
    ("before", "after"),
    [(TWO_SLICES, THREE_SLICES), (THREE_SLICES, TWO_SLICES)],
    ids=["created", "destroyed"],
)
async def test_a_gpu_instance_created_or_destroyed_leaves_the_board_energy_true(
    config, before, after
):
    """A board whose MIG layout changes (no reboot) is billed what its counter drew in each
    interval, split by the current shares: never its since-boot energy, never a slice's time lost."""
    rounds, _ = await _mig_rounds(config, [before, before, after, after], [0, 5, 5, 5])
    assert [sum(s.energy_joules or 0.0 for s in gpus) for gpus in rounds] == pytest.approx(
        [0.0, 1500.0, 1500.0, 1500.0]
    )
    # The interval the layout changed in: each slice its current share of the board's 1500 J
    # and 5 s, so the board's GPU time is 5 s too.
    changed = rounds[2]
    assert [(s.gpu, s.interval_seconds) for s in changed] == [(f"0/{gi}", 5.0) for gi, _ in after]
    assert [s.energy_joules for s in changed] == pytest.approx([1500.0 * s.share for s in changed])
    assert sum(s.interval_seconds * s.share for s in changed) == pytest.approx(5.0)
    assert not any(s.gap for gpus in rounds for s in gpus)


async def test_a_wall_clock_step_loses_no_energy_and_invents_no_gap(config):
    """The wall clock stepped back 2 s, then forward 90 s (NTP, a VM resumed): every interval
    is still measured, its energy what the counter drew, none a gap; samples keep wall time."""
    walls = iter([1000.0, 1010.0, 1008.0, 1100.0, 1110.0])
    script: list[list[GpuReading] | ScrapeError] = [
        [reading(energy_mj=1_000_000.0 + i * 500_000.0)] for i in range(5)
    ]
    wall = [0.0]
    collector = FleetCollector(config, [FakeGpuSource("node-a", script)], [], clock=lambda: wall[0])
    samples = []
    for w in walls:
        wall[0] = w
        samples += (await collector.scrape_once()).gpus
    assert [s.energy_joules for s in samples] == [0.0, 500.0, 500.0, 500.0, 500.0]
    assert not any(s.gap for s in samples)
    assert all(0.0 < s.interval_seconds < collector.gap_seconds for s in samples[1:])
    assert [s.timestamp for s in samples] == [1000.0, 1010.0, 1008.0, 1100.0, 1110.0]
    assert collector.gaps_total == 0


async def test_a_reading_at_no_later_instant_keeps_the_baseline(config):
    """An interval of no time measures 0 s, 0 J and the next one starts where it would have:
    what the counter drew meanwhile is billed with the next interval, not lost."""
    mono = iter([0.0, 10.0, 10.0, 20.0])
    now = [0.0]
    script: list[list[GpuReading] | ScrapeError] = [
        [reading(energy_mj=1_000_000.0 + i * 500_000.0)] for i in range(4)
    ]
    collector = FleetCollector(
        config,
        [FakeGpuSource("node-a", script)],
        [],
        clock=lambda: 1000.0 + now[0],
        monotonic=lambda: now[0],
    )
    rounds = []
    for m in mono:
        now[0] = m
        rounds += [
            (s.interval_seconds, s.energy_joules) for s in (await collector.scrape_once()).gpus
        ]
    assert rounds == [(0.0, 0.0), (10.0, 500.0), (0.0, 0.0), (10.0, 1000.0)]


def _boards_page(capture: str, boards: dict[str, int]) -> str:
    """The real capture's board repeated as GPU index ``i`` (UUID ``...-i``) for each of
    ``boards``, its energy counter at the millijoules given; a board not named is off the page."""
    samples = [line for line in capture.splitlines() if line and not line.startswith("#")]
    out = []
    for index, energy_mj in boards.items():
        for line in samples:
            line = line.replace('gpu="0"', f'gpu="{index}"').replace('c44c"', f'c44c-{index}"')
            if line.startswith("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"):
                line = f"{line.rsplit(' ', 1)[0]} {energy_mj}"
            out.append(line)
    return "\n".join(out) + "\n"


async def test_a_board_that_left_the_page_comes_back_as_a_first_reading_not_a_gap(
    config, fixture_text
):
    """A board that node-a's page (a real capture) left out for longer than the gap limit, while
    the page was read, is measured afresh when it is back: its absence is no gap billed as GPU
    time, and its last reading is forgotten meanwhile (memory stays bounded)."""
    capture = fixture_text("dcgm-exporter-rtx4000ada-k8s.prom")
    both = (0, 1, 7)
    script: list[list[GpuReading] | ScrapeError] = [
        dcgm_readings(
            _boards_page(
                capture,
                {"0": 1_000_000 + i * 500_000, "1": 2_000_000 + i * 500_000}
                if i in both
                else {"0": 1_000_000 + i * 500_000},
            ),
            "node-a",
        )
        for i in range(8)
    ]
    t = [1000.0]
    collector = FleetCollector(
        config, [FakeGpuSource("node-a", script)], [], clock=lambda: t[0], monotonic=lambda: t[0]
    )
    assert collector.gap_seconds == 15.0
    rounds = []
    kept = []
    for step in (0, 5, 5, 5, 5, 5, 5, 5):
        t[0] += step
        batch = await collector.scrape_once()
        rounds.append([(s.gpu, s.interval_seconds, s.energy_joules, s.gap) for s in batch.gpus])
        kept.append(len(collector._last))
    assert rounds[1] == [("0", 5.0, 500.0, False), ("1", 5.0, 500.0, False)]
    # Away 30 s, twice the gap limit: back as a first reading, 0 s and 0 J.
    assert rounds[7] == [("0", 5.0, 500.0, False), ("1", 0.0, 0.0, False)]
    assert collector.gaps_total == 0
    # Board 1's reading is kept while its absence is no longer than the gap limit, then not.
    assert kept == [2, 2, 2, 2, 2, 1, 1, 2]


async def test_a_board_left_out_of_a_page_within_the_gap_limit_is_measured_across_it(config):
    """A board missing from one page only (a line the exporter skipped) is measured from its
    counter across the missed round when it is back: nothing it drew meanwhile is lost."""
    present = [reading(gpu="0", uuid="GPU-0"), reading(gpu="1", uuid="GPU-1", energy_mj=2e6)]
    script: list[list[GpuReading] | ScrapeError] = [
        present,
        present[:1],
        [present[0], reading(gpu="1", uuid="GPU-1", energy_mj=3e6)],
    ]
    t = [1000.0]
    collector = FleetCollector(
        config, [FakeGpuSource("node-a", script)], [], clock=lambda: t[0], monotonic=lambda: t[0]
    )
    for step in (0, 5, 5):
        t[0] += step
        batch = await collector.scrape_once()
    assert [(s.gpu, s.interval_seconds, s.energy_joules, s.gap) for s in batch.gpus] == [
        ("0", 5.0, 0.0, False),
        ("1", 10.0, 1000.0, False),
    ]


async def test_a_gpu_instance_id_given_again_after_a_repartition_spans_no_absence(config):
    """A MIG slice destroyed and its GPU_I_ID given to a new slice a minute later: the new one
    starts from the board's last reading (its share of the board's increase since), no gap,
    and the board's energy and GPU time stay exactly the counter's and the clock's."""
    layouts = [TWO_SLICES] * 2 + [[("1", "3g.40gb")]] * 6 + [[("1", "3g.40gb"), ("2", "2g.20gb")]]
    rounds, collector = await _mig_rounds(config, layouts, [0] + [10] * (len(layouts) - 1))
    back = rounds[-1]
    assert [(s.gpu, s.interval_seconds, s.gap) for s in back] == [
        ("0/1", 10.0, False),
        ("0/2", 10.0, False),
    ]
    assert sum(s.energy_joules or 0.0 for s in back) == pytest.approx(1500.0)
    assert sum(s.interval_seconds * s.share for s in back) == pytest.approx(10.0)
    assert collector.gaps_total == 0


def _one_gpu_page(energy_mj: int) -> bytes:
    lab = 'gpu="0",UUID="GPU-a",modelName="NVIDIA H100",Hostname="node-a"'
    return (
        f"DCGM_FI_DEV_GPU_UTIL{{{lab}}} 50\n"
        f"DCGM_FI_DEV_POWER_USAGE{{{lab}}} 300\n"
        f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{lab}}} {energy_mj}\n"
    ).encode()


async def test_one_board_read_under_two_nodes_is_sampled_once(config):
    """Over loopback, two nodes[] URLs reaching one exporter: the board is billed once, under
    the first node, and the other target's duplicate is counted on its series."""
    pages = [_one_gpu_page(1_000_000)] * 2 + [_one_gpu_page(2_500_000)] * 2

    async def exporter(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await text_app(pages.pop(0))(scope, receive, send)

    t = [1000.0]
    async with serving(exporter) as url, httpx.AsyncClient() as client:
        sources = [DcgmSource(node, f"{url}/metrics", client, 2.0) for node in ("node-a", "node-b")]
        collector = FleetCollector(config, sources, [], clock=lambda: t[0], monotonic=lambda: t[0])
        await collector.scrape_once()
        t[0] += 5
        batch = await collector.scrape_once()
    assert [(s.node, s.uuid, s.interval_seconds, s.energy_joules) for s in batch.gpus] == [
        ("node-a", "GPU-a", 5.0, 1500.0)
    ]
    assert collector.gpus["node-b"] == []
    registry = CollectorRegistry()
    registry.register(FleetMetrics(collector))
    count = registry.get_sample_value
    dup = "infermeter_collector_duplicate_gpus_total"
    assert count(dup, {"target": "node-b", "kind": "dcgm"}) == 2
    assert count(dup, {"target": "node-a", "kind": "dcgm"}) == 0


async def test_a_board_stays_with_the_node_that_took_it_and_no_interval_counts_twice(config):
    """node-a misses a round: node-b takes the board on from node-a's last reading and keeps it
    when node-a is back, so every second and joule of the board is billed exactly once."""

    def rounds(node: str, down: int | None) -> list[list[GpuReading] | ScrapeError]:
        return [
            ScrapeError("down") if i == down else [reading(node=node, energy_mj=1e6 + i * 5e5)]
            for i in range(4)
        ]

    t = [1000.0]
    collector = FleetCollector(
        config,
        [
            FakeGpuSource("node-a", rounds("node-a", 1)),
            FakeGpuSource("node-b", rounds("node-b", None)),
        ],
        [],
        clock=lambda: t[0],
        monotonic=lambda: t[0],
    )
    samples = []
    for step in (0, 10, 10, 10):
        t[0] += step
        samples += (await collector.scrape_once()).gpus
    assert [(s.node, s.interval_seconds, s.energy_joules) for s in samples] == [
        ("node-a", 0.0, 0.0),
        ("node-b", 10.0, 500.0),
        ("node-b", 10.0, 500.0),
        ("node-b", 10.0, 500.0),
    ]


def test_each_board_has_one_home_the_holder_first_then_the_configuration_order():
    """The node a board was last sampled under keeps it while it reports it; else the first in
    order; a reading without a UUID cannot be matched and stays with its node."""
    a, b = (reading(node=n, uuid="GPU-1") for n in ("node-a", "node-b"))
    anonymous = reading(node="node-b", uuid="")
    reports = {"node-a": [a], "node-b": [b, anonymous]}
    assert board_homes(reports, {}) == {"GPU-1": "node-a"}
    assert board_homes(reports, {"GPU-1": "node-b"}) == {"GPU-1": "node-b"}
    assert board_homes(reports, {"GPU-1": "node-c"}) == {"GPU-1": "node-a"}


async def test_a_page_in_a_charset_slow_to_decode_is_read_as_utf_8():
    """A target naming ``charset=punycode`` (whose decoding takes time quadratic in the page,
    on the event loop, where no timeout stops it: minutes for a page under the size cap): the
    page is read as UTF-8, the exposition format's encoding, whatever the server names."""
    page = b"vllm:num_requests_running 1\n# " + b"a" * 2_000 + b"\n"
    app = text_app(page, content_type=b"text/plain; charset=punycode")
    async with serving(app) as url, httpx.AsyncClient() as client:
        text = await fetch_text(client, f"{url}/metrics", 5.0)
    assert text == page.decode()


def test_a_page_split_by_carriage_returns_is_one_line_not_millions():
    """Lines end at a line feed, as they are counted against the limit: twenty samples joined
    by CRs are one line of garbage, not twenty samples past a limit of ten (a page of millions
    of CRs would otherwise be split into millions of strings, on the event loop)."""
    with pytest.raises(ExpositionError, match="line 1 has a bad value"):
        parse_samples("vllm:num_requests_running 1\r" * 20, {"vllm:num_requests_running"}, 10)


async def test_a_round_that_cannot_be_spooled_is_measured_in_the_next(fleet_config):
    """The disk refuses the second round's samples: the third round measures the board from
    the last reading spooled, so the energy of both intervals is in what was spooled (the
    counter's whole rise), not lost with the batch."""
    readings: list[list[GpuReading] | ScrapeError] = [
        [reading(energy_mj=mj)] for mj in (1_000_000.0, 2_000_000.0, 3_000_000.0)
    ]
    spooled: list[Batch] = []
    calls = 0

    async def sink(batch: Batch) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise SpoolError("disk full")
        spooled.append(batch)

    collector = FleetCollector(
        fleet_config(scrape_interval_seconds=0.05, gap_after_intervals=10),
        [FakeGpuSource("node-a", readings)],
        [],
    )
    await asyncio.wait_for(collector.run(sink, rounds=3), 10)
    assert collector.sink_errors_total == 1
    joules = [s.energy_joules for b in spooled for s in b.gpus if s.energy_joules]
    assert sum(joules) == pytest.approx(2_000.0)
