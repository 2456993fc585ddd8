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

from billing.efficiency.advice import Policy, shape_of
from billing.efficiency.cli import table
from billing.efficiency.store import read_report
from billing.ledger import Ledger
from billing.serve import open_ledger
from infermeter.cli import main
from infermeter.config import Config
from tests.billing.conftest import OCT, batch, gpu_samples, usage

NOW = OCT + 40 * 86400
HOUR = OCT + 3600  # 01:00 on the first: every ledger's one measured hour starts here
_ids = itertools.count()


def engine(replica: str, running: float, waiting: float = 0.0, model: str = "chat-small",
           start: float = HOUR, every: float = 60.0, **counters: Any) -> list[dict[str, Any]]:  # fmt: skip
    """One engine sample a minute through the hour, ``running`` and ``waiting`` throughout."""
    return [{"sample_id": f"e-{next(_ids)}", "replica": replica, "model": model,
             "timestamp": start + 30 + i * every, "requests_running": running,
             "requests_waiting": waiting, "kv_cache_usage": 0.5, "prompt_tokens_total": 0.0,
             "generation_tokens_total": 0.0, **{k: v(i) for k, v in counters.items()}}
            for i in range(int(3600 // every))]  # fmt: skip


def gpus(replica: str, count: int = 1, gpu_model: str = "L40S", node: str = "node-b",
         first: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """``count`` GPUs of ``replica`` busy through the hour at 0 W."""
    out = []
    for i in range(count):
        out += gpu_samples(replica, start=HOUR, seconds=3600, every=60, gpu_model=gpu_model,
                           watts=0.0, node=node, gpu=str(first + i))  # fmt: skip
    return out


def requests(n: int, team: str = "search", replica: str = "small-0", model: str = "chat-small",
             prompt: int = 100, completion: int = 50) -> list[dict[str, Any]]:  # fmt: skip
    """``n`` requests of ``team`` finishing inside the hour, one every 30 s."""
    served = "llama-3.1-70b-instruct-fp8" if model == "chat-large" else "llama-3.1-8b-instruct"
    return [usage(team, HOUR + 60 + 30 * i, 10.0, replica=replica, model=model,
                  served_version=served, prompt_tokens=prompt, completion_tokens=completion)
            for i in range(n)]  # fmt: skip


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
            "small-0", 32,
            prefix_cache_queries_total=lambda i: 100.0 * i,
            prefix_cache_hits_total=lambda i: 25.0 * i,
            # 2 a minute, then a restart from zero at minute 30: 29 x 2 + 0 + 29 x 2 = 116
            preemptions_total=lambda i: 2.0 * (i if i < 30 else i - 30),
        ),
    )  # fmt: skip
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


def test_right_size_fires_on_a_group_its_peak_does_not_need(ledger, config):
    """Two L40S replicas whose busiest minute runs 20 sequences need one: half their $3.20 an hour saved."""
    fill(ledger, usage=requests(10) + requests(10, replica="small-1"),
         gpu_samples=gpus("small-0") + gpus("small-1", first=1),
         engine_samples=engine("small-0", 10) + engine("small-1", 10))  # fmt: skip
    [rec] = kinds(report(ledger, config), "right_size")
    assert rec.action == {"replicas": 1}
    assert rec.evidence["peak_running"] == pytest.approx(20)
    assert rec.saving_usd_per_month == pytest.approx(3.20 / 2 * 730)


def test_right_size_does_not_fire_when_requests_queued(ledger, config):
    """A group whose queue was ever non-empty keeps every replica, however idle it looks on average."""
    fill(ledger, usage=requests(10) + requests(10, replica="small-1"),
         gpu_samples=gpus("small-0") + gpus("small-1", first=1),
         engine_samples=engine("small-0", 10, waiting=1) + engine("small-1", 10))  # fmt: skip
    assert kinds(report(ledger, config), "right_size") == []


def test_right_size_does_not_fire_when_the_peak_needs_every_replica(ledger, config):
    """110 + 110 running sequences, with 25% headroom, need both replicas of 128."""
    fill(ledger, usage=requests(10) + requests(10, replica="small-1"),
         gpu_samples=gpus("small-0") + gpus("small-1", first=1),
         engine_samples=engine("small-0", 110) + engine("small-1", 110))  # fmt: skip
    assert kinds(report(ledger, config), "right_size") == []


def test_right_size_counts_the_instances_of_a_dynamic_group(ledger, config):
    """One replica group running two single-GPU instances of 10 sequences each needs one instance."""
    samples, served, held = [], [], []
    for i, pod in enumerate(("small-0-a", "small-0-b")):
        samples += [s | {"instance": pod} for s in engine("small-0", 10)]
        served += [r | {"instance": pod} for r in requests(10)]
        held += [g | {"instance": pod} for g in gpus("small-0", first=i)]
    fill(ledger, usage=served, gpu_samples=held, engine_samples=samples)
    found = report(ledger, config)
    [rec] = kinds(found, "right_size")
    assert rec.action == {"instances": 1}
    assert rec.saving_usd_per_month == pytest.approx(3.20 / 2 * 730)
    assert kinds(found, "quantize") == []  # each instance holds one GPU, not two


def test_quantize_fires_when_4_bits_fit_on_one_gpu(ledger, config):
    """The 70B FP8 model on two H100s fits at 4 bits on one for its measured load: one H100 saved."""
    fill(ledger, usage=requests(10, replica="large-0", model="chat-large"),
         gpu_samples=gpus("large-0", 2, "H100", "node-a"),
         engine_samples=engine("large-0", 8, model="chat-large"))  # fmt: skip
    [rec] = kinds(report(ledger, config), "quantize")
    assert rec.action == {"precision": "int4", "tensor_parallel": 1}
    assert rec.saving_usd_per_month == pytest.approx(3.90 * 730)
    assert "quality" in (rec.caveat or "")


def test_quantize_does_not_fire_when_the_kv_cache_needs_the_gpus(ledger, config):
    """64 sequences of 8,000 tokens need 168 GB of KV cache: even at 4 bits the model needs its two H100s and more."""
    fill(ledger, usage=requests(10, replica="large-0", model="chat-large", prompt=7000, completion=1000),
         gpu_samples=gpus("large-0", 2, "H100", "node-a"),
         engine_samples=engine("large-0", 64, model="chat-large"))  # fmt: skip
    assert kinds(report(ledger, config), "quantize") == []


def _two_gpu_types(ledger: Ledger, ttft_seconds: float = 0.1) -> None:
    """chat-small on an L40S (100 requests, $1.60) and on an A100-80GB (300 requests, $2.40)."""
    slow = [r | {"first_token_at": r["received_at"] + ttft_seconds}
            for r in requests(300, "assistant", replica="small-1")]  # fmt: skip
    fill(ledger, usage=requests(100) + slow,
         gpu_samples=gpus("small-0") + gpus("small-1", gpu_model="A100-80GB", first=1))  # fmt: skip


def test_gpu_type_fires_for_a_type_measured_cheaper_per_token(ledger, config):
    """The L40S replica's 25,000 weighted tokens cost 6.4e-5 each; on the A100 3.2e-5: $0.80 an hour saved."""
    _two_gpu_types(ledger)
    [rec] = kinds(report(ledger, config), "gpu_type")
    assert rec.action == {"gpu_model": "A100-80GB"}
    assert rec.evidence["gpu_model_now"] == "L40S"
    assert rec.saving_usd_per_month == pytest.approx(25_000 * (1.60 / 25_000 - 2.40 / 75_000) * 730)


def test_gpu_type_does_not_fire_when_the_cheaper_type_misses_the_sla(ledger, config):
    """A GPU type whose requests missed the 0.5 s TTFT target is no place to move a model to."""
    _two_gpu_types(ledger, ttft_seconds=1.0)
    assert kinds(report(ledger, config), "gpu_type") == []


def _route_ledger(ledger: Ledger, short: int) -> None:
    """search sends 10 requests to chat-large, ``short`` of them short; assistant fills chat-small."""
    fill(ledger,
         usage=requests(short, replica="large-0", model="chat-large")
         + requests(10 - short, replica="large-0", model="chat-large", prompt=2000, completion=1000)
         + requests(100, "assistant"),
         gpu_samples=gpus("large-0", 2, "H100", "node-a") + gpus("small-0"))  # fmt: skip


def test_route_fires_on_short_requests_a_smaller_model_serves_cheaper(ledger, config):
    """6 of search's 10 chat-large requests are short: their weighted tokens priced at both models' measured rates."""
    _route_ledger(ledger, short=6)
    [rec] = kinds(report(ledger, config), "route")
    assert (rec.team, rec.model, rec.action["route_to"]) == ("search", "chat-large", "chat-small")
    assert rec.evidence["short_share"] == pytest.approx(0.6)
    # chat-large: $7.80 over 6 x 250 + 4 x 5,000 = 21,500 weighted tokens; chat-small: $1.60
    # over 100 x 250 = 25,000. The short requests weigh 6 x 250 = 1,500.
    assert rec.saving_usd_per_month == pytest.approx(1500 * (7.80 / 21_500 - 1.60 / 25_000) * 730)


def test_route_does_not_fire_when_requests_are_long(ledger, config):
    """A team whose requests are all long has nothing to send to the smaller model."""
    _route_ledger(ledger, short=0)
    assert kinds(report(ledger, config), "route") == []


def test_a_fleet_with_nothing_to_save_gets_no_recommendation(ledger, config):
    """One busy 8B replica on one GPU, nothing queued and nothing short sent to a larger model: no advice."""
    fill(ledger, usage=requests(50), gpu_samples=gpus("small-0"),
         engine_samples=engine("small-0", 100))  # fmt: skip
    found = report(ledger, config)
    assert found.recommendations == ()
    assert table(found.to_json()) == "2026-10: nothing to save from the use measured.\n"


def test_a_team_sees_its_own_figures_and_advice_only(ledger, config):
    """A team's view has its own hourly rows and the routes of its own requests, no groups or fleet-wide advice."""
    _route_ledger(ledger, short=6)
    search, assistant = report(ledger, config, "search"), report(ledger, config, "assistant")
    assert set(search.teams["team"]) == {"search"}
    assert search.groups.height == 0
    assert [r.kind for r in search.recommendations] == ["route"]
    assert assistant.recommendations == ()


@pytest.mark.parametrize(
    ("served", "params", "precision"),
    [("llama-3.1-70b-instruct-fp8", 70.0, "fp8"), ("llama-3.1-8b-instruct", 8.0, "bf16"),
     ("Llama-3.1-405B-AWQ", 405.0, "int4"), ("mistral-7b", None, None)],
)  # fmt: skip
def test_a_served_version_names_its_planner_shape(served, params, precision):
    """The size picks the planner's preset and the name's tag the precision; an unknown size has none."""
    shape = shape_of(served, 100, 1)
    found = (shape.params_billions, shape.precision) if shape else (None, None)
    assert found == (params, precision)


def test_the_saving_floor_is_a_policy():
    """The default policy offers nothing under a dollar a month."""
    assert Policy().min_saving_usd_per_month == 1.0


def test_advise_reads_a_ledger_file_and_prints_the_advice(config, tmp_path, capsys):
    """`infermeter advise --database` prints the month's recommendations as a table and as JSON."""
    path = str(tmp_path / "ledger.duckdb")
    ledger = open_ledger(config, path)
    fill(ledger, usage=requests(10) + requests(10, replica="small-1"),
         gpu_samples=gpus("small-0") + gpus("small-1", first=1),
         engine_samples=engine("small-0", 10) + engine("small-1", 10))  # fmt: skip
    ledger.close()
    assert main(["advise", "--month", "2026-10", "--database", path]) == 0
    text = capsys.readouterr().out
    assert "1,168.00 USD/month  chat-small: run 1 replica instead of 2  [right_size]" in text
    assert "evidence: replicas=2, gpu_model=L40S, peak_running=20" in text
    assert main(["advise", "--month", "2026-10", "--database", path, "--format", "json"]) == 0
    body = orjson.loads(capsys.readouterr().out)
    assert [r["saving_usd_per_month"] for r in body["recommendations"]] == [1168.0]


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
    fill(ledger, engine_samples=[s | {"instance": "small-0-a"} for s in first]
         + [s | {"instance": "small-0-b"} for s in second])  # fmt: skip
    rows = {r["instance"]: r for r in report(ledger, config).instances.iter_rows(named=True)}
    assert rows["small-0-a"]["batch_occupancy"] == pytest.approx(0.5)
    assert rows["small-0-a"]["preemptions"] == pytest.approx(59)
    assert rows["small-0-b"]["batch_occupancy"] == pytest.approx(0.25)
    assert rows["small-0-b"]["preemptions"] == pytest.approx(0)
