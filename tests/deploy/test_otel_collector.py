"""deploy/otel-collector/config.yaml: OTLP in, the services scraped where deploy/kubernetes puts
them, and every pipeline made of components the file defines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).parents[2] / "deploy"
CONFIG: dict[str, Any] = yaml.safe_load((DEPLOY / "otel-collector" / "config.yaml").read_text())


def _services() -> dict[str, dict[str, Any]]:
    """Every Service of deploy/kubernetes by name."""
    out = {}
    for path in (DEPLOY / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Service":
                out[doc["metadata"]["name"]] = doc
    return out


def test_otlp_is_received_over_both_protocols_on_the_standard_ports():
    """Push: OTLP over gRPC on 4317 and HTTP on 4318, as the services' exporters default to."""
    protocols = CONFIG["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def test_the_scrape_targets_are_the_services_of_the_kubernetes_manifests():
    """Scrape: the collector's and billing's Services at their ports, every sidecar through the
    vLLM Services' port named http, the token-guarded pages with the metrics token."""
    services = _services()
    jobs = {j["job_name"]: j for j in CONFIG["receivers"]["prometheus"]["config"]["scrape_configs"]}
    assert set(jobs) == {"infermeter-sidecars", "infermeter-collector", "infermeter-billing"}
    for job in ("infermeter-collector", "infermeter-billing"):
        (target,) = jobs[job]["static_configs"][0]["targets"]
        host, port = target.rsplit(":", 1)
        name, namespace, _ = host.split(".", 2)
        assert namespace == "infermeter"
        assert int(port) in {p["port"] for p in services[name]["spec"]["ports"]}
    keep = jobs["infermeter-sidecars"]["relabel_configs"][0]
    assert keep["action"] == "keep"
    component, port_name = keep["regex"].split(";")
    vllm = [
        s
        for s in services.values()
        if s["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert vllm
    assert all(port_name in {p["name"] for p in s["spec"]["ports"]} for s in vllm)
    for job in ("infermeter-sidecars", "infermeter-billing"):
        assert jobs[job]["authorization"]["credentials_file"] == "/etc/infermeter/metrics-token"


def test_every_pipeline_uses_defined_components_and_metrics_come_both_ways():
    """Each pipeline names receivers, processors and exporters the file defines."""
    pipelines = CONFIG["service"]["pipelines"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert pipeline[kind]
            assert set(pipeline[kind]) <= set(CONFIG[kind]), (kind, pipeline[kind])
    assert set(pipelines["metrics"]["receivers"]) == {"otlp", "prometheus"}
    assert pipelines["traces"]["receivers"] == ["otlp"]
