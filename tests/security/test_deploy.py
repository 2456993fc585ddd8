"""The Kubernetes manifests leave no way around metering and run every pod locked down.

Adversaries: any pod in the cluster (it must not reach vLLM, which serves some routes without its
API key) and anything that gets code into one of our containers (it must find no privileges, no
API token and no writable root filesystem).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from billing.cli_common import ADMIN_TOKEN_ENV
from infermeter.config import Config, load_config
from tests.placeholders import filled

KUSTOMIZE = Path(__file__).parents[2] / "deploy" / "kubernetes"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
VLLM_IMAGE = "vllm/vllm-openai:"
# The one thing "restricted" does not admit: the spools on the node (docs/deploy.md): the
# sidecars' root (each vLLM pod mounts its own directory of it) and the collector's own.
SPOOL_ROOT = "/var/lib/infermeter/spool"
COLLECTOR_SPOOL = "/var/lib/infermeter/collector"
SPOOL_INIT = "spool-dir"
TOKEN_HOLDERS = {"infermeter-autoscaler": "scale patches", "infermeter-collector": "the pod watch"}

Doc = dict[str, Any]


def _documents() -> list[Doc]:
    names = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())["resources"]
    return [d for name in names for d in yaml.safe_load_all((KUSTOMIZE / name).read_text()) if d]


DOCS = _documents()


def _of(kind: str) -> list[Doc]:
    return [d for d in DOCS if d["kind"] == kind]


def _workloads() -> list[Doc]:
    return [w for kind in WORKLOADS for w in _of(kind)]


def _pod(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def _labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _arg(container: Doc, flag: str) -> str | None:
    values = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(f"{flag}=")]
    return values[-1] if values else None


def _vllm_pods() -> list[tuple[Doc, Doc]]:
    """(workload, vLLM container) of every workload that runs vLLM."""
    pods = [
        (w, c)
        for w in _workloads()
        for c in _pod(w)["containers"]
        if c["image"].startswith(VLLM_IMAGE)
    ]
    assert pods, "no vLLM workload found"
    return pods


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _label_selector(selector: str) -> dict[str, str | None]:
    """``key=value`` terms, and ``key`` alone (the label present, any value) as None."""
    terms = [term.split("=", 1) for term in selector.split(",")]
    return {t[0]: (t[1] if len(t) == 2 else None) for t in terms}


def _selects_terms(selector: dict[str, str | None], labels: dict[str, str]) -> bool:
    return all(k in labels and (v is None or labels[k] == v) for k, v in selector.items())


def _name(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# -- item 1: no way around the sidecar ------------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "vllm"), [pytest.param(w, c, id=w["metadata"]["name"]) for w, c in _vllm_pods()]
)
def test_vllm_listens_on_loopback_only(workload: Doc, vllm: Doc) -> None:
    """vLLM's --host is 127.0.0.1, so only its own pod (the sidecar) can connect to it."""
    assert _arg(vllm, "--host") == "127.0.0.1", workload["metadata"]["name"]
    assert "--host" not in vllm.get("args", [])
    assert not vllm.get("command")


def test_no_service_targets_the_vllm_port() -> None:
    """No Service exposes vLLM's port, by number or by name: only the sidecar's port is served."""
    for workload, vllm in _vllm_pods():
        port = int(_arg(vllm, "--port") or 8000)
        names = {p["name"] for p in vllm.get("ports", []) if "name" in p}
        sidecar_ports = {
            p["name"]
            for c in _pod(workload)["containers"]
            if c is not vllm
            for p in c.get("ports", [])
        }
        services = [s for s in _of("Service") if _selects(s["spec"]["selector"], _labels(workload))]
        assert services, workload["metadata"]["name"]
        for svc in services:
            for sp in svc["spec"]["ports"]:
                target = sp.get("targetPort", sp["port"])
                assert target not in names | {port}, (_name(svc), sp)
                assert target in sidecar_ports, (_name(svc), sp)


def test_a_network_policy_selects_every_vllm_pod() -> None:
    """Each vLLM pod is under an ingress NetworkPolicy that opens the sidecar's port only."""
    policies = [p for p in _of("NetworkPolicy") if "Ingress" in p["spec"].get("policyTypes", [])]
    for workload, vllm in _vllm_pods():
        mine = [
            p
            for p in policies
            if _selects(p["spec"]["podSelector"].get("matchLabels", {}), _labels(workload))
        ]
        assert mine, workload["metadata"]["name"]
        sidecar_ports = {
            p["name"]
            for c in _pod(workload)["containers"]
            if c is not vllm
            for p in c.get("ports", [])
        }
        for policy in mine:
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])}
                assert ports, f"{_name(policy)} opens every port"
                assert ports <= sidecar_ports, _name(policy)


def test_only_labelled_clients_and_metrics_readers_reach_the_sidecar() -> None:
    """The sidecar's port admits a labelled client namespace, the collector and Prometheus; no one else."""
    (policy,) = [
        p
        for p in _of("NetworkPolicy")
        if _selects(p["spec"]["podSelector"]["matchLabels"], _labels(_vllm_pods()[0][0]))
    ]
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert any(sel.get("matchLabels") for sel in peer.values()), peer
    # The API port; the endpoint pickers' port (vLLM's gauges alone) is held in tests/deploy.
    peers = [
        peer
        for rule in policy["spec"]["ingress"]
        if {p["port"] for p in rule["ports"]} == {"sidecar"}
        for peer in rule["from"]
    ]
    for peer in peers:
        # An empty selector would admit every namespace or every pod: never on its own.
        assert any(sel.get("matchLabels") for sel in peer.values()), peer
    namespaces = [p["namespaceSelector"]["matchLabels"] for p in peers if "podSelector" not in p]
    assert namespaces == [{"infermeter.io/inference-clients": "true"}]
    in_namespace = [p["podSelector"]["matchLabels"] for p in peers if "namespaceSelector" not in p]
    assert in_namespace == [{"app.kubernetes.io/component": "collector"}]
    prometheus = [p for p in peers if "namespaceSelector" in p and "podSelector" in p]
    assert [p["podSelector"]["matchLabels"] for p in prometheus] == [
        {"app.kubernetes.io/name": "prometheus"}
    ]


@pytest.mark.parametrize("component", ["billing", "dashboard"])
def test_billing_and_the_dashboard_admit_named_peers_on_their_port_only(component: str) -> None:
    """Billing's and the dashboard's pods are under an ingress policy: their port, labelled peers."""
    (workload,) = [
        w
        for w in DOCS
        if w["kind"] in WORKLOADS and _labels(w).get("app.kubernetes.io/component") == component
    ]
    policies = [
        p
        for p in _of("NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", [])
        and _selects(p["spec"]["podSelector"].get("matchLabels", {}), _labels(workload))
    ]
    assert policies, component
    ports = {p["name"] for c in _pod(workload)["containers"] for p in c.get("ports", [])}
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= ports, _name(policy)
            assert rule["from"], f"{_name(policy)} admits everyone"
            for peer in rule["from"]:
                assert any(sel.get("matchLabels") for sel in peer.values()), peer


def test_vllm_metrics_are_read_through_the_sidecar_with_the_token(tmp_path: Path) -> None:
    """Prometheus and the collector read vLLM's metrics at each pod's sidecar /engine/metrics, with the metrics token."""
    vllm_services = {
        s["metadata"]["name"]
        for s in _of("Service")
        if s["metadata"]["labels"].get("app.kubernetes.io/component") == "vllm"
    }
    monitors = [
        sm
        for sm in _of("ServiceMonitor")
        if any(e.get("path") == "/engine/metrics" for e in sm["spec"]["endpoints"])
    ]
    assert monitors
    for sm in monitors:
        for endpoint in sm["spec"]["endpoints"]:
            assert endpoint["authorization"]["credentials"]["key"] == "metrics-token"
    (cm,) = _of("ConfigMap")
    path = tmp_path / "infermeter.yaml"
    path.write_text(filled(cm["data"]["infermeter.yaml"]))
    config = load_config(path, environ={})
    for replica in config.replicas:
        assert replica.upstream_url.startswith("http://127.0.0.1:")
        # Never through a Service, which would answer from a random pod each scrape.
        assert replica.engine_metrics_url is None
    assert config.collector.discovery == "kubernetes"
    k8s = config.collector.kubernetes
    assert k8s.engine_metrics_path == "/engine/metrics"
    for workload, vllm in _vllm_pods():
        assert _selects_terms(_label_selector(k8s.label_selector), _labels(workload))
        sidecar_ports = {
            p["containerPort"]
            for c in _pod(workload)["containers"]
            if c is not vllm
            for p in c.get("ports", [])
        }
        assert k8s.sidecar_port in sidecar_ports
    assert vllm_services
    (collector,) = [w for w in _workloads() if w["metadata"]["name"] == "infermeter-collector"]
    env = {e["name"]: e for c in _pod(collector)["containers"] for e in c.get("env", [])}
    token = env[config.collector.metrics_token_env]["valueFrom"]["secretKeyRef"]
    assert token["key"] == "metrics-token"


# -- item 15: every pod locked down --------------------------------------------------------------


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_every_pod_runs_with_the_runtime_default_seccomp_profile(workload: Doc) -> None:
    """Pod-level seccompProfile RuntimeDefault, not overridden by any container."""
    pod = _pod(workload)
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"]:
        profile = c.get("securityContext", {}).get("seccompProfile")
        assert profile in (None, {"type": "RuntimeDefault"}), c["name"]


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_every_container_is_unprivileged_with_a_read_only_root(workload: Doc) -> None:
    """Each container (vLLM's included): non-root, no privilege escalation, no capabilities, read-only root."""
    pod = _pod(workload)
    for c in pod["containers"] + pod.get("initContainers", []):
        if c["name"] == SPOOL_INIT and workload in _spool_owners():
            continue  # held to its own narrower rule below
        sc = c.get("securityContext", {})
        assert sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True, c["name"]
        assert sc.get("runAsUser", 1) != 0, c["name"]
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
        assert not sc.get("capabilities", {}).get("add"), c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert not sc.get("privileged"), c["name"]


def _spool_owners() -> list[Doc]:
    """The workloads with a spool on the node: the vLLM pods and the collector."""
    return [w for w, _ in _vllm_pods()] + [
        w for w in _workloads() if w["metadata"]["name"] == "infermeter-collector"
    ]


def test_the_spool_init_container_may_only_chown_the_spool() -> None:
    """The one root container: CAP_CHOWN alone, no escalation, read-only root, the spools its only mounts."""
    for workload in _spool_owners():
        (init,) = [c for c in _pod(workload)["initContainers"] if c["name"] == SPOOL_INIT]
        sc = init["securityContext"]
        assert (sc["runAsUser"], sc["allowPrivilegeEscalation"], sc["readOnlyRootFilesystem"]) == (
            0,
            False,
            True,
        )
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert not sc.get("privileged")
        roots = {_volume(workload, m["name"])["hostPath"]["path"] for m in init["volumeMounts"]}
        assert roots <= {SPOOL_ROOT, COLLECTOR_SPOOL}, workload["metadata"]["name"]
        # Every other init container runs as the unprivileged UID.
        for other in _pod(workload)["initContainers"]:
            if other is not init:
                assert other["securityContext"]["runAsUser"] != 0


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_only_the_autoscaler_and_the_collector_mount_a_service_account_token(workload: Doc) -> None:
    """automountServiceAccountToken is false on every pod but the autoscaler's (scale) and the collector's (pod watch)."""
    pod = _pod(workload)
    name = workload["metadata"]["name"]
    if name in TOKEN_HOLDERS:
        assert pod.get("automountServiceAccountToken", True) is True
        assert pod["serviceAccountName"] == name
    else:
        assert pod.get("automountServiceAccountToken") is False
        assert "serviceAccountName" not in pod


def test_the_collector_may_only_read_pods() -> None:
    """The collector's Role reads pods (get, list, watch) and nothing else: no secrets, no writes."""
    (role,) = [r for r in _of("Role") if r["metadata"]["name"] == "infermeter-collector"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]


def test_the_namespace_warns_and_audits_restricted_and_enforces_only_what_the_spool_needs() -> None:
    """Warn and audit at "restricted"; enforce "privileged", the only level that admits a hostPath ("baseline" does not)."""
    (namespace,) = _of("Namespace")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    hostpaths = [v for w in _workloads() for v in _pod(w).get("volumes", []) if "hostPath" in v]
    assert hostpaths, "enforcement below restricted with no hostPath left: restore restricted"


def _volume(workload: Doc, name: str) -> Doc:
    volumes: list[Doc] = [v for v in _pod(workload).get("volumes", []) if v["name"] == name]
    (volume,) = volumes
    return volume


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_no_pod_needs_more_than_restricted_but_the_spool_on_the_node(workload: Doc) -> None:
    """No host namespaces or host ports; the only hostPaths are the spool roots: a sidecar writes its own pod's directory, the collector adopts the rest and keeps its own."""
    pod = _pod(workload)
    name = workload["metadata"]["name"]
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert not any(p.get("hostPort") for c in pod["containers"] for p in c.get("ports", []))
    hostpaths = {v["name"]: v["hostPath"] for v in pod.get("volumes", []) if "hostPath" in v}
    is_vllm = workload in [w for w, _ in _vllm_pods()]
    if not (is_vllm or name == "infermeter-collector"):
        assert hostpaths == {}
        return
    allowed = [{"path": SPOOL_ROOT, "type": "DirectoryOrCreate"}]
    if name == "infermeter-collector":
        allowed.append({"path": COLLECTOR_SPOOL, "type": "DirectoryOrCreate"})
    assert sorted(hostpaths.values(), key=str) == sorted(allowed, key=str)
    for volume in hostpaths:
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] == volume:
                    # The collector deletes what it shipped from a spool whose pod is gone; a
                    # sidecar sees its own pod's directory only.
                    writer = (is_vllm and c["name"] == "sidecar") or name == "infermeter-collector"
                    assert m.get("readOnly", False) is not writer, (name, c["name"])
                    if is_vllm:
                        assert m.get("subPathExpr") == "$(POD_UID)", (name, c["name"])


def test_exports_are_not_on_the_ledger_volume(tmp_path: Path) -> None:
    """billing.export_dir, the backups and the archive are on volumes of their own: a large
    export cannot fill the ledger's disk, and a backup does not share the ledger's."""
    (cm,) = _of("ConfigMap")
    path = tmp_path / "infermeter.yaml"
    path.write_text(filled(cm["data"]["infermeter.yaml"]))
    config = load_config(path, environ={})
    (billing,) = [s for s in _of("StatefulSet") if s["metadata"]["name"] == "infermeter-billing"]
    claims = {c["metadata"]["name"] for c in billing["spec"]["volumeClaimTemplates"]}
    (container,) = _pod(billing)["containers"]
    mounts: dict[str, str] = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}

    def volume_of(target: str) -> str:
        best = max(
            (p for p in mounts if target == p or target.startswith(p.rstrip("/") + "/")), key=len
        )
        return mounts[best]

    ledger = volume_of(config.billing.database)
    assert ledger in claims
    for elsewhere in (
        config.billing.export_dir,
        config.billing.backup_dir,
        config.billing.retention.archive,
    ):
        assert volume_of(elsewhere) != ledger, elsewhere


def test_the_writer_secret_is_in_no_serving_container() -> None:
    """Only billing and the init containers that derive a pod's own credential hold writer-secret:
    nothing a client or a pod can reach can issue another writer's credential."""
    holders = {
        (w["metadata"]["name"], c["name"])
        for w in _workloads()
        for c in _pod(w)["containers"] + _pod(w).get("initContainers", [])
        for e in c.get("env", [])
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") == "writer-secret"
    }
    assert {c for _, c in holders} == {"billing", "credential"}
    for workload in _workloads():
        for volume in _pod(workload).get("volumes", []):
            assert "secret" not in volume, (workload["metadata"]["name"], volume["name"])


def _secret_variables_read(container: Doc, config: Config) -> set[str]:
    """The variables holding a secret that ``container``'s process reads, under ``config``."""
    args = container.get("args", [])
    if container["image"].startswith(VLLM_IMAGE):
        return {"VLLM_API_KEY", "HF_TOKEN"}  # vLLM's own: its API key, gated weights
    if container.get("command") == ["redis-server"]:
        return {a[2:-1] for a in args if a.startswith("$(")}  # --requirepass $(REDIS_PASSWORD)
    s, a = config.sidecar, config.autoscale
    limits = s.shared_limits
    if args[:1] == ["sidecar"]:
        wanted = {
            s.upstream_api_key_env: True,
            limits.password_env: limits.redis_url is not None,
            limits.registry_token_env: limits.registry_url is not None,
            s.budgets.spend_token_env: s.budgets.spend_url is not None,
            s.gateway.secret_env: s.gateway.enabled,
        }
    elif args[:1] == ["collect"]:
        wanted = {config.collector.metrics_token_env: True}
    elif args[:2] == ["autoscale", "run"]:
        # With Prometheus as its source it reads no /metrics page, so it sends no metrics token.
        wanted = {
            a.metrics_token_env: a.prometheus_url is None,
            a.webhook_secret_env: a.webhook_url is not None,
        }
    elif args[:2] == ["billing", "backup"]:
        wanted = {ADMIN_TOKEN_ENV: True}
    elif args[:1] == ["billing"]:
        wanted = {
            config.billing.writer_secret_env: True,
            limits.password_env: limits.redis_url is not None,  # it publishes the issued keys
        }
    elif args[:1] == ["credential"]:
        wanted = {config.billing.writer_secret_env: True}
    else:
        wanted = {}
    return {name for name, read in wanted.items() if read}


def _pod_specs() -> list[tuple[str, Doc]]:
    specs = [(w["metadata"]["name"], _pod(w)) for w in _workloads()]
    for job in _of("CronJob"):
        specs.append(
            (job["metadata"]["name"], job["spec"]["jobTemplate"]["spec"]["template"]["spec"])
        )
    return specs


def test_every_secret_a_container_is_given_is_one_its_process_reads(tmp_path: Path) -> None:
    """One credential per role: no container holds a key of the Secret that its process, as the
    ConfigMap configures it, never reads (a key held for nothing is one more place to steal it)."""
    path = tmp_path / "infermeter.yaml"
    path.write_text(filled(_of("ConfigMap")[0]["data"]["infermeter.yaml"]))
    config = load_config(path, environ={})
    unread = []
    for name, spec in _pod_specs():
        for container in spec["containers"] + spec.get("initContainers", []):
            given = {
                e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            read = _secret_variables_read(container, config)
            unread += [
                f"{name}/{container['name']}: {v} ({k})" for v, k in given.items() if v not in read
            ]
    assert unread == []


def test_the_collectors_metrics_admit_prometheus_alone(tmp_path: Path) -> None:
    """The collector's per-GPU telemetry is read by Prometheus only: the autoscaler reads it
    from Prometheus (``autoscale.prometheus_url``), so no pod of the namespace is admitted."""
    path = tmp_path / "infermeter.yaml"
    path.write_text(filled(_of("ConfigMap")[0]["data"]["infermeter.yaml"]))
    assert load_config(path, environ={}).autoscale.prometheus_url is not None
    (policy,) = [p for p in _of("NetworkPolicy") if p["metadata"]["name"] == "infermeter-collector"]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert peers == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
