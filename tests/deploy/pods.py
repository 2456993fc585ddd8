"""The rendered pods as local processes: what the kubelet gives a container, on one machine.

``localize`` (with ``localize_script`` for an inline ``python3 -c``) is the one place that
changes a manifest's value, and only where one machine cannot hold what a cluster does:

- a Service's DNS name (``infermeter-billing:8500``) -> ``127.0.0.1:<free port>`` of its pod;
- a pod's own address: each vLLM pod gets a loopback address of its own (127.0.0.2, .3, ...) and
  its containerPorts one free port, the same on every pod (as 9000 is in a cluster); a pod's
  loopback port (vLLM's ``127.0.0.1:8000``) a free port per pod; pods that are alone in the
  deployment (billing, Redis, the collector) keep 127.0.0.1 with free ports;
- ``0.0.0.0:<containerPort>`` (listen on the pod's address) -> ``<pod address>:<its port>``;
- a mount path -> the directory standing for its volume (a hostPath one per node, an emptyDir or
  a claim one per pod, ``subPathExpr`` expanded), and any other absolute path a directory of the
  pod's own, so nothing is written outside the test's directory;
- the node's dcgm-exporter (``$(HOST_IP):9400``) -> the simulator's stand-in;
- run as another user than root, a script's UID of the pods' ``runAsUser`` -> the test's own
  (the spool-dir init containers hand the spools to that UID; as root they run unchanged).

The images' programs are this machine's: ``infermeter`` (the image's entrypoint) of this
virtualenv, ``python3`` this interpreter, ``redis-server`` Debian's (``command``). Everything else
(commands, arguments, environment, the ConfigMap's settings) runs as rendered.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

Doc = dict[str, Any]

INFERMETER = str(Path(sys.executable).parent / "infermeter")  # the image's ENTRYPOINT
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class Pod:
    """One pod of a workload as scheduled: its identity and where the kubelet put it."""

    name: str
    uid: str
    namespace: str
    node: str
    ip: str
    labels: dict[str, str]
    spec: Doc
    ports: dict[int, int]  # containerPort -> the local port it listens on
    loopback: dict[int, int] = field(default_factory=dict)  # the pod's 127.0.0.1 ports -> local
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


@dataclass
class Cluster:
    """Where the cluster's names point on this machine, and the directories standing for volumes."""

    root: Path
    services: dict[str, str]  # "<service>:<port>" -> "127.0.0.1:<local port>"
    host_ports: dict[int, int]  # a node's ports (dcgm-exporter 9400) -> local ports
    secrets: dict[str, str]  # the keys of infermeter-secrets
    sidecar_port: int  # the vLLM pods' containerPort 9000, on each pod's own address

    def volume_dir(self, pod: Pod, volume: Doc, mount: Doc, env: Mapping[str, str]) -> Path:
        """The directory a mount of ``volume`` stands for (``subPath``/``subPathExpr`` applied)."""
        base: Path
        if "hostPath" in volume:
            base = self.root / "nodes" / pod.node / str(volume["hostPath"]["path"]).lstrip("/")
        else:  # emptyDir, a claim of a StatefulSet (the ConfigMap's files: see the test's mounts)
            base = self.root / "pods" / pod.name / "volumes" / str(volume["name"])
        sub: str = mount.get("subPath") or expand(mount.get("subPathExpr", ""), env)
        path = base / sub if sub else base
        path.mkdir(parents=True, exist_ok=True)
        return path


def expand(value: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` references as the kubelet expands them (an unknown one is left as it is)."""
    return _VAR.sub(lambda m: env.get(m[1], m[0]), value)


def downward(pod: Pod, field_path: str) -> str:
    """A ``fieldRef`` value of the downward API."""
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field_path)
    if label:
        return pod.labels[label[1]]
    return {
        "metadata.name": pod.name,
        "metadata.uid": pod.uid,
        "metadata.namespace": pod.namespace,
        "spec.nodeName": pod.node,
        "status.podIP": pod.ip,
        "status.hostIP": "127.0.0.1",
    }[field_path]


def environment(pod: Pod, container: Doc, cluster: Cluster) -> dict[str, str]:
    """The container's environment: values, the downward API and the Secret, in order, expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = expand(str(item["value"]), env)
        elif "fieldRef" in source:
            env[item["name"]] = downward(pod, source["fieldRef"]["fieldPath"])
        else:
            ref = source["secretKeyRef"]
            assert ref["name"] == "infermeter-secrets", ref
            if ref["key"] in cluster.secrets:
                env[item["name"]] = cluster.secrets[ref["key"]]
            elif not ref.get("optional"):
                raise KeyError(f"Secret key {ref['key']} missing")
    return env


def mounts(pod: Pod, container: Doc, cluster: Cluster, env: Mapping[str, str]) -> dict[str, Path]:
    """Each mount path of the container -> the local directory standing for it."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for claim in pod.spec.get("volumeClaimTemplates", []):
        volumes.setdefault(claim["metadata"]["name"], {"name": claim["metadata"]["name"]})
    return {
        m["mountPath"]: cluster.volume_dir(pod, volumes[m["name"]], m, env)
        for m in container.get("volumeMounts", [])
    }


def localize(value: str, pod: Pod, where: Mapping[str, Path], cluster: Cluster) -> str:
    """The one mapping from a cluster's value to this machine's (see the module's docstring)."""
    for service, local in cluster.services.items():
        value = value.replace(service, local)
    for port, local_port in cluster.host_ports.items():
        value = value.replace(f"127.0.0.1:{port}", f"127.0.0.1:{local_port}")  # $(HOST_IP)
    for port, local_port in pod.loopback.items():
        value = value.replace(f"127.0.0.1:{port}", f"127.0.0.1:{local_port}")
    for port, local_port in pod.ports.items():
        value = value.replace(f"0.0.0.0:{port}", f"{pod.ip}:{local_port}")
        if value in (str(port), f"--port={port}"):
            value = value.replace(str(port), str(local_port))
    return _path(value, pod, where, cluster)


def _path(value: str, pod: Pod, where: Mapping[str, Path], cluster: Cluster) -> str:
    flag, _, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
    if not path.startswith("/") or "\n" in path:
        return value
    for mount in sorted(where, key=len, reverse=True):
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            local = str(where[mount]) + path[len(mount) :]
            return f"{flag}={local}" if flag else local
    local = str(cluster.root / "pods" / pod.name / "rootfs") + path
    return f"{flag}={local}" if flag else local


def _uids(pod: Pod) -> set[int]:
    """The non-root UIDs the pod's containers run as (``securityContext.runAsUser``)."""
    containers = pod.spec["containers"] + pod.spec.get("initContainers", [])
    return {
        int(c["securityContext"]["runAsUser"])
        for c in containers
        if c.get("securityContext", {}).get("runAsUser")
    }


def localize_script(script: str, where: Mapping[str, Path], uids: set[int]) -> str:
    """A ``python3 -c`` script's quoted mount paths -> their directories; not run as root, the
    pods' UIDs in it -> the test's own."""
    for mount, local in where.items():
        script = script.replace(f'"{mount}"', f'"{local}"')
    if os.getuid() != 0:
        for uid in uids:
            script = re.sub(rf"\b{uid}\b", str(os.getuid()), script)
    return script


def localize_tree(node: Any, pod: Pod, where: Mapping[str, Path], cluster: Cluster) -> Any:
    """Every string of a parsed infermeter.yaml, localized; ``sidecar_port`` as a containerPort."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "sidecar_port":
                out[key] = cluster.sidecar_port
            else:
                out[key] = localize_tree(value, pod, where, cluster)
        return out
    if isinstance(node, list):
        return [localize_tree(v, pod, where, cluster) for v in node]
    if isinstance(node, str):
        return localize(node, pod, where, cluster)
    return node


def command(
    container: Doc, pod: Pod, where: Mapping[str, Path], cluster: Cluster, env: Mapping[str, str]
) -> list[str]:
    """The container's command and arguments as a local command line."""
    cmd = [expand(c, env) for c in container.get("command", [])]
    args = [localize(expand(a, env), pod, where, cluster) for a in container.get("args", [])]
    if not cmd:
        assert container["image"].startswith("ghcr.io/infermeter/infermeter:"), container["image"]
        return [INFERMETER, *args]
    if cmd[0] == "python3":
        cmd = [sys.executable, *[localize_script(c, where, _uids(pod)) for c in cmd[1:]]]
    elif cmd[0] == "redis-server":
        found = shutil.which("redis-server")
        assert found, "redis-server is not installed (make system-deps)"
        cmd = [found, *cmd[1:]]
    return [*cmd, *args]


def start(
    pod: Pod, argv: list[str], env: Mapping[str, str], log: Path, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start one container's process with exactly its environment (plus PATH, as in an image)."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1", **env}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, env=full, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    pod.processes.append(proc)
    return proc


def run_init(argv: list[str], env: Mapping[str, str], log: Path) -> None:
    """Run an init container to completion; it must succeed, as the kubelet requires."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    done = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"init container failed: {argv}\n{done.stdout}{done.stderr}"


def stop(processes: list[subprocess.Popen[bytes]], grace_seconds: float = 10.0) -> None:
    """SIGTERM every process, then SIGKILL what is left after ``grace_seconds`` (the kubelet's way)."""
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for proc in processes:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the container's every process (``start``)
            proc.kill()
            proc.wait(timeout=10)


class PodApi:
    """The pods endpoint of the Kubernetes API server, as the collector's watch reads it.

    Lists the pods it is given (label selector by key, ``spec.nodeName`` field selector) and
    streams a DELETED event for each pod removed while a watch is open; a watch ends at its
    ``timeoutSeconds``, as the API server's do.
    """

    def __init__(self, port: int) -> None:
        self.pods: dict[str, Doc] = {}
        self.events: list[tuple[int, str, Doc]] = []
        self.version = 100
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

            def do_GET(self) -> None:
                """List or watch."""
                url = urlsplit(self.path)
                query = dict(parse_qsl(url.query))
                if not re.fullmatch(r"/api/v1/namespaces/[a-z0-9-]+/pods", url.path):
                    self.send_error(404)
                    return
                if query.get("watch") != "1":
                    with api.lock:
                        items = [p for p in api.pods.values() if api.selected(p, query)]
                        body = json.dumps(
                            {
                                "kind": "PodList",
                                "apiVersion": "v1",
                                "items": items,
                                "metadata": {"resourceVersion": str(api.version)},
                            }
                        )
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body.encode())
                    return
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                seen = int(query.get("resourceVersion", "0"))
                end = time.monotonic() + float(query.get("timeoutSeconds", "300"))
                try:
                    while time.monotonic() < end:
                        with api.lock:
                            new = [(v, k, p) for v, k, p in api.events if v > seen]
                        for v, kind, pod in new:
                            if api.selected(pod, query):
                                line = json.dumps({"type": kind, "object": pod}) + "\n"
                                self.wfile.write(line.encode())
                                self.wfile.flush()
                            seen = v
                        time.sleep(0.2)
                except OSError:
                    return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def selected(self, pod: Doc, query: Mapping[str, str]) -> bool:
        """Whether the list's or watch's selectors take ``pod``."""
        labels = pod["metadata"].get("labels", {})
        for term in filter(None, query.get("labelSelector", "").split(",")):
            key, _, value = term.partition("=")
            if key not in labels or (value and labels[key] != value):
                return False
        node = query.get("fieldSelector", "").removeprefix("spec.nodeName=")
        return not node or pod["spec"]["nodeName"] == node

    def add(self, pod: Pod) -> None:
        """A running, ready pod, as the kubelet reports it."""
        doc: Doc = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": pod.name,
                "namespace": pod.namespace,
                "uid": pod.uid,
                "labels": pod.labels,
            },
            "spec": {"nodeName": pod.node},
            "status": {
                "phase": "Running",
                "podIP": pod.ip,
                "hostIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        with self.lock:
            self.version += 1
            doc["metadata"]["resourceVersion"] = str(self.version)
            self.pods[pod.name] = doc
            self.events.append((self.version, "ADDED", doc))

    def delete(self, name: str) -> None:
        """The pod is gone (scaled down)."""
        with self.lock:
            doc = self.pods.pop(name)
            self.version += 1
            self.events.append((self.version, "DELETED", doc))

    def __enter__(self) -> PodApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
