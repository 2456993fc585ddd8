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


def _workloads() -> list[dict[str, Any]]:
    """Every Deployment, StatefulSet and DaemonSet of deploy/kubernetes."""
    kinds = {"Deployment", "StatefulSet", "DaemonSet"}
    return [
        doc
        for path in (DEPLOY / "kubernetes").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") in kinds
    ]


def _jobs() -> dict[str, dict[str, Any]]:
    return {j["job_name"]: j for j in CONFIG["receivers"]["prometheus"]["config"]["scrape_configs"]}


def _kept_services(job: dict[str, Any], services: dict[str, dict[str, Any]]) -> list[str]:
    """The Services whose endpoints an endpoints-discovered job keeps, by component and port."""
    assert job["kubernetes_sd_configs"] == [
        {"role": "endpoints", "namespaces": {"names": ["infermeter"]}}
    ]
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep"
    assert keep["source_labels"] == [
        "__meta_kubernetes_service_label_app_kubernetes_io_component",
        "__meta_kubernetes_endpoint_port_name",
    ]
    component, port_name = keep["regex"].split(";")
    kept = [
        name
        for name, s in services.items()
        if s["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert kept, job["job_name"]
    for name in kept:
        assert port_name in {p["name"] for p in services[name]["spec"]["ports"]}, name
    return kept


def test_the_scrape_targets_are_the_services_of_the_kubernetes_manifests():
    """Scrape: every sidecar through the vLLM Services' endpoints (port http), every collector
    through the collector Service's (port metrics), billing at its Service's port, the
    token-guarded pages with the metrics token."""
    services = _services()
    jobs = _jobs()
    assert set(jobs) == {"infermeter-sidecars", "infermeter-collector", "infermeter-billing"}
    (target,) = jobs["infermeter-billing"]["static_configs"][0]["targets"]
    host, port = target.rsplit(":", 1)
    name, namespace, _ = host.split(".", 2)
    assert namespace == "infermeter"
    assert int(port) in {p["port"] for p in services[name]["spec"]["ports"]}
    assert jobs["infermeter-sidecars"]["relabel_configs"][0]["regex"].startswith("vllm;")
    assert _kept_services(jobs["infermeter-sidecars"], services)
    assert _kept_services(jobs["infermeter-collector"], services) == ["infermeter-collector"]
    for job in jobs.values():
        assert job["authorization"]["credentials_file"] == "/etc/infermeter/metrics-token"


def test_a_service_of_several_pods_is_scraped_pod_by_pod():
    """A Service in front of more than one pod (a DaemonSet such as the collector, one per GPU
    node, or more than one replica) is scraped through its endpoints: its own address reaches
    one pod per connection, so one node's GPUs would stand for the fleet's."""
    services = _services()
    several = set()
    for workload in _workloads():
        spec = workload["spec"]
        if workload["kind"] != "DaemonSet" and spec.get("replicas", 1) <= 1:
            continue
        labels = spec["template"]["metadata"]["labels"]
        several |= {
            name
            for name, s in services.items()
            if s["spec"].get("selector")
            and all(labels.get(k) == v for k, v in s["spec"]["selector"].items())
        }
    assert "infermeter-collector" in several
    for job in _jobs().values():
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert target.split(".", 1)[0] not in several, (job["job_name"], target)


def test_every_pipeline_uses_defined_components_and_metrics_come_both_ways():
    """Each pipeline names receivers, processors and exporters the file defines."""
    pipelines = CONFIG["service"]["pipelines"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert pipeline[kind]
            assert set(pipeline[kind]) <= set(CONFIG[kind]), (kind, pipeline[kind])
    assert set(pipelines["metrics"]["receivers"]) == {"otlp", "prometheus"}
    assert pipelines["traces"]["receivers"] == ["otlp"]
