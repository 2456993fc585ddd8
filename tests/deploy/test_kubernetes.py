"""The Kubernetes deployment: valid objects, a complete kustomization, and parts that connect."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from infermeter.config import Config, load_config
from tests.placeholders import filled

ROOT = Path(__file__).parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "deploy" / "schemas"
KUBERNETES_VERSION = "1.33.0"  # the oldest minor release the manifests promise to work on
CUSTOM = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_v1_prometheusrule.json",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")

Doc = dict[str, Any]


def _kustomization() -> Doc:
    data: Doc = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    return data


def _documents() -> list[tuple[str, Doc]]:
    """Every object the kustomization's resources hold, with the file it came from."""
    docs = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((KUSTOMIZE / name).read_text()):
            if doc:
                docs.append((name, doc))
    return docs


DOCS = _documents()


def _id(item: tuple[str, Doc]) -> str:
    return f"{item[1]['kind']}/{item[1]['metadata']['name']}"


def _of(kind: str) -> list[Doc]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _containers(workload: Doc) -> list[Doc]:
    containers: list[Doc] = workload["spec"]["template"]["spec"]["containers"]
    return containers


def _configs(tmp_path: Path) -> Iterator[tuple[str, Config]]:
    """Each ConfigMap's infermeter.yaml, its key placeholders filled as an operator would."""
    for cm in _of("ConfigMap"):
        text = cm.get("data", {}).get("infermeter.yaml")
        if text is not None:
            path = tmp_path / f"{cm['metadata']['name']}.yaml"
            path.write_text(filled(text))
            yield cm["metadata"]["name"], load_config(path, environ={})


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _arg(container: Doc, flag: str) -> str | None:
    for arg in container.get("args", []):
        if arg.startswith(f"{flag}="):
            return str(arg.split("=", 1)[1])
    return None


def test_resources_list_exactly_the_files_present():
    """kustomization.yaml names every manifest in the folder, and only those."""
    present = {p.name for p in KUSTOMIZE.glob("*.yaml")} - {"kustomization.yaml"}
    resources = _kustomization()["resources"]
    assert sorted(resources) == sorted(present)
    assert len(resources) == len(set(resources))


@pytest.mark.parametrize(
    "item", [i for i in DOCS if (i[1]["apiVersion"], i[1]["kind"]) not in CUSTOM], ids=_id
)
def test_core_objects_are_valid_in_strict_mode(item: tuple[str, Doc]) -> None:
    """Each built-in object passes kubernetes-validate's strict schema (no unknown fields)."""
    kubernetes_validate.validate(item[1], KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    "item", [i for i in DOCS if (i[1]["apiVersion"], i[1]["kind"]) in CUSTOM], ids=_id
)
def test_custom_resources_match_their_crd_schemas(item: tuple[str, Doc]) -> None:
    """ScaledObjects, ServiceMonitors and the PrometheusRule match the schemas in deploy/schemas."""
    doc = item[1]
    schema = json.loads((SCHEMAS / CUSTOM[(doc["apiVersion"], doc["kind"])]).read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)


def test_every_custom_kind_has_a_schema():
    """No object escapes validation: anything not built in has a schema in the repository."""
    core_groups = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"}
    for _, doc in DOCS:
        if doc["apiVersion"] not in core_groups:
            assert (doc["apiVersion"], doc["kind"]) in CUSTOM, doc["kind"]
    assert _of("ScaledObject")
    assert _of("ServiceMonitor")


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("ScaledObject", ["spec", "minReplicas"], 2),
        ("ScaledObject", ["spec", "triggers", 0, "metdata"], {}),
        ("ServiceMonitor", ["spec", "endpoints", 0, "honourLabels"], True),
        ("ServiceMonitor", ["spec", "endpoints", 0, "interval"], 15),
    ],
)
def test_the_schemas_reject_typos_and_wrong_types(kind: str, path: list[Any], value: Any) -> None:
    """A misspelt field or a wrong type fails, so a passing manifest means something."""
    doc = json.loads(json.dumps(_of(kind)[0]))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    schema = json.loads((SCHEMAS / CUSTOM[(doc["apiVersion"], doc["kind"])]).read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(doc)


def test_every_configmapped_infermeter_yaml_loads(tmp_path: Path) -> None:
    """The infermeter.yaml in each ConfigMap, its placeholders filled, passes the validation every process runs."""
    loaded = list(_configs(tmp_path))
    assert [name for name, _ in loaded] == ["infermeter-config"]


def test_no_secret_values_are_committed():
    """Secrets are referenced by name only; none is part of the manifests."""
    assert _of("Secret") == []
    refs = {
        ref["secretKeyRef"]["name"]
        for w in _of("Deployment") + _of("StatefulSet") + _of("DaemonSet")
        for c in _containers(w)
        for ref in (e.get("valueFrom", {}) for e in c.get("env", []))
        if "secretKeyRef" in ref
    }
    assert refs == {"infermeter-secrets"}


def _selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_target_named_container_ports():
    """Each Service selects a workload, and every targetPort is one of its containers' ports."""
    workloads = [w for kind in WORKLOADS for w in _of(kind)]
    for svc in _of("Service"):
        pods = [w for w in workloads
                if _selected(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]  # fmt: skip
        assert pods, f"Service {svc['metadata']['name']} selects no workload"
        for pod in pods:
            ports = [p for c in _containers(pod) for p in c.get("ports", [])]
            for sp in svc["spec"]["ports"]:
                target = sp["targetPort"]
                assert target in {p["name"] for p in ports} | {p["containerPort"] for p in ports}


def test_service_monitors_select_services_by_port_name():
    """Each ServiceMonitor in the namespace matches a Service with every endpoint port named."""
    services = _of("Service")
    for sm in _of("ServiceMonitor"):
        if "namespaceSelector" in sm["spec"]:
            continue  # dcgm-exporter, installed by the GPU operator
        matched = [s for s in services
                   if _selected(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]  # fmt: skip
        assert matched, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
        for svc in matched:
            names = {p["name"] for p in svc["spec"]["ports"]}
            for endpoint in sm["spec"]["endpoints"]:
                assert endpoint["port"] in names, (sm["metadata"]["name"], svc["metadata"]["name"])


def test_dcgm_exporter_labels_survive_the_scrape():
    """dcgm-exporter's pod labels are kept (honorLabels): they join GPUs to vLLM pods."""
    (dcgm,) = [sm for sm in _of("ServiceMonitor") if "dcgm" in sm["metadata"]["name"]]
    assert all(e["honorLabels"] is True for e in dcgm["spec"]["endpoints"])


def test_listen_addresses_match_container_ports(tmp_path: Path) -> None:
    """--listen in each container, the config's listen keys and containerPorts agree."""
    ((_, config),) = list(_configs(tmp_path))
    expected = {
        "collect": _port(config.collector.listen),
        "billing": _port(config.billing.listen),
        "dashboard": _port(config.dashboard.listen),
        "autoscale": _port(config.autoscale.listen),
        "sidecar": _port(config.replicas[0].sidecar_listen or ""),
    }
    seen = set()
    for w in [w for kind in WORKLOADS for w in _of(kind)]:
        for c in _containers(w):
            listen = _arg(c, "--listen")
            if listen is None:
                continue
            command = c["args"][0]
            seen.add(command)
            assert _port(listen) == expected[command], (w["metadata"]["name"], command)
            assert _port(listen) in {p["containerPort"] for p in c["ports"]}
    assert seen == set(expected)


def test_vllm_pods_hold_gpus_and_their_sidecar_points_at_them(tmp_path: Path) -> None:
    """Each vLLM Deployment asks for its replica's GPUs; the sidecar's upstream is vLLM's port."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        (deployment,) = [
            d for d in _of("Deployment") if d["metadata"]["name"] == f"vllm-{replica.id}"
        ]
        vllm, sidecar = _containers(deployment)
        gpus = vllm["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) == replica.gpu_count
        assert vllm["image"].startswith("vllm/vllm-openai:")
        assert _arg(vllm, "--tensor-parallel-size") == str(replica.gpu_count)
        assert _arg(vllm, "--served-model-name") == replica.served_version
        assert _arg(sidecar, "--replica") == replica.id
        upstream = _arg(sidecar, "--upstream") or ""
        assert re.fullmatch(r"http://(127\.0\.0\.1|localhost):\d+", upstream)
        assert _port(upstream) == int(_arg(vllm, "--port") or 0)
        assert sidecar["image"] == "ghcr.io/infermeter/infermeter:0.1.0"


def test_keda_scales_each_deployment_on_its_desired_replicas(tmp_path: Path) -> None:
    """Every ScaledObject targets a vLLM Deployment with the gauge of that Deployment's model."""
    ((_, config),) = list(_configs(tmp_path))
    deployments = {d["metadata"]["name"] for d in _of("Deployment")}
    by_deployment = {v: k for k, v in config.autoscale.kubernetes.deployments.items()}
    scaled = _of("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(by_deployment)
    for so in scaled:
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        model = by_deployment[target]
        assert (
            trigger["metadata"]["query"] == f'max(infermeter_desired_replicas{{model="{model}"}})'
        )
        assert so["spec"]["minReplicaCount"] == config.scaling.min_replicas
        assert so["spec"]["maxReplicaCount"] == config.scaling.max_replicas


def test_autoscaler_may_only_get_and_patch_the_scale_of_its_deployments(tmp_path: Path) -> None:
    """The Role grants get/patch on deployments/scale of the configured Deployments, bound to the pod's account."""
    ((_, config),) = list(_configs(tmp_path))
    (role,) = [r for r in _of("Role") if r["metadata"]["name"] == "infermeter-autoscaler"]
    (rule,) = role["rules"]
    assert (rule["apiGroups"], rule["resources"], sorted(rule["verbs"])) == (
        ["apps"], ["deployments/scale"], ["get", "patch"])  # fmt: skip
    assert set(rule["resourceNames"]) == set(config.autoscale.kubernetes.deployments.values())
    (binding,) = [b for b in _of("RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]
    (account,) = [
        a for a in _of("ServiceAccount") if a["metadata"]["name"] == "infermeter-autoscaler"
    ]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    assert binding["subjects"][0]["namespace"] == _kustomization()["namespace"]
    assert config.autoscale.kubernetes.namespace == _kustomization()["namespace"]
    (scaler,) = [d for d in _of("Deployment") if d["metadata"]["name"] == "infermeter-autoscaler"]
    assert scaler["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_billing_is_a_single_writer_with_its_own_volume(tmp_path: Path) -> None:
    """One billing replica, its ledger on a claimed volume where billing.database points."""
    ((_, config),) = list(_configs(tmp_path))
    (billing,) = _of("StatefulSet")
    assert billing["spec"]["replicas"] == 1
    (claim,) = billing["spec"]["volumeClaimTemplates"]
    (container,) = _containers(billing)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert config.billing.database.startswith(mounts[claim["metadata"]["name"]] + "/")
    service_name = billing["spec"]["serviceName"]
    assert service_name in {s["metadata"]["name"] for s in _of("Service")}
    assert f"//{service_name}:" in config.billing.url


def test_every_secret_key_is_documented():
    """Each key read from infermeter-secrets is explained in docs/deploy.md."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    keys = {
        ref["secretKeyRef"]["key"]
        for w in _of("Deployment") + _of("StatefulSet") + _of("DaemonSet")
        for c in _containers(w)
        for ref in (e.get("valueFrom", {}) for e in c.get("env", []))
        if "secretKeyRef" in ref
    }
    keys |= {
        e["authorization"]["credentials"]["key"]
        for sm in _of("ServiceMonitor")
        for e in sm["spec"]["endpoints"]
        if "authorization" in e
    }
    assert keys
    for key in keys:
        assert f"| `{key}` |" in docs, key


def _env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def _field(env: Doc) -> str:
    path: str = env["valueFrom"]["fieldRef"]["fieldPath"]
    return path


def test_each_vllm_pod_knows_itself_and_spools_on_the_node(tmp_path: Path) -> None:
    """The sidecar gets its identity from the downward API and its spool is the node's directory at sidecar.spool_dir."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        (deployment,) = [d for d in _of("Deployment") if d["metadata"]["name"] == f"vllm-{replica.id}"]  # fmt: skip
        pod = deployment["spec"]["template"]
        assert pod["metadata"]["labels"]["infermeter.io/replica"] == replica.id
        _, sidecar = _containers(deployment)
        env = _env(sidecar)
        assert {k: _field(env[k]) for k in ("POD_NAME", "POD_UID", "POD_NAMESPACE", "NODE_NAME", "POD_IP")} == {
            "POD_NAME": "metadata.name", "POD_UID": "metadata.uid",
            "POD_NAMESPACE": "metadata.namespace", "NODE_NAME": "spec.nodeName",
            "POD_IP": "status.podIP",
        }  # fmt: skip
        (mount,) = [
            m for m in sidecar["volumeMounts"] if m["mountPath"] == config.sidecar.spool_dir
        ]
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["hostPath"] == {
            "path": "/var/lib/infermeter/spool",
            "type": "DirectoryOrCreate",
        }


def test_a_stopping_vllm_pod_has_time_for_its_longest_stream(tmp_path: Path) -> None:
    """The grace period outlasts the longest stream (sidecar.read_timeout_seconds) plus shipping; each container has a preStop."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        (deployment,) = [d for d in _of("Deployment") if d["metadata"]["name"] == f"vllm-{replica.id}"]  # fmt: skip
        spec = deployment["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= config.sidecar.read_timeout_seconds + 60
        vllm, sidecar = _containers(deployment)
        assert "sleep" in sidecar["lifecycle"]["preStop"]
        # vLLM is held back until its in-flight requests are done, no longer than the drain.
        script = vllm["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "vllm:num_requests_" in script
        assert f"+ {config.sidecar.read_timeout_seconds:g}" in script


def test_the_collector_runs_on_every_gpu_node_and_watches_its_pods(tmp_path: Path) -> None:
    """A DaemonSet on GPU nodes, knowing its node, reading its node's dcgm-exporter, allowed to list and watch pods."""
    ((_, config),) = list(_configs(tmp_path))
    (daemonset,) = [d for d in _of("DaemonSet") if d["metadata"]["name"] == "infermeter-collector"]
    assert not [d for d in _of("Deployment") if d["metadata"]["name"] == "infermeter-collector"]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    (container,) = _containers(daemonset)
    env = _env(container)
    assert _field(env[config.collector.node_name_env]) == "spec.nodeName"
    assert (
        env["INFERMETER__COLLECTOR__DCGM_EXPORTER_URL"]["value"] == "http://$(HOST_IP):9400/metrics"
    )
    assert _field(env["HOST_IP"]) == "status.hostIP"
    assert list(env).index("HOST_IP") < list(env).index("INFERMETER__COLLECTOR__DCGM_EXPORTER_URL")
    k8s = config.collector.kubernetes
    assert (config.collector.discovery, k8s.namespace) == (
        "kubernetes",
        _kustomization()["namespace"],
    )
    (binding,) = [b for b in _of("RoleBinding") if b["roleRef"]["name"] == "infermeter-collector"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"],
                                    "namespace": k8s.namespace}]  # fmt: skip
    (role,) = [r for r in _of("Role") if r["metadata"]["name"] == "infermeter-collector"]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"])
    (spools,) = [m for m in container["volumeMounts"] if m["mountPath"] == config.sidecar.spool_dir]
    # It adopts the spools of pods that are gone: it must be able to delete what it shipped.
    assert not spools.get("readOnly", False)
    assert config.collector.adopt_spools_dir == config.sidecar.spool_dir


def test_the_collector_may_reach_the_sidecars_and_billing(tmp_path: Path) -> None:
    """The collector's egress policy opens the vLLM pods' sidecar port and billing's port."""
    ((_, config),) = list(_configs(tmp_path))
    (policy,) = [p for p in _of("NetworkPolicy") if p["metadata"]["name"] == "infermeter-collector"]
    assert "Egress" in policy["spec"]["policyTypes"]
    opened = {(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"], port["port"])
              for rule in policy["spec"]["egress"] for peer in rule.get("to", []) if "podSelector" in peer
              for port in rule["ports"]}  # fmt: skip
    assert ("vllm", config.collector.kubernetes.sidecar_port) in opened
    assert ("billing", _port(config.billing.listen)) in opened


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_build_renders_the_same_objects_in_the_namespace():
    """Where kubectl is available, ``kubectl kustomize`` renders exactly these objects, namespaced."""
    built = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    assert sorted(_id(("", d)) for d in docs) == sorted(_id(i) for i in DOCS)
    namespace = _kustomization()["namespace"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, _id(("", doc))
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "infermeter"


def test_the_autoscalers_demand_history_is_on_a_volume_that_outlives_the_pod(
    tmp_path: Path,
) -> None:
    """autoscale.history_file lies on a mounted, writable persistent volume (the root is read-only)."""
    ((_, config),) = list(_configs(tmp_path))
    (deployment,) = [
        d for d in _of("Deployment") if d["metadata"]["name"] == "infermeter-autoscaler"
    ]
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    history = Path(config.autoscale.history_file)
    (mount,) = [m for m in container["volumeMounts"] if history.is_relative_to(m["mountPath"])]
    assert not mount.get("readOnly", False)
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert [c for c in _of("PersistentVolumeClaim") if c["metadata"]["name"] == claim]
