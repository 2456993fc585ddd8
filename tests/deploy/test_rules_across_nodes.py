"""The deployed rules over a replica group whose pods run on several nodes.

The collector is a DaemonSet: each node's collector reports the part of a group it sees (the
GPUs and engine queues of the group's pods on its node), so a group spread over two nodes is two
series of each ``infermeter_replica_*`` gauge, one per collector. Every rule over those series
must give the group's figure, the one a single collector seeing the whole group would report;
promtool evaluates the committed PrometheusRule over such a split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.alerts.names import metric_names
from tests.alerts.prometheus import promtool

ROOT = Path(__file__).parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"
GROUP = "chat-small"  # on L40S at 1.60 USD per GPU-hour (configmap.yaml)

# The group's pods on two nodes: each part as its node's collector reports it.
PARTS = {
    "gpu-node-2": {
        "infermeter_replica_gpus": 1,
        "infermeter_replica_gpu_utilization_ratio": 0.75,
        "infermeter_replica_gpu_power_watts": 200,
        "infermeter_replica_queue_depth": 7,
    },
    "gpu-node-3": {
        "infermeter_replica_gpus": 3,
        "infermeter_replica_gpu_utilization_ratio": 0.25,
        "infermeter_replica_gpu_power_watts": 300,
        "infermeter_replica_queue_depth": 5,
    },
}
# What each rule over them must say of the group as a whole: 4 GPUs, 37.5 % busy (0.75 on one,
# 0.25 on three), 500 W, 12 requests waiting (over the scale-up depth of 10, neither part is).
WHOLE = {
    "replica:infermeter_replica_queue_depth:sum": 12,
    "model:infermeter_replica_queue_depth:sum": 12,
    "replica:infermeter_replica_gpu_utilization_ratio:avg": 0.375,
    "replica:infermeter_replica_gpu_power_watts:sum": 500,
    "model:infermeter_replica_gpu_power_watts:sum": 500,
    "replica:infermeter_gpu_cost_usd_per_hour:sum": 6.4,
    "model:infermeter_gpu_cost_usd_per_hour:sum": 6.4,
}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(MANIFEST.read_text())
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def _series() -> list[dict[str, str]]:
    out = []
    for i, values in enumerate(PARTS.values()):
        target = (
            f'namespace="infermeter",pod="infermeter-collector-{i}",'
            f'instance="10.0.{i}.1:9500",job="infermeter-collector"'
        )
        for name, value in values.items():
            labels = f'replica="{GROUP}",model="{GROUP}",{target}'
            out.append({"series": f"{name}{{{labels}}}", "values": f"{value}x20"})
    return out


def test_every_rule_over_the_collectors_group_series_is_told_its_whole_group_value():
    """Each recording rule reading an ``infermeter_replica_*`` series has its group figure here."""
    reading = {
        r["record"]
        for r in _rules()
        if "record" in r
        and any(n.startswith("infermeter_replica_") for n in metric_names(r["expr"]))
    }
    assert reading <= set(WHOLE), "rules over the collectors' group series not checked here"


def test_a_group_on_two_nodes_is_summed_over_their_collectors(tmp_path: Path) -> None:
    """A group split over two nodes' collectors is recorded, and alerted on, as one group."""
    doc = yaml.safe_load(MANIFEST.read_text())
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    backlog = next(r for r in _rules() if r.get("alert") == "InfermeterQueueBacklog")

    def labels(name: str) -> str:
        level = name.split(":", 1)[0]
        return (
            f'{name}{{replica="{GROUP}",model="{GROUP}"}}'
            if level == "replica"
            else f'{name}{{model="{GROUP}"}}'
        )

    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "30s",
        "tests": [
            {
                "interval": "30s",
                "input_series": _series(),
                "promql_expr_test": [
                    {
                        "expr": f'{name}{{model="{GROUP}"}}',
                        "eval_time": "5m",
                        "exp_samples": [{"labels": labels(name), "value": value}],
                    }
                    for name, value in WHOLE.items()
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "5m",
                        "alertname": "InfermeterQueueBacklog",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "replica": GROUP,
                                    "model": GROUP,
                                },
                                "exp_annotations": {
                                    "summary": f"12 requests wait in the engines of replica group {GROUP} ({GROUP}), over 10 for 30s",
                                    "runbook": backlog["annotations"]["runbook"],
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "split.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", "split.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
