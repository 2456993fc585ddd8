"""The demo's one front door: vLLM's router in front of every sidecar, routing by model.

Each model of the demo is served by the sidecars of its replica groups, each on a port of its own.
A client wants one base URL for every model, as a gateway gives it in a cluster (the Gateway API
Inference Extension, docs/deploy.md). Here that is ``vllm-router`` (vLLM's router, a pinned
dependency) in its multi-model mode (``--enable-igw``): it reads the ``model`` of each request and
sends it to a worker registered for that model, streaming the answer back. The workers are the
sidecars, so every request is still metered with the client's own key, which the router passes on.

``FrontDoor`` owns the router process and its worker list: the fixed sidecars of the
configuration, and the instances the autoscaler's local hook starts and stops
(``simulator.instances_file``), registered (``POST /workers``) and removed
(``DELETE /workers/<url>``) as they come and go. ``workers`` is the pure part: who should be
registered now.

Run as ``python -m launcher.front_door --config FILE --listen HOST:PORT``; ``infermeter demo``
starts it as one of its processes. SIGTERM stops the router and then the process.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from urllib.parse import quote

import httpx

from infermeter.config import Config, load_config
from infermeter.local_fleet import LocalFleet, read_fleet
from infermeter.serving import host_port

__all__ = ["FrontDoor", "RouterMissingError", "router_command", "workers"]

log = logging.getLogger("launcher.front_door")

ROUTER = "vllm-router"


class RouterMissingError(RuntimeError):
    """The router's program is not installed: the message says how to get it."""


def workers(config: Config, fleet: LocalFleet) -> dict[str, str]:
    """Sidecar URL -> the model it serves: the fixed sidecars and the live local instances."""
    out = {f"http://{r.sidecar_listen}": r.model for r in config.replicas if r.sidecar_listen}
    for instance in fleet.instances:
        if instance.sidecar_url and instance.stopped_at is None and not instance.draining:
            out[instance.sidecar_url.rstrip("/")] = instance.model
    return out


def router_command(program: str, listen: str, metrics_port: int) -> list[str]:
    """vllm-router in its multi-model mode on ``listen``, health-checking the sidecars' /healthz."""
    host, port = host_port(listen)
    return [
        program,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-igw",
        "--policy",
        "round_robin",
        "--health-check-endpoint",
        "/healthz",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warning",
    ]


def _program() -> str:
    found = shutil.which(ROUTER) or shutil.which(ROUTER, path=str(Path(sys.executable).parent))
    if not found:
        raise RouterMissingError(
            f"{ROUTER} is not installed: it is in the dev extra (make demo installs it)"
        )
    return found


class FrontDoor:
    """The router process and the workers registered with it."""

    def __init__(
        self, config: Config, listen: str, metrics_port: int, client: httpx.Client | None = None
    ) -> None:
        self.config = config
        self.listen = listen
        self.url = f"http://{listen}"
        self.metrics_port = metrics_port
        self.client = client or httpx.Client(timeout=5.0)
        self.registered: dict[str, str] = {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_seconds: float = 30.0) -> None:
        """Start the router and wait until it answers."""
        self.process = subprocess.Popen(router_command(_program(), self.listen, self.metrics_port))
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{ROUTER} exited with status {self.process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get(f"{self.url}/health").status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{ROUTER} did not answer on {self.url} within {timeout_seconds:g} s")

    def sync(self, wanted: Mapping[str, str]) -> None:
        """Register the workers that came, remove those that went; failures are tried next time."""
        for url, model in wanted.items():
            if self.registered.get(url) == model:
                continue
            with contextlib.suppress(httpx.HTTPError):
                answer = self.client.post(
                    f"{self.url}/workers", json={"url": url, "model_id": model}
                )
                if answer.status_code < 300:
                    self.registered[url] = model
                    log.warning("front door: %s routes to %s", model, url)
        for url in [u for u in self.registered if u not in wanted]:
            with contextlib.suppress(httpx.HTTPError):
                answer = self.client.delete(f"{self.url}/workers/{quote(url, safe='')}")
                if answer.status_code < 300 or answer.status_code == 404:
                    del self.registered[url]

    def stop(self) -> None:
        """Stop the router (SIGTERM, then SIGKILL after 5 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.client.close()


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the front door until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m launcher.front_door")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--refresh-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    config = load_config(args.config)
    instances = Path(config.simulator.instances_file)
    signal.signal(signal.SIGTERM, _stop)
    door = FrontDoor(config, args.listen, args.metrics_port)
    try:
        door.start()
        while True:
            door.sync(workers(config, read_fleet(instances)))
            time.sleep(args.refresh_seconds)
    except RouterMissingError as exc:
        print(f"infermeter: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        door.stop()


if __name__ == "__main__":
    raise SystemExit(main())
