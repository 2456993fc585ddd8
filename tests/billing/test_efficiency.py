"""The efficiency figures and the advisor, on constructed ledgers whose answers are worked by hand.

Every ledger below runs its GPUs at 0 W, so a group's cost is its GPU-hours at the price book's
rate (demo config: H100 $3.90, L40S $1.60 per GPU-hour), and one measured hour scales to a month
as 730 hours.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
import yaml

from billing.efficiency.advice import Policy
from billing.efficiency.store import read_report
from billing.ledger import Ledger
from billing.serve import open_ledger
from infermeter.config import Config
from launcher.cli import main
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.billing.fleet_month import Group, Month, Stream, hourly, month_config, run

NOW = OCT + 40 * 86400
HOUR = OCT + 3600  # 01:00 on the first: every ledger's one measured hour starts here
_ids = itertools.count()


def engine(
    replica: str,
    running: float,
    waiting: float = 0.0,
    model: str = "chat-small",
    start: float = HOUR,
    every: float = 60.0,
    kv: float = 0.1,
    **counters: Any,
) -> list[dict[str, Any]]:
    """One engine sample a minute through the hour, ``running``, ``waiting`` and the KV cache's
    use ``kv`` throughout."""
    return [
        {
            "sample_id": f"e-{next(_ids)}",
            "replica": replica,
            "model": model,
            "timestamp": start + 30 + i * every,
            "requests_running": running,
            "requests_waiting": waiting,
            "kv_cache_usage": kv,
            "prompt_tokens_total": 0.0,
            "generation_tokens_total": 0.0,
            **{k: v(i) for k, v in counters.items()},
        }
        for i in range(int(3600 // every))
    ]


def gpus(
    replica: str, count: int = 1, gpu_model: str = "L40S", node: str = "node-b", first: int = 0
) -> list[dict[str, Any]]:
    """``count`` GPUs of ``replica`` busy through the hour at 0 W."""
    out = []
    for i in range(count):
        out += gpu_samples(
            replica,
            start=HOUR,
            seconds=3600,
            every=60,
            gpu_model=gpu_model,
            watts=0.0,
            node=node,
            gpu=str(first + i),
        )
    return out


def requests(
    n: int,
    team: str = "search",
    replica: str = "small-0",
    model: str = "chat-small",
    prompt: int = 100,
    completion: int = 50,
) -> list[dict[str, Any]]:
    """``n`` requests of ``team`` finishing inside the hour, one every 30 s."""
    served = "llama-3.1-70b-instruct-fp8" if model == "chat-large" else "llama-3.1-8b-instruct"
    return [
        usage(
            team,
            HOUR + 60 + 30 * i,
            10.0,
            replica=replica,
            model=model,
            served_version=served,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        for i in range(n)
    ]


def fill(ledger: Ledger, **kinds: list[dict[str, Any]]) -> None:
    """Ingest each kind's records; every one must be kept."""
    for kind, records in kinds.items():
        result = ledger.ingest(batch(kind, records), now=NOW)
        assert result.rejected == [], result.rejected


def report(ledger: Ledger, config: Config, team: str | None = None) -> Any:
    """October's report."""
    with ledger.reader() as cursor:
        return read_report(cursor, config, "2026-10", NOW, team)


def kinds(found: Any, kind: str) -> list[Any]:
    """The recommendations of one kind."""
    return [r for r in found.recommendations if r.kind == kind]


def test_group_figures_are_measured_per_hour(ledger, config):
    """Tokens per GPU-second, cost per 1M tokens, idle share, occupancy, prefix hits and preemptions add up by hand."""
    fill(
        ledger,
        usage=requests(100),  # 100 x (100 in, 50 out), 10 s each: 1000 in-flight s in 60 minutes
        gpu_samples=gpus("small-0"),
        engine_samples=engine(
            "small-0",
            32,
            prefix_cache_queries_total=lambda i: 100.0 * i,
            prefix_cache_hits_total=lambda i: 25.0 * i,
            # 2 a minute, then a restart from zero at minute 30: 29 x 2 + 0 + 29 x 2 = 116
            preemptions_total=lambda i: 2.0 * (i if i < 30 else i - 30),
        ),
    )
    row = report(ledger, config).groups.row(0, named=True)
    assert (row["t"], row["replica"], row["requests"]) == (HOUR, "small-0", 100)
    assert row["cost_usd"] == pytest.approx(1.60)
    assert row["tokens_per_gpu_second"] == pytest.approx(15_000 / 3600)
    assert row["idle_share"] == pytest.approx(1 - 1000 / 3600)
    assert row["batch_occupancy"] == pytest.approx(32 / 128)
    assert row["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert row["preemptions"] == pytest.approx(116)
    # $1.60 over 10,000 input + 3 x 5,000 output weighted tokens = 25,000.
    assert row["usd_per_1m_input_tokens"] == pytest.approx(1.60 / 25_000 * 1e6)
    assert row["usd_per_1m_output_tokens"] == pytest.approx(3 * 1.60 / 25_000 * 1e6)
    assert row["queue_wait_seconds"] == pytest.approx(0.0)


def _small_month(days: int = 2) -> Month:
    """Two L40S replicas of chat-small whose load one holds, for ``days`` days."""
    return Month(
        (Group("small-0"), Group("small-1")),
        (Stream("search", "chat-small", hourly(8, 8), 300, 150),),
        days=days,
    )


def test_min_replicas_is_never_broken(ledger, config):
    """The demo's scaling.min_replicas is 2: two replicas whose load one holds are left alone."""
    assert config.scaling.min_replicas == 2
    found = run(config, _small_month(), ledger).report
    assert found is not None
    assert found.recommendations == ()


def test_the_saving_floor_is_a_policy():
    """The default policy offers nothing under a dollar a month."""
    assert Policy().min_saving_usd_per_month == 1.0


def test_advise_reads_a_ledger_file_and_prints_the_plan(tmp_path, capsys):
    """`infermeter advise --database` prints the plan as a table, with its replay, and as JSON."""
    config = month_config()
    path, config_file = str(tmp_path / "ledger.duckdb"), tmp_path / "fleet.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    ledger = open_ledger(config, path)
    run(config, _small_month(), ledger)
    ledger.close()
    args = ["advise", "--config", str(config_file), "--month", "2026-10", "--database", path]
    assert main(args) == 0
    text = capsys.readouterr().out
    # 48 hours of one L40S saved: $76.80, x 730 / 48 = $1,168 a month.
    assert "2026-10: one plan of 1 change, 1,168.00 USD/month" in text
    assert "1,168.00 USD/month  chat-small: run 1 replica instead of 2  [right_size]" in text
    assert "replay chat-small: GPU-hours 96.0 -> 48.0" in text
    assert "search TTFT p95" in text
    assert main([*args, "--format", "json"]) == 0
    body = orjson.loads(capsys.readouterr().out)
    assert [r["saving_usd_per_month"] for r in body["recommendations"]] == [1168.0]
    assert body["plan"]["saving_usd_per_month"] == 1168.0


def test_a_team_sees_only_its_own_advice(ledger):
    """A team's view has its own hourly rows and no fleet-wide advice, groups or notes."""
    config = month_config()
    run(config, _small_month(), ledger)
    with ledger.reader() as cursor:
        found = read_report(cursor, config, "2026-10", NOW, "search")
    assert set(found.teams["team"]) == {"search"}
    assert (found.groups.height, found.recommendations, found.notes) == (0, (), ())


def test_occupancy_is_against_the_fuller_of_slots_and_kv_cache(ledger, config):
    """32 of 128 slots running with the KV cache 80 % full: the engine is 80 % occupied."""
    fill(
        ledger,
        usage=requests(10),
        gpu_samples=gpus("small-0"),
        engine_samples=engine("small-0", 32, kv=0.8),
    )
    row = report(ledger, config).groups.row(0, named=True)
    assert row["batch_occupancy"] == pytest.approx(0.8)
    assert row["kv_cache_usage"] == pytest.approx(0.8)


def test_an_hour_with_gpu_time_and_no_requests_is_all_idle(ledger, config):
    """A replica that served nothing for an hour shows its model, its cost and an idle share of 1."""
    fill(ledger, gpu_samples=gpus("small-1", first=1))
    [row] = report(ledger, config).groups.iter_rows(named=True)
    assert (row["model"], row["requests"], row["idle_share"]) == ("chat-small", 0, 1.0)
    assert row["cost_usd"] == pytest.approx(1.60)
    assert row["tokens_per_gpu_second"] == 0


def test_instances_of_one_group_are_figured_apart(ledger, config):
    """Two engine instances of small-0 keep their own occupancy and preemption counts."""
    first = engine("small-0", 64, preemptions_total=lambda i: float(i))
    second = engine("small-0", 32, preemptions_total=lambda i: 100.0)
    fill(
        ledger,
        engine_samples=[s | {"instance": "small-0-a"} for s in first]
        + [s | {"instance": "small-0-b"} for s in second],
    )
    rows = {r["instance"]: r for r in report(ledger, config).instances.iter_rows(named=True)}
    assert rows["small-0-a"]["batch_occupancy"] == pytest.approx(0.5)
    assert rows["small-0-a"]["preemptions"] == pytest.approx(59)
    assert rows["small-0-b"]["batch_occupancy"] == pytest.approx(0.25)
    assert rows["small-0-b"]["preemptions"] == pytest.approx(0)
