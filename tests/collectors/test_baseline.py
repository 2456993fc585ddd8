"""A restarted collector measures the time it was away from each GPU's last reading."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from collectors.baseline import MAX_AGE_SECONDS, BaselineFile, dump, load
from collectors.energy import Point
from collectors.loop import FleetCollector
from collectors.serve import SpoolSink
from infermeter.config import Config
from infermeter.spool import read_segment
from tests.collectors.fakes import FakeGpuSource, reading


def test_readings_round_trip_and_old_or_future_ones_are_dropped() -> None:
    """What ``dump`` writes, ``load`` reads back, within its age and not from the future."""
    points = {
        ("node-a", "GPU-0", ""): Point(1000.0, 300.0, 9_000_000.0),
        ("node-a", "GPU-1", "1"): Point(400.0 - MAX_AGE_SECONDS, 50.0, None),
        ("node-a", "GPU-2", ""): Point(1001.0, 50.0, 1.0),
    }
    got = load(dump(points), now=1000.0)
    assert got == {("node-a", "GPU-0", ""): Point(1000.0, 300.0, 9_000_000.0)}


def test_a_version_1_file_keeps_whole_gpus_and_drops_mig_slice_counters() -> None:
    """Before version 2 a MIG slice's counter was the board's times its share: set against the
    board's own it would count the rest of the since-boot energy, so it is not restored."""
    rows = [
        {"key": ["node-a", "GPU-0", ""], "t": 1000.0, "w": 300.0, "mj": 9_000_000.0},
        {"key": ["node-a", "GPU-1", "2"], "t": 1000.0, "w": 75.0, "mj": 2_250_000.0},
    ]
    assert load(orjson.dumps(rows), now=1000.0) == {
        ("node-a", "GPU-0", ""): Point(1000.0, 300.0, 9_000_000.0),
        ("node-a", "GPU-1", "2"): Point(1000.0, 75.0, None),
    }


def test_a_file_of_an_unknown_version_is_refused() -> None:
    """A version this collector does not know is no baseline of its."""
    with pytest.raises(ValueError, match="version 3"):
        load(orjson.dumps({"version": 3, "readings": []}), now=0.0)


def test_a_file_that_is_not_a_baseline_is_refused_by_name() -> None:
    """Garbage is a ValueError, never readings."""
    with pytest.raises(ValueError, match="not a baseline file"):
        load(b'{"key": 1}', now=0.0)


def test_an_unreadable_file_reads_as_no_baseline(tmp_path: Path) -> None:
    """A damaged file is ignored (logged): the collector starts afresh, as with none."""
    path = tmp_path / "gpu-baseline.json"
    path.write_bytes(b"\x00garbage")
    assert BaselineFile(path).read(now=0.0) == {}
    assert BaselineFile(tmp_path / "absent.json").read(now=0.0) == {}


async def test_a_restart_bills_the_time_and_energy_it_was_away(
    config: Config, tmp_path: Path
) -> None:
    """Away between two readings: the restarted collector's first sample covers that time and
    the energy the counter says, as if it had never stopped (within the gap limit)."""
    t = [1000.0]
    baseline = BaselineFile(tmp_path / "gpu-baseline.json")
    sink = SpoolSink(tmp_path / "spool")
    sink.open()
    first = FleetCollector(
        config,
        [
            FakeGpuSource(
                "node-a",
                [
                    [reading(node="node-a", gpu="0", energy_mj=9_000_000.0)],
                    [reading(node="node-a", gpu="0", energy_mj=9_500_000.0)],
                ],
            )
        ],
        [],
        clock=lambda: t[0],
        monotonic=lambda: t[0],
    )
    first.restore(baseline, t[0])
    for step in (0.0, 10.0):
        t[0] += step
        await first._deliver(sink, await first.scrape_once())
    away = first.gap_seconds - 1.0
    t[0] += away
    second = FleetCollector(
        config,
        [
            FakeGpuSource(
                "node-a",
                [
                    [reading(node="node-a", gpu="0", energy_mj=11_000_000.0)],
                ],
            )
        ],
        [],
        clock=lambda: t[0],
        monotonic=lambda: t[0],
    )
    second.restore(baseline, t[0])
    await second._deliver(sink, await second.scrape_once())
    await sink.close()
    samples = [
        s
        for seg in sorted((tmp_path / "spool" / "gpu_samples").glob("seg-*.jsonl"))
        for s in read_segment(seg)[0]
    ]
    assert [(s["interval_seconds"], s["energy_joules"]) for s in samples] == [
        (0.0, 0.0),
        (10.0, 500.0),
        (away, 1500.0),
    ]
    assert sum(s["interval_seconds"] for s in samples) == t[0] - 1000.0


async def test_away_longer_than_the_gap_limit_counts_the_time_not_the_energy(
    config: Config, tmp_path: Path
) -> None:
    """Past the gap limit the interval is a gap, as for a collector that never stopped (each
    process with a monotonic clock of its own: the file's wall time carries the interval)."""
    baseline = BaselineFile(tmp_path / "gpu-baseline.json")
    first = FleetCollector(
        config,
        [FakeGpuSource("node-a", [[reading(energy_mj=1.0)]])],
        [],
        clock=lambda: 1000.0,
        monotonic=lambda: 50.0,
    )
    first.restore(baseline, 1000.0)
    sink = SpoolSink(tmp_path / "spool")
    sink.open()
    await first._deliver(sink, await first.scrape_once())
    later = 1000.0 + first.gap_seconds + 5.0
    second = FleetCollector(
        config,
        [FakeGpuSource("node-a", [[reading(energy_mj=9.0)]])],
        [],
        clock=lambda: later,
        monotonic=lambda: 7.0,
    )
    second.restore(baseline, later)
    [sample] = (await second.scrape_once()).gpus
    await sink.close()
    assert (sample.interval_seconds, sample.energy_joules, sample.gap) == (
        first.gap_seconds + 5.0,
        None,
        True,
    )


async def test_a_board_the_last_page_left_out_is_not_kept_across_a_restart(
    config: Config, tmp_path: Path
) -> None:
    """A board missing from the page when the collector stopped is not restored: back after a
    restart, past the gap limit, it is a first reading, as for a collector that never stopped,
    not a gap billing its absence; the board that stayed is measured across the restart."""
    t = [1000.0]
    baseline = BaselineFile(tmp_path / "gpu-baseline.json")
    sink = SpoolSink(tmp_path / "spool")
    sink.open()
    both = [reading(gpu="0", uuid="GPU-0"), reading(gpu="1", uuid="GPU-1")]
    first = FleetCollector(
        config,
        [FakeGpuSource("node-a", [both, both[:1], both[:1]])],
        [],
        clock=lambda: t[0],
        monotonic=lambda: t[0],
    )
    first.restore(baseline, t[0])
    for step in (0.0, 5.0, 5.0):
        t[0] += step
        await first._deliver(sink, await first.scrape_once())
    await sink.close()
    t[0] += 8.0
    second = FleetCollector(
        config,
        [FakeGpuSource("node-a", [[reading(gpu="0", uuid="GPU-0", energy_mj=2e6), both[1]]])],
        [],
        clock=lambda: t[0],
        monotonic=lambda: 3.0,
    )
    second.restore(baseline, t[0])
    batch = await second.scrape_once()
    assert second.gap_seconds < 18.0  # board 1 was last read 18 s before
    assert [(s.gpu, s.interval_seconds, s.energy_joules, s.gap) for s in batch.gpus] == [
        ("0", 8.0, 1000.0, False),
        ("1", 0.0, 0.0, False),
    ]
