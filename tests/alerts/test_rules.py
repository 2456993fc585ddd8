"""Rule rendering: names, thresholds from the configuration, errors, and no drift on disk."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts.rules import (
    ALERTING_FILE,
    RECORDING_FILE,
    duration,
    prometheus_rule,
    render,
    to_yaml,
)
from infermeter.config import DEFAULT_CONFIG, Config, ConfigError, load_config
from tests.alerts.names import metric_names

ROOT = Path(__file__).parents[2]
RULES = ROOT / "alerts" / "rules"
MANIFEST = ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"
LEVEL_METRIC_OPERATIONS = re.compile(r"^[a-z_]+:[a-z_]+:[a-z0-9_]+$")


def _raw(**changes: Any) -> dict[str, Any]:
    """The embedded config file's data with ``changes`` (dotted paths, list items by index)."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for path, value in changes.items():
        node: Any = data
        *parents, last = path.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    return data


def _config(**changes: Any) -> Config:
    """The embedded config with ``changes`` applied, validated."""
    return Config.model_validate(_raw(**changes))


def _rules(groups: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [r for file in groups.values() for g in file for r in g["rules"]]


def _alerts(config: Config, name: str) -> list[dict[str, Any]]:
    return [r for r in _rules(render(config)) if r.get("alert") == name]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (300, "5m"),
        (30, "30s"),
        (3600, "1h"),
        (90, "1m30s"),
        (0.5, "500ms"),
        (1.25, "1s250ms"),
        (0, "0s"),
        (5400, "1h30m"),
    ],
)
def test_duration_is_written_the_prometheus_way(seconds, text):
    """Seconds become the shortest Prometheus duration that states them exactly."""
    assert duration(seconds) == text


def test_committed_rule_files_equal_a_fresh_render(config):
    """alerts/rules/ holds exactly what the embedded configuration renders to."""
    groups = render(config)
    assert sorted(p.name for p in RULES.iterdir()) == sorted(groups)
    for name, file_groups in groups.items():
        assert (RULES / name).read_text() == to_yaml({"groups": file_groups}), name


def test_committed_prometheusrule_is_the_deployed_configmaps_render(tmp_path):
    """deploy/kubernetes/prometheusrule.yaml is rendered from deploy's own ConfigMap, not the demo's."""
    from alerts.cli import configmap_config
    from tests.placeholders import filled_copy

    deployed = configmap_config(filled_copy(MANIFEST.with_name("configmap.yaml"), tmp_path))
    assert MANIFEST.read_text() == to_yaml(prometheus_rule(render(deployed)))


def test_prometheusrule_manifest_shape(config):
    """The manifest is a monitoring.coreos.com/v1 PrometheusRule carrying every group once."""
    groups = render(config)
    manifest = prometheus_rule(groups)
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"] == {
        "name": "infermeter-rules",
        "labels": {"app.kubernetes.io/part-of": "infermeter"},
    }
    names = [g["name"] for g in manifest["spec"]["groups"]]
    assert sorted(names) == sorted(g["name"] for file in groups.values() for g in file)
    assert len(set(names)) == len(names)


def test_recording_rules_follow_level_metric_operations(config):
    """Every recorded name has three colon-separated parts; no rule uses the quoted-name syntax."""
    groups = render(config)
    recorded = [r["record"] for r in _rules(groups) if "record" in r]
    assert recorded, "no recording rules"
    assert [n for n in recorded if not LEVEL_METRIC_OPERATIONS.match(n)] == []
    assert all("record" in r for g in groups[RECORDING_FILE] for r in g["rules"])
    assert all("alert" in r for g in groups[ALERTING_FILE] for r in g["rules"])
    assert [r["expr"] for r in _rules(groups) if '{"' in r["expr"]] == []


def test_recording_rules_cover_the_sidecar_collector_and_billing_metrics(config):
    """TTFT p50/p95, tokens/s, error ratio per model and team; queue, GPU use and power per replica."""
    recorded = {r["record"] for r in _rules(render(config)) if "record" in r}
    for level in ("model", "team_model"):
        assert f"{level}:infermeter_time_to_first_token_seconds:p50_rate5m" in recorded
        assert f"{level}:infermeter_time_to_first_token_seconds:p95_rate5m" in recorded
        assert f"{level}:infermeter_output_tokens_per_second:p50_rate5m" in recorded
        assert f"{level}:infermeter_completion_tokens:rate5m" in recorded
        assert f"{level}:infermeter_request_errors_per_request:ratio_rate5m" in recorded
    assert {
        "replica:infermeter_replica_queue_depth:sum",
        "instance_model_name:vllm_num_requests_waiting:sum",
        "replica:infermeter_replica_gpu_utilization_ratio:avg",
        "replica:infermeter_replica_gpu_power_watts:sum",
        "team:infermeter_team_spend_forecast_per_budget:ratio",
    } <= recorded


def test_every_alert_has_severity_summary_and_runbook(config):
    """Each alert carries a severity label and summary and runbook annotations."""
    alerts = [r for r in _rules(render(config)) if "alert" in r]
    assert len({a["alert"] for a in alerts}) == 18
    for a in alerts:
        assert a["labels"]["severity"] in {"critical", "warning", "info"}, a["alert"]
        assert a["annotations"]["summary"].strip(), a["alert"]
        assert len(a["annotations"]["runbook"]) > 40, a["alert"]


def test_sla_alerts_take_each_models_targets(config):
    """TTFT, error-ratio and speed alerts exist per model, with that model's SLA as threshold."""
    ttft = {a["labels"]["model"]: a["expr"] for a in _alerts(config, "InfermeterTTFTAboveSLA")}
    assert ttft == {
        "chat-large": 'model:infermeter_time_to_first_token_seconds:p95_rate5m{model="chat-large"} > 1.5',
        "chat-small": 'model:infermeter_time_to_first_token_seconds:p95_rate5m{model="chat-small"} > 0.5',
    }
    speed = {
        a["labels"]["model"]: a["expr"] for a in _alerts(config, "InfermeterOutputSpeedBelowSLA")
    }
    assert speed["chat-small"].endswith('{model="chat-small"} < 30')
    assert speed["chat-large"].endswith('{model="chat-large"} < 15')
    looser = _config(**{"models.1.sla.max_error_ratio": 0.05})
    errors = {a["labels"]["model"]: a["expr"] for a in _alerts(looser, "InfermeterErrorRatioHigh")}
    assert errors["chat-small"].endswith('{model="chat-small"} > 0.05')
    assert errors["chat-large"].endswith('{model="chat-large"} > 0.01')
    assert {a["labels"]["use_case"] for a in _alerts(config, "InfermeterTTFTAboveSLA")} == {
        "interactive"
    }


def test_a_model_without_a_speed_target_has_no_speed_alert():
    """min_output_tokens_per_second 0 means no target, so no alert for that model."""
    config = _config(**{"models.0.sla.min_output_tokens_per_second": 0})
    models = [a["labels"]["model"] for a in _alerts(config, "InfermeterOutputSpeedBelowSLA")]
    assert models == ["chat-small"]


def test_capacity_alerts_follow_the_scaling_policy():
    """Queue backlog and GPU idle use scaling's thresholds and durations."""
    config = _config(
        **{
            "scaling.scale_up_queue_depth": 4,
            "scaling.scale_up_after_seconds": 45,
            "scaling.scale_down_gpu_utilization": 0.2,
            "scaling.scale_down_after_seconds": 600,
        }
    )
    [queue] = _alerts(config, "InfermeterQueueBacklog")
    assert (queue["expr"], queue["for"]) == (
        "replica:infermeter_replica_queue_depth:sum > 4",
        "45s",
    )
    [idle] = _alerts(config, "InfermeterGPUIdle")
    assert (idle["expr"], idle["for"]) == (
        "replica:infermeter_replica_gpu_utilization_ratio:avg < 0.2",
        "10m",
    )


def test_default_capacity_alerts_are_the_seed_policy(config):
    """Over 10 waiting for 30 s; under 30 % busy for 5 min."""
    [queue] = _alerts(config, "InfermeterQueueBacklog")
    [idle] = _alerts(config, "InfermeterGPUIdle")
    assert (queue["expr"].split()[-2:], queue["for"]) == ([">", "10"], "30s")
    assert (idle["expr"].split()[-2:], idle["for"]) == (["<", "0.3"], "5m")


def test_efficiency_alerts_take_the_alerts_sections_thresholds():
    """KV-cache, preemption and batch-occupancy alerts use the configured thresholds and waits."""
    config = _config(
        **{
            "alerts.kv_cache_usage_ratio": 0.8,
            "alerts.preemptions_per_second": 1.5,
            "alerts.kv_cache_for_seconds": 120,
            "alerts.low_batch_occupancy_ratio": 0.1,
            "alerts.low_batch_occupancy_for_seconds": 7200,
        }
    )
    [kv] = _alerts(config, "InfermeterKVCachePressure")
    [storm] = _alerts(config, "InfermeterPreemptionStorm")
    [low] = _alerts(config, "InfermeterBatchOccupancyLow")
    assert (kv["expr"].split()[-2:], kv["for"]) == ([">", "0.8"], "2m")
    assert (storm["expr"].split()[-2:], storm["for"]) == ([">", "1.5"], "2m")
    assert (low["expr"].split()[-2:], low["for"]) == (["<", "0.1"], "2h")


def test_batch_occupancy_divides_by_each_replicas_max_num_seqs(config):
    """Each replica's running sequences are divided by its own max_num_seqs."""
    [rule] = [
        r
        for r in _rules(render(config))
        if r.get("record") == "instance:infermeter_instance_batch_occupancy:ratio"
    ]
    assert '{replica="large-0"}) / 64' in rule["expr"]
    assert '{replica="small-0"}) / 128' in rule["expr"]


def test_no_max_num_seqs_means_no_batch_occupancy_alert():
    """Without any replica's max_num_seqs there is nothing to divide by: no occupancy rule or alert."""
    config = _config(**{f"replicas.{i}.max_num_seqs": None for i in range(3)})
    assert _alerts(config, "InfermeterBatchOccupancyLow") == []
    assert all("batch_occupancy" not in r.get("record", "") for r in _rules(render(config)))


def test_gpu_cost_per_hour_is_each_replicas_gpus_at_its_price(config):
    """The cost rule multiplies each replica's GPU count by its GPU model's hourly price."""
    [rule] = [
        r
        for r in _rules(render(config))
        if r.get("record") == "replica:infermeter_gpu_cost_usd_per_hour:sum"
    ]
    assert '{replica="large-0"}) * 3.9' in rule["expr"]
    assert '{replica="small-1"}) * 1.6' in rule["expr"]


def test_windows_and_durations_come_from_the_alerts_section():
    """rate_window_seconds renames and resizes every window; sla_for_seconds sets the wait."""
    config = _config(
        **{
            "alerts.rate_window_seconds": 60,
            "alerts.sla_for_seconds": 0,
            "alerts.evaluation_interval_seconds": 10,
        }
    )
    groups = render(config)
    rules = _rules(groups)
    assert all("5m" not in r["expr"] for r in rules)
    assert "model:infermeter_time_to_first_token_seconds:p95_rate1m" in {
        r.get("record") for r in rules
    }
    assert all("for" not in a for a in _alerts(config, "InfermeterTTFTAboveSLA"))
    assert {g["interval"] for file in groups.values() for g in file} == {"10s"}


def test_team_override_inherits_the_keys_it_leaves_out():
    """A team override with only a TTFT target keeps the model's error and speed targets."""
    config = _config(
        **{"alerts.slas": [{"team": "search", "model": "chat-small", "ttft_p95_seconds": 0.3}]}
    )
    [ttft] = _alerts(config, "InfermeterTeamTTFTAboveSLA")
    assert ttft["expr"] == (
        "team_model:infermeter_time_to_first_token_seconds:p95_rate5m"
        '{team="search",model="chat-small"} > 0.3'
    )
    assert ttft["labels"] == {"severity": "warning", "team": "search", "model": "chat-small"}
    [errors] = _alerts(config, "InfermeterTeamErrorRatioHigh")
    assert errors["expr"].endswith("} > 0.01")
    [speed] = _alerts(config, "InfermeterTeamOutputSpeedBelowSLA")
    assert speed["expr"].endswith("} < 30")


def test_a_budget_cap_below_one_replica_is_an_error():
    """A monthly cap that cannot pay for one chat-large replica (2 x H100) names the numbers."""
    config = _config(**{"scaling.monthly_budget_cap_usd": 2000})
    with pytest.raises(ConfigError) as err:
        render(config, "fleet.yaml")
    assert str(err.value) == (
        "fleet.yaml: scaling.monthly_budget_cap_usd = 2000.0: below the monthly cost of one "
        "replica of 'chat-large' (2 x H100 at 3.90 USD/GPU-hour x 730 h = 5694.00 USD)"
    )


def test_a_budget_cap_that_pays_for_a_replica_of_each_model_renders():
    """A cap that pays for one replica of every model, each at its dearest replica, is accepted."""
    assert render(_config(**{"scaling.monthly_budget_cap_usd": 5694.0}))


def _write(tmp_path: Path, **changes: Any) -> Path:
    target = tmp_path / "fleet.yaml"
    target.write_text(yaml.safe_dump(_raw(**changes)))
    return target


def test_an_sla_override_naming_an_unknown_model_is_an_error(tmp_path):
    """alerts.slas naming a model (or team) the registry lacks fails when the file loads."""
    path = _write(
        tmp_path,
        **{
            "alerts.slas": [
                {"team": "search", "model": "chat-huge"},
                {"team": "nobody", "model": "chat-small"},
            ]
        },
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert "alerts.slas[0].model = 'chat-huge': no such model" in message
    assert "alerts.slas[1].team = 'nobody': no such team" in message


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "scaling.scale_up_queue_depth",
            -1,
            "scaling.scale_up_queue_depth = -1: Input should be greater than or equal to 0",
        ),
        (
            "scaling.scale_down_gpu_utilization",
            -0.1,
            "scaling.scale_down_gpu_utilization = -0.1: Input should be greater than or equal to 0",
        ),
        (
            "models.0.sla.ttft_p95_seconds",
            -0.5,
            "models[0].sla.ttft_p95_seconds = -0.5: Input should be greater than 0",
        ),
        (
            "models.0.sla.max_error_ratio",
            -0.01,
            "models[0].sla.max_error_ratio = -0.01: Input should be greater than or equal to 0",
        ),
        (
            "scaling.monthly_budget_cap_usd",
            -5,
            "scaling.monthly_budget_cap_usd = -5: Input should be greater than or equal to 0",
        ),
        (
            "alerts.spool_backlog_records",
            -5,
            "alerts.spool_backlog_records = -5: Input should be greater than or equal to 0",
        ),
    ],
)
def test_negative_thresholds_are_refused_by_the_schema(tmp_path, path, value, message):
    """A negative threshold is an error naming the file, the key and the value."""
    config_file = _write(tmp_path, **{path: value})
    with pytest.raises(ConfigError) as err:
        load_config(config_file, environ={})
    assert str(err.value) == f"{config_file}: {message}"


def test_sla_targets_are_recorded_as_series():
    """Each model's targets, and each team override's (unset keys inherited), are constant series."""
    config = _config(
        **{"alerts.slas": [{"team": "search", "model": "chat-small", "max_error_ratio": 0.002}]}
    )
    targets = {
        (r["record"], tuple(sorted(r["labels"].items()))): r["expr"]
        for r in _rules(render(config))
        if ":sla_" in r.get("record", "")
    }
    small = (("model", "chat-small"), ("use_case", "interactive"))
    team = (("model", "chat-small"), ("team", "search"))
    assert targets[("model:infermeter_time_to_first_token_seconds:sla_p95", small)] == "vector(0.5)"
    assert targets[("model:infermeter_output_tokens_per_second:sla_min_p50", small)] == "vector(30)"
    assert (
        targets[("team_model:infermeter_request_errors_per_request:sla_max_ratio", team)]
        == "vector(0.002)"
    )
    assert (
        targets[("team_model:infermeter_time_to_first_token_seconds:sla_p95", team)]
        == "vector(0.5)"
    )
    assert len(targets) == 3 * 2 + 3


def test_thresholds_keep_their_precision():
    """A target with many digits is written in full, a whole number without a decimal point."""
    config = _config(
        **{"models.1.sla.ttft_p95_seconds": 0.1234567, "scaling.scale_up_queue_depth": 12}
    )
    [_, small] = _alerts(config, "InfermeterTTFTAboveSLA")
    assert small["expr"].endswith("} > 0.1234567")
    [queue] = _alerts(config, "InfermeterQueueBacklog")
    assert queue["expr"].endswith(" > 12")


def test_a_budget_cap_adds_a_fleet_spend_alert(config):
    """With monthly_budget_cap_usd set the fleet's forecast is held to it; without, no alert."""
    assert _alerts(config, "InfermeterFleetSpendForecastAboveCap") == []
    capped = _config(**{"scaling.monthly_budget_cap_usd": 60000})
    [alert] = _alerts(capped, "InfermeterFleetSpendForecastAboveCap")
    assert alert["expr"] == "sum(max by (team) (infermeter_team_spend_forecast_usd)) > 60000"


def test_the_unattributed_share_alert_takes_the_configured_share(config):
    """The reconciliation alert holds each group's share to billing.reconciliation_alert_share."""
    [default] = _alerts(config, "InfermeterTokensUnattributed")
    assert default["expr"].endswith("(infermeter_reconciliation_unattributed_share) > 0.02")
    assert default["for"] == "15m"
    [strict] = _alerts(
        _config(**{"billing.reconciliation_alert_share": 0.005}), "InfermeterTokensUnattributed"
    )
    assert strict["expr"].endswith(" > 0.005")


# What each part exports for an operator to act on, and the alert that acts on it: a signal with
# no alert is one nobody sees until the month is closed on it.
ALERTED_SIGNALS = {
    "infermeter_usage_spool_backlog": "InfermeterUsageSpoolBacklog",
    "infermeter_shared_limits_up": "InfermeterSharedLimitsDown",
    "infermeter_collector_target_up": "InfermeterCollectorTargetDown",
    "infermeter_gpu_xid_errors": "InfermeterGPUXidError",
    "infermeter_reconciliation_unattributed_share": "InfermeterTokensUnattributed",
    "infermeter_billing_quarantined_records_total": "InfermeterRecordsQuarantined",
    # docs/billing.md: lines that could not be priced, "alert when it is above zero"
    "infermeter_billing_statement_error_lines": "InfermeterStatementErrorLines",
    # the autoscaler's decisions reaching no one, and the pages it decides without
    "infermeter_autoscale_hook_failures": "InfermeterAutoscaleHookFailing",
    "infermeter_autoscale_unread_pages": "InfermeterAutoscalePagesUnread",
}


@pytest.mark.parametrize(("signal", "alert"), sorted(ALERTED_SIGNALS.items()))
def test_every_signal_for_an_operator_has_an_alert_reading_it(config, signal, alert):
    """Each health and correctness signal the parts export is read by its alert."""
    [rule] = _alerts(config, alert)
    assert signal in metric_names(rule["expr"])
