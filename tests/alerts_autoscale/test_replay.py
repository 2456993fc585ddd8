"""Replaying the policy over a simulated or recorded day, and the autoscale commands."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from alerts.autoscale.policy import model_limits, params_from_config
from alerts.autoscale.replay import (
    DemandPoint,
    ModelReport,
    engine_for,
    read_recording,
    replay_model,
    simulated_demand,
)
from infermeter.config import Config
from launcher.cli import main

DAY = 86400.0


def _replay(config: Config, model: str, days: int, predictive: bool = True) -> ModelReport:
    params = replace(params_from_config(config), predictive=predictive)
    engine = engine_for(config, model)
    peak = 8 * engine.tokens_per_second * params.target_gpu_utilization
    demand = simulated_demand(peak, days, DAY, 60.0, noise=0.1, seed=7)
    return replay_model(params, model_limits(config, model), engine, demand, (days - 1) * DAY, 60)


@pytest.mark.parametrize("model", ["chat-large", "chat-small"])
def test_simulated_day_uses_fewer_gpu_hours_than_a_peak_sized_fleet(
    config: Config, model: str
) -> None:
    """Over the measured day the policy's GPU-hours are well under the fixed fleet's."""
    report = _replay(config, model, days=2)
    gpus = engine_for(config, model).gpu_count
    assert report.fixed_gpu_hours == pytest.approx(report.fixed_replicas * gpus * 24)
    assert report.gpu_hours < 0.8 * report.fixed_gpu_hours
    assert report.minutes_over_sla >= 0
    assert report.events
    # The predictive term asks for the previous day's peak in a 15-minute slot, which the noise
    # can put one replica above the fleet sized for the measured day's peak.
    assert report.peak_replicas <= report.fixed_replicas + 1


def test_minutes_over_sla_are_counted_when_the_policy_reacts_late(config: Config) -> None:
    """Reacting only to queues and TTFT, the morning ramp outruns 3-minute start-ups."""
    reactive = _replay(config, "chat-large", days=1, predictive=False)
    assert reactive.minutes_over_sla > 0
    assert reactive.fixed_minutes_over_sla == 0


def test_yesterdays_history_cuts_minutes_over_sla(config: Config) -> None:
    """With a day of history, pre-scaling spends fewer minutes over the SLA than reacting."""
    reactive = _replay(config, "chat-large", days=2, predictive=False)
    predictive = _replay(config, "chat-large", days=2, predictive=True)
    assert predictive.minutes_over_sla < reactive.minutes_over_sla
    assert any("ahead" in r for e in predictive.events for r in e.reasons)


def _burst(config: Config, model: str, step: int | None) -> ModelReport:
    """Five hours at one replica's capacity, but for two at seven times it (reactive rules)."""
    scaling = config.scaling.model_copy(update={"max_scale_up_step": step})
    params = replace(params_from_config(config), scaling=scaling, predictive=False)
    engine = engine_for(config, model)
    rate = engine.tokens_per_second
    demand = [DemandPoint(60.0 * i, rate * (7.0 if 60 <= i < 180 else 1.0)) for i in range(300)]
    return replay_model(params, model_limits(config, model), engine, demand, 0.0, 60)


@pytest.mark.parametrize(
    ("step", "figures"),
    # (minutes over the SLA, peak replicas, GPU-hours); max_scale_up_step 1 is the rule as it was
    # (one replica a tick), the figures docs/autoscaling.md gives for the three.
    [(1, (44, 13, 71.3)), (4, (22, 13, 75.6)), (None, (18, 15, 87.8))],
)
def test_a_burst_is_caught_up_sooner_by_a_step_in_proportion_to_the_queue(
    config: Config, step: int | None, figures: tuple[int, int, float]
) -> None:
    """A queue of thousands asks for max(serving, 4) replicas a cool-down rather than one: under
    half the minutes over the SLA, for an overshoot the idle rule then walks back."""
    report = _burst(config, "chat-large", step)
    measured = (round(report.minutes_over_sla), report.peak_replicas, round(report.gpu_hours, 1))
    assert measured == figures
    assert report.fixed_minutes_over_sla == 0


def test_an_idle_day_stays_at_min_replicas(config: Config) -> None:
    """No demand: the policy holds min_replicas, the fixed fleet is min_replicas, no events."""
    demand = [DemandPoint(60.0 * i, 0.0) for i in range(1440)]
    params = params_from_config(config)
    limits = model_limits(config, "chat-small")
    report = replay_model(params, limits, engine_for(config, "chat-small"), demand, 0.0, 60)
    assert (report.fixed_replicas, report.peak_replicas, report.events) == (2, 2, [])
    assert report.gpu_hours == pytest.approx(report.fixed_gpu_hours)


def test_recordings_in_csv_and_jsonl_read_alike(tmp_path: Path) -> None:
    """Both formats give per-model demand from time 0; per-GPU rows are multiplied out."""
    csv_file = tmp_path / "day.csv"
    csv_file.write_text("time,model,tokens_per_second\n1000,chat-large,500\n1060,chat-large,700\n")
    jsonl = tmp_path / "day.jsonl"
    rows = [
        {"minute": 0, "model": "chat-large", "tokens_per_second_per_gpu": 125, "gpus": 4},
        {"minute": 1, "model": "chat-large", "tokens_per_second": 700},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    expected = {"chat-large": [DemandPoint(0.0, 500.0), DemandPoint(60.0, 700.0)]}
    assert read_recording(csv_file) == expected
    assert read_recording(jsonl) == expected


def test_a_bad_recording_names_the_row(tmp_path: Path) -> None:
    """A row without demand fails with its number."""
    bad = tmp_path / "bad.csv"
    bad.write_text("time,model\n0,chat-large\n")
    with pytest.raises(ValueError, match="row 1"):
        read_recording(bad)


def test_replay_command_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    """``infermeter autoscale replay`` prints GPU-hours, minutes over SLA and scale events."""
    assert main(["autoscale", "replay", "--model", "chat-small"]) == 0
    out = capsys.readouterr().out
    assert "GPU-h policy" in out
    assert "min over SLA" in out
    assert "scale events, chat-small:" in out


def test_replay_command_reads_a_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--input replays the recorded demand of the models it contains."""
    lines = ["time,model,tokens_per_second"]
    lines += [f"{60 * i},chat-large,{4000 if 600 <= i < 720 else 300}" for i in range(1440)]
    recording = tmp_path / "day.csv"
    recording.write_text("\n".join(lines) + "\n")
    assert main(["autoscale", "replay", "--input", str(recording), "--no-events"]) == 0
    out = capsys.readouterr().out
    assert "chat-large" in out
    assert "chat-small" not in out


def test_replay_of_an_unknown_model_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A model the configuration does not have ends with exit code 2 and its name."""
    assert main(["autoscale", "replay", "--model", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_run_without_the_webhook_secret_stops_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autoscale run`` with webhook_url but no secret exits 2 and names the variable."""
    from infermeter.config import DEFAULT_CONFIG
    from infermeter.serving import free_port

    config = tmp_path / "infermeter.yaml"
    config.write_text(
        DEFAULT_CONFIG.read_text() + "\nautoscale: {webhook_url: 'http://127.0.0.1:9/hook', "
        "webhook_secret_env: INFERMETER_TEST_UNSET_SECRET}\n"
    )
    argv = ["autoscale", "run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}"]
    assert main(argv) == 2
    assert "$INFERMETER_TEST_UNSET_SECRET is empty" in capsys.readouterr().err
