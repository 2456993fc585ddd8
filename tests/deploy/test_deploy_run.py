"""The deploy run: the rendered Kubernetes pods started as local processes, checked as deployed.

``kubectl kustomize deploy/kubernetes`` is rendered once. Its Redis and billing StatefulSets, two
pods of the chat-small Deployment (each its ``spool-dir`` and ``credential`` init containers,
then its sidecar) and the collector DaemonSet (on the node the two pods are scheduled on) run
with the containers' own commands, arguments and environment: the downward API filled as the
kubelet fills it (pod name, UID, namespace, node, pod IP, host IP), the Secret's keys generated,
the ConfigMap's infermeter.yaml written where each container mounts it. What one machine cannot
hold as a cluster does is changed in one visible place, ``tests.deploy.pods.localize`` (Service
names, pod addresses and ports, mount paths); what the test needs to reach in seconds in
``scenario`` (a small request limit, one more team with a budget of a cent).

Stand-ins, because there is no GPU and no cluster here:

- the vLLM container is the simulator's replica (``infermeter simulate --replica``) serving as
  that pod's instance, and the node's dcgm-exporter the simulator's stand-in, showing each GPU
  with the namespace and pod labels of the pod that holds it (as the device plugin and
  dcgm-exporter do);
- the collector's pod discovery reads a stand-in of the API server's pods endpoint (list, watch,
  the label and node selectors, a DELETED event when a pod is scaled down), given to it as
  ``collector.kubernetes.api_url`` instead of the in-cluster service account;
- the gateway is not run: requests go to the sidecars' ports, the InferencePool's targets;
- Prometheus scrapes the Services' pods as the ServiceMonitors select them (the operator's
  ``namespace``, ``pod``, ``service`` and ``job`` labels, the metrics token), every 15 s, and
  evaluates the rendered PrometheusRule's groups.

A scaled-down pod is one whose processes get SIGTERM, then SIGKILL after a grace period of 3 s
(the manifests give 660 s), while billing is paused (SIGSTOP, as in a restart or a partition), so
its spool still holds records for the node's collector to adopt.

Only a cluster checks: scheduling, securityContext (processes run as the test's user),
NetworkPolicies, probes, the InferencePool's endpoint picker and the HTTPRoute, KEDA, the
dashboard and autoscaler Deployments, dcgm-exporter's own ServiceMonitor, the chat-large group
(an H100 node of its own) and image contents (tests/deploy/test_image.py builds the image).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infermeter.config import hash_key
from infermeter.serving import free_port
from tests.alerts.prometheus import running_prometheus
from tests.deploy.pods import (
    INFERMETER,
    Cluster,
    Doc,
    Pod,
    PodApi,
    command,
    environment,
    localize,
    localize_tree,
    mounts,
    run_init,
    start,
    stop,
)
from tests.deploy.test_kubernetes import rendered
from tests.placeholders import PLACEHOLDER

NAMESPACE = "infermeter"
NODE = "gpu-node-2"  # the L40S node of the ConfigMap's nodes, where chat-small runs
GROUP = "chat-small"
TEAM = "finance-batch"  # as configured
TEAM_LIMITED = "search"
TEAM_CAPPED = "capped"  # the scenario's own team
RPM = 6  # the limited team's requests_per_minute, over the whole fleet


def scenario(config: Doc, capped_key: str) -> Doc:
    """The ConfigMap's infermeter.yaml with what a short test must reach in seconds.

    ``search`` may send 6 requests a minute (fleet-wide, through Redis), and one more team,
    ``capped``, has a budget of one cent a month. Besides these and ``localize``'s mapping, only
    the collector's ``kubernetes.api_url`` (the API server's stand-in) differs from the rendered
    ConfigMap.
    """
    for team in config["teams"]:
        if team["name"] == TEAM_LIMITED:
            team["limits"]["requests_per_minute"] = RPM
    config["teams"].append(
        {
            "name": TEAM_CAPPED,
            "api_key_sha256": [hash_key(capped_key)],
            "budget_usd_per_month": 0.01,
        }
    )
    return config


def _free_on(hosts: list[str]) -> int:
    """A port free on every one of ``hosts`` (each pod's own address uses it, as 9000 in a pod)."""
    while True:
        port = free_port()
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@dataclass
class Deployment:
    """What the test reaches: the pods, the keys, billing and Prometheus."""

    root: Path
    pods: dict[str, Pod]
    keys: dict[str, str]
    cluster: Cluster
    api: PodApi
    billing: str
    prometheus: str = ""
    sidecar_pods: list[Pod] = field(default_factory=list)

    @property
    def admin(self) -> dict[str, str]:
        """The admin token's header."""
        return {"authorization": f"Bearer {self.keys['the admin token']}"}

    def team_key(self, team: str) -> str:
        """A team's key, as its placeholder names it."""
        return self.keys[f"the {team} team's key"]


def _pod(
    spec: Doc, labels: dict[str, str], name: str, node: str, ip: str, ports: dict[int, int]
) -> Pod:
    return Pod(
        name=name,
        uid=str(uuid.uuid4()),
        namespace=NAMESPACE,
        node=node,
        ip=ip,
        labels=labels,
        spec=spec,
        ports=ports,
    )


def _template(workload: Doc) -> tuple[Doc, dict[str, str]]:
    spec = dict(workload["spec"]["template"]["spec"])
    spec["volumeClaimTemplates"] = workload["spec"].get("volumeClaimTemplates", [])
    return spec, dict(workload["spec"]["template"]["metadata"]["labels"])


def _config_dirs(pod: Pod, container: Doc, cluster: Cluster, config: Doc) -> dict[str, Path]:
    """The container's mounts, its ConfigMap mount holding the localized infermeter.yaml."""
    env = environment(pod, container, cluster)
    where = mounts(pod, container, cluster, env)
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if "configMap" in volumes.get(mount["name"], {}):
            own = cluster.root / "pods" / pod.name / "configmaps" / container["name"]
            own.mkdir(parents=True, exist_ok=True)
            where[mount["mountPath"]] = own
            local = localize_tree(config, pod, where, cluster)
            (own / "infermeter.yaml").write_text(yaml.safe_dump(local, sort_keys=False))
    return where


def _run_pod(
    pod: Pod, cluster: Cluster, config: Doc, replace: dict[str, list[str]] | None = None
) -> None:
    """Each init container to completion, then each container as a process (``replace``: stand-ins)."""
    logs = cluster.root / "logs"
    logs.mkdir(exist_ok=True)
    for init in pod.spec.get("initContainers", []):
        env = environment(pod, init, cluster)
        where = _config_dirs(pod, init, cluster, config)
        env = {k: localize(v, pod, where, cluster) for k, v in env.items()}
        run_init(
            command(init, pod, where, cluster, env), env, logs / f"{pod.name}.{init['name']}.log"
        )
    for container in pod.spec["containers"]:
        env = environment(pod, container, cluster)
        where = _config_dirs(pod, container, cluster, config)
        env = {k: localize(v, pod, where, cluster) for k, v in env.items()}
        argv = (replace or {}).get(container["name"]) or command(
            container, pod, where, cluster, env
        )
        data = where.get("/data")  # the Redis image's working directory
        start(pod, argv, env, logs / f"{pod.name}.{container['name']}.log", cwd=data)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url}: exited {proc.returncode}\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{url} not ready in {seconds} s\n{log.read_text()[-3000:]}")


def _wait_tcp(port: int, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=0.5),
        ):
            return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on {port}")


def _scrape_configs(docs: list[Doc], pods: list[Pod], token: str) -> list[dict[str, Any]]:
    """What the Prometheus operator makes of the ServiceMonitors, for the pods that run here."""
    services = [d for d in docs if d["kind"] == "Service"]
    out = []
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"]
        for service in services:
            if any(service["metadata"].get("labels", {}).get(k) != v for k, v in wanted.items()):
                continue
            for endpoint in monitor["spec"]["endpoints"]:
                port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
                selector = service["spec"]["selector"]
                for pod in pods:
                    if any(pod.labels.get(k) != v for k, v in selector.items()):
                        continue
                    named = {
                        p["name"]: p["containerPort"]
                        for c in pod.spec["containers"]
                        for p in c.get("ports", [])
                    }
                    target = port["targetPort"]
                    container_port = named[target] if isinstance(target, str) else target
                    job: dict[str, Any] = {
                        "job_name": f"{monitor['metadata']['name']}/{pod.name}",
                        "scrape_interval": endpoint.get("interval", "30s"),
                        "metrics_path": endpoint.get("path", "/metrics"),
                        "static_configs": [
                            {
                                "targets": [f"{pod.ip}:{pod.ports[container_port]}"],
                                "labels": {
                                    "namespace": NAMESPACE,
                                    "pod": pod.name,
                                    "service": service["metadata"]["name"],
                                    "job": service["metadata"]["name"],
                                },
                            }
                        ],
                    }
                    if "authorization" in endpoint:
                        assert endpoint["authorization"]["credentials"]["key"] == "metrics-token"
                        job["authorization"] = {"type": "Bearer", "credentials": token}
                    out.append(job)
    return out


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Every pod of the run started once, in the order the objects depend on; all stopped after."""
    root = tmp_path_factory.mktemp("deploy-run")
    docs = rendered()
    configmap = _one(docs, "ConfigMap", "infermeter-config")["data"]["infermeter.yaml"]
    keys = {m: secrets.token_urlsafe(24) for m in PLACEHOLDER.findall(configmap)}
    text = PLACEHOLDER.sub(lambda m: hash_key(keys[m[1]]), configmap)
    keys["the capped team's key"] = secrets.token_urlsafe(24)
    config = scenario(yaml.safe_load(text), keys["the capped team's key"])
    secret = {
        "writer-secret": secrets.token_urlsafe(32),
        "redis-password": secrets.token_urlsafe(16),
        "metrics-token": keys["metrics-token in infermeter-secrets"],
        "spend-token": keys["spend-token in infermeter-secrets"],
        "upstream-api-key": secrets.token_urlsafe(16),
    }
    ips = ["127.0.0.2", "127.0.0.3"]
    ports = {
        "billing": free_port(),
        "redis": free_port(),
        "collector": free_port(),
        "dcgm": free_port(),
        "api": free_port(),
    }
    sidecar_port, engine_port = _free_on(ips), _free_on(ips)
    cluster = Cluster(
        root=root,
        secrets=secret,
        sidecar_port=sidecar_port,
        services={
            "infermeter-billing:8500": f"127.0.0.1:{ports['billing']}",
            "infermeter-redis:6379": f"127.0.0.1:{ports['redis']}",
        },
        host_ports={9400: ports["dcgm"]},
    )
    config["collector"]["kubernetes"]["api_url"] = f"http://127.0.0.1:{ports['api']}"

    redis_spec, redis_labels = _template(_one(docs, "StatefulSet", "infermeter-redis"))
    billing_spec, billing_labels = _template(_one(docs, "StatefulSet", "infermeter-billing"))
    vllm_spec, vllm_labels = _template(_one(docs, "Deployment", f"vllm-{GROUP}"))
    collector_spec, collector_labels = _template(_one(docs, "DaemonSet", "infermeter-collector"))
    redis = _pod(
        redis_spec,
        redis_labels,
        "infermeter-redis-0",
        "cpu-node-1",
        "127.0.0.1",
        {6379: ports["redis"]},
    )
    billing = _pod(
        billing_spec,
        billing_labels,
        "infermeter-billing-0",
        "cpu-node-1",
        "127.0.0.1",
        {8500: ports["billing"]},
    )
    suffix = secrets.token_hex(5)
    vllm = [
        _pod(
            vllm_spec,
            vllm_labels,
            f"vllm-{GROUP}-{suffix}-{secrets.token_hex(3)[:5]}",
            NODE,
            ip,
            {9000: sidecar_port, 9002: engine_port},
        )
        for ip in ips
    ]
    collector = _pod(
        collector_spec,
        collector_labels,
        f"infermeter-collector-{secrets.token_hex(3)[:5]}",
        NODE,
        "127.0.0.1",
        {9500: ports["collector"]},
    )
    for pod in vllm:
        pod.loopback = {8000: free_port()}

    # The hardware's stand-ins: the simulator's configuration is the ConfigMap's, with the node's
    # dcgm-exporter address and the GPUs each pod holds (the device plugin's assignment).
    fleet = root / "gpus.json"
    fleet.write_text(
        json.dumps(
            {
                "instances": [
                    {
                        "instance": p.name,
                        "replica": GROUP,
                        "model": GROUP,
                        "node": NODE,
                        "gpus": [i],
                        "namespace": NAMESPACE,
                        "upstream_url": f"http://127.0.0.1:{p.loopback[8000]}",
                        "sidecar_url": f"http://{p.ip}:{sidecar_port}",
                        "started_at": time.time(),
                    }
                    for i, p in enumerate(vllm)
                ],
                "stopped": [],
            }
        )
    )
    sim = json.loads(json.dumps(config))
    for node in sim["nodes"]:
        if node["name"] == NODE:
            node["dcgm_exporter_url"] = f"http://127.0.0.1:{ports['dcgm']}/metrics"
    sim["simulator"] = {"instances_file": str(fleet)}
    sim_config = root / "simulator.yaml"
    sim_config.write_text(yaml.safe_dump(sim))

    api = PodApi(ports["api"])
    deployment = Deployment(
        root,
        {p.name: p for p in [redis, billing, *vllm, collector]},
        keys,
        cluster,
        api,
        f"http://127.0.0.1:{ports['billing']}",
        sidecar_pods=vllm,
    )
    hardware: list[subprocess.Popen[bytes]] = []
    with api:
        try:
            _run_pod(redis, cluster, config)
            _wait_tcp(ports["redis"])
            _run_pod(billing, cluster, config)
            _wait(
                f"{deployment.billing}/healthz",
                billing.processes[0],
                root / "logs" / f"{billing.name}.billing.log",
            )
            for pod in vllm:
                engine = [
                    INFERMETER,
                    "simulate",
                    f"--config={sim_config}",
                    f"--replica={GROUP}",
                    f"--listen=127.0.0.1:{pod.loopback[8000]}",
                    f"--instance={pod.name}",
                ]
                _run_pod(pod, cluster, config, replace={"vllm": engine})
                api.add(pod)
            for pod in vllm:
                _wait(
                    f"http://{pod.ip}:{sidecar_port}/readyz",
                    pod.processes[1],
                    root / "logs" / f"{pod.name}.sidecar.log",
                )
            with (root / "logs" / "dcgm.log").open("ab") as log:
                dcgm = subprocess.Popen(
                    [INFERMETER, "simulate", f"--config={sim_config}", "--dcgm"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            hardware.append(dcgm)
            _wait(f"http://127.0.0.1:{ports['dcgm']}/metrics", dcgm, root / "logs" / "dcgm.log")
            _run_pod(collector, cluster, config)
            _wait(
                f"http://127.0.0.1:{ports['collector']}/healthz",
                collector.processes[0],
                root / "logs" / f"{collector.name}.collector.log",
            )
            prom_dir = root / "prometheus"
            prom_dir.mkdir()
            rules = next(d for d in docs if d["kind"] == "PrometheusRule")
            (prom_dir / "rules.yaml").write_text(
                yaml.safe_dump({"groups": rules["spec"]["groups"]})
            )
            scrapes = _scrape_configs(docs, [billing, *vllm, collector], secret["metrics-token"])
            with running_prometheus(prom_dir, scrapes, [str(prom_dir / "rules.yaml")]) as url:
                deployment.prometheus = url
                yield deployment
        finally:
            # The writers first, while billing takes what they ship on SIGTERM; then billing, Redis.
            stop(
                [*collector.processes, *(p for pod in vllm for p in pod.processes), *hardware],
                grace_seconds=10,
            )
            stop(billing.processes, grace_seconds=10)
            stop(redis.processes, grace_seconds=10)


def _chat(pod: Pod, port: int, key: str, request_id: str | None = None) -> httpx.Response:
    """One streamed chat completion at a pod's sidecar (read whole), as the gateway forwards it."""
    headers = {"authorization": f"Bearer {key}", "x-request-id": request_id or str(uuid.uuid4())}
    return httpx.post(
        f"http://{pod.ip}:{port}/v1/chat/completions",
        timeout=30,
        headers=headers,
        json={
            "model": GROUP,
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )


def _record(deployment: Deployment, request_id: str) -> dict[str, Any] | None:
    """Billing's usage record of the request the client named ``request_id``, if it has it."""
    answer = httpx.get(
        f"{deployment.billing}/v1/usage/records",
        headers=deployment.admin,
        timeout=30,
        params={"id": request_id, "by": "client_request_id"},
    ).json()
    records: list[dict[str, Any]] = answer["records"]
    return records[0] if records else None


def _served(deployment: Deployment, pod: Pod, team: str, count: int) -> list[str]:
    """Send ``count`` requests of ``team`` to ``pod``, each answered 200; their request ids."""
    ids = [str(uuid.uuid4()) for _ in range(count)]
    for request_id in ids:
        answer = _chat(pod, deployment.cluster.sidecar_port, deployment.team_key(team), request_id)
        assert answer.status_code == 200, answer.text
    return ids


def _metered_to(
    deployment: Deployment, ids: list[str], pod: Pod, team: str, seconds: float
) -> None:
    """Every request of ``ids`` reaches billing as usage of ``pod`` (its name, group and node)."""

    def records() -> list[dict[str, Any]] | None:
        found = [_record(deployment, i) for i in ids]
        return None if None in found else [r for r in found if r is not None]

    for record in _until(records, seconds, f"the records of {pod.name} in billing"):
        assert (record["instance"], record["replica"], record["team"], record["model"]) == (
            pod.name,
            GROUP,
            team,
            GROUP,
        )
        assert record["status"] == "ok", record


def _until(check: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(1)
    pytest.fail(f"{what}: not within {seconds} s (last: {last!r})")


def test_requests_to_each_pod_are_metered_to_that_pod(deployment: Deployment) -> None:
    """Requests sent to each pod's sidecar (the InferencePool's targets) reach billing as usage
    of that pod: the instance is the pod's name, its group the pod's label."""
    sent = {pod.name: _served(deployment, pod, TEAM, 2) for pod in deployment.sidecar_pods}
    for pod in deployment.sidecar_pods:
        _metered_to(deployment, sent[pod.name], pod, TEAM, 30)


def test_gpu_samples_are_attributed_to_the_pod_holding_the_gpu(deployment: Deployment) -> None:
    """The node's collector finds the pods through the API (label, node) and names each GPU's
    samples after the pod dcgm-exporter says holds it: billing has GPU time per pod and group."""

    def per_pod() -> dict[str, tuple[str, str, str]]:
        answer = httpx.get(
            f"{deployment.billing}/v1/query/gpus", headers=deployment.admin, timeout=30
        ).json()
        cols = answer["columns"]
        rows = [dict(zip(cols, row, strict=True)) for row in answer["rows"]]
        return {
            r["instance"]: (r["node"], r["replica"], r["gpu_model"])
            for r in rows
            if r["instance"] and r["gpus"] > 0
        }

    names = {p.name for p in deployment.sidecar_pods}
    found = _until(lambda: (f := per_pod()) and names <= set(f) and f, 60, "GPU samples per pod")
    for name in names:
        assert found[name] == (NODE, GROUP, "L40S")
    assert set(found) == names  # no GPU is billed to anything but the pods holding them


def test_a_team_limit_holds_fleet_wide_through_the_deployed_redis(deployment: Deployment) -> None:
    """search may send 6 requests a minute: sent at both pods at once, 6 are served in all,
    not 6 by each pod, because the sidecars keep the limit in the deployed Redis."""
    key = deployment.team_key(TEAM_LIMITED)
    port = deployment.cluster.sidecar_port
    began = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda pod: _chat(pod, port, key).status_code, deployment.sidecar_pods * 8)
        )
    refilled = int((time.monotonic() - began) * RPM / 60)  # what the bucket regained meanwhile
    assert RPM <= answers.count(200) <= RPM + refilled, answers
    assert answers.count(429) == len(answers) - answers.count(200)
    for pod in deployment.sidecar_pods:  # each pod refused some: neither kept a limit of its own
        served = [a for a, p in zip(answers, deployment.sidecar_pods * 8, strict=True) if p is pod]
        assert 429 in served


def test_a_team_past_its_budget_is_refused_by_every_pod(deployment: Deployment) -> None:
    """capped (a budget of one cent) is served until billing's spend of it passes the budget,
    then every sidecar answers 429 budget_exceeded, as each reads billing's spend."""
    key = deployment.team_key(TEAM_CAPPED)
    port = deployment.cluster.sidecar_port
    first = _chat(deployment.sidecar_pods[0], port, key)
    assert first.status_code == 200, first.text

    def refused() -> list[httpx.Response] | None:
        answers = [_chat(pod, port, key) for pod in deployment.sidecar_pods]
        return answers if all(a.status_code == 429 for a in answers) else None

    for answer in _until(refused, 120, "429 budget_exceeded from every pod"):
        assert answer.json()["error"]["code"] == "budget_exceeded", answer.text
    spend = httpx.get(f"{deployment.billing}/v1/spend", headers=deployment.admin, timeout=30).json()
    (capped,) = [row for row in spend if row["team"] == TEAM_CAPPED]
    assert capped["spent_usd"] >= capped["budget_usd"] == 0.01


def test_a_scaled_down_pods_spool_is_adopted_by_the_nodes_collector(deployment: Deployment) -> None:
    """A pod removed while billing cannot take its records (billing paused) leaves its spool on
    the node; the collector there ships it once billing is back, and removes the directory."""
    pod = deployment.sidecar_pods[1]
    billing = deployment.pods["infermeter-billing-0"].processes[0]
    spool = deployment.root / "nodes" / NODE / "var/lib/infermeter/spool" / pod.uid
    assert spool.is_dir()
    billing.send_signal(signal.SIGSTOP)
    try:
        ids = _served(deployment, pod, TEAM, 3)
        deployment.api.delete(pod.name)
        stop(pod.processes, grace_seconds=3)  # SIGTERM, then SIGKILL after the grace period
        held = b"".join(f.read_bytes() for f in spool.glob("seg-*.jsonl"))
        # The pod could not ship them: its usage spool holds them for the collector.
        assert all(i.encode() in held for i in ids), "the pod's spool does not hold its records"
    finally:
        billing.send_signal(signal.SIGCONT)
    _metered_to(deployment, ids, pod, TEAM, 90)
    _until(lambda: not spool.exists(), 60, "the adopted spool directory removed")


def test_the_rendered_rules_evaluate_over_the_scraped_processes(deployment: Deployment) -> None:
    """Prometheus, scraping what the ServiceMonitors select, evaluates every rule of the
    rendered PrometheusRule without an error, and the recording rules over the sidecars',
    the collector's and billing's series have values for this deployment (billing's scraped
    once a minute, as its ServiceMonitor says: up to a minute and a half)."""
    url = deployment.prometheus
    _served(deployment, deployment.sidecar_pods[0], TEAM, 2)  # streamed: a time to first token

    def evaluated() -> list[dict[str, Any]] | None:
        groups = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if all(r["lastEvaluation"] > "2000" for r in rules) else None

    rules = _until(evaluated, 60, "every rule evaluated")
    assert [r["name"] for r in rules if r["health"] != "ok"] == []

    def series(query: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10).json()
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    power = _until(
        lambda: series("replica:infermeter_replica_gpu_power_watts:sum"), 60, "GPU power per group"
    )
    assert {s["metric"].get("replica") for s in power} == {GROUP}
    assert _until(
        lambda: series("team_model:infermeter_time_to_first_token_seconds_bucket:rate5m"),
        60,
        "TTFT per team and model",
    )

    def capped_share() -> list[dict[str, Any]]:
        found = series(f'team:infermeter_team_spend_per_budget:ratio{{team="{TEAM_CAPPED}"}}')
        # A scrape from before billing's statement counted the capped team's spend reads 0.
        return [s for s in found if float(s["value"][1]) >= 1.0]

    (share,) = _until(capped_share, 150, "the capped team's spend per budget at 1 or more")
    assert float(share["value"][1]) >= 1.0
