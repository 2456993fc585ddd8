"""The processes of a local fleet, as the ``simulate`` and ``demo`` commands start them."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Mapping, Sequence

from infermeter.config import Config
from infermeter.serving import ensure_free, host_port
from infermeter.writers import Writer, issue
from launcher.supervisor import Child, ChildFailedError, Supervisor

__all__ = [
    "DEMO_AUTOSCALE_SETTINGS",
    "autoscaler_child",
    "billing_child",
    "collector_child",
    "dashboard_child",
    "front_door_child",
    "run",
    "run_simulated",
    "sidecar_children",
    "sidecar_urls",
    "simulator_children",
    "simulator_urls",
    "spare_gpu_overrides",
    "traffic_child",
    "with_environment",
    "with_writer_credentials",
    "writer_environments",
]


def _infermeter(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def _seed(seed: int | None) -> list[str]:
    """The ``--seed`` a simulator child is given, so it runs on the seed its parent was given."""
    return [] if seed is None else ["--seed", str(seed)]


def simulator_children(config: Config, config_path: str, seed: int | None = None) -> list[Child]:
    """One process per replica and one for all dcgm-exporter stand-ins (``seed``: ``--seed``)."""
    children = []
    for r in config.replicas:
        ensure_free(*host_port(r.upstream_url), f"replica {r.id} upstream_url")
        argv = _infermeter("simulate", "--config", config_path, "--replica", r.id, *_seed(seed))
        children.append(Child(f"replica {r.id}", argv, f"{r.upstream_url.rstrip('/')}/health"))
    dcgm = [n for n in config.nodes if n.dcgm_exporter_url]
    for n in dcgm:
        assert n.dcgm_exporter_url is not None
        ensure_free(*host_port(n.dcgm_exporter_url), f"dcgm-exporter of node {n.name}")
    if dcgm:
        first = dcgm[0].dcgm_exporter_url
        argv = _infermeter("simulate", "--config", config_path, "--dcgm", *_seed(seed))
        children.append(Child("dcgm-exporters", argv, first))
    return children


def sidecar_children(config: Config, config_path: str) -> list[Child]:
    """One sidecar per replica that has a ``sidecar_listen`` address."""
    children = []
    for r in config.replicas:
        if not r.sidecar_listen:
            continue
        ensure_free(*host_port(r.sidecar_listen), f"sidecar of replica {r.id}")
        argv = _infermeter("sidecar", "--config", config_path, "--replica", r.id)
        children.append(Child(f"sidecar {r.id}", argv, f"http://{r.sidecar_listen}/healthz"))
    return children


def front_door_child(config_path: str, listen: str, metrics_port: int) -> Child:
    """vLLM's router on ``listen``, routing each request by its model to the sidecars."""
    ensure_free(*host_port(listen), "front door (vllm-router)")
    ensure_free(host_port(listen)[0], metrics_port, "front door's metrics")
    argv = [
        sys.executable,
        "-m",
        "launcher.front_door",
        "--config",
        config_path,
        "--listen",
        listen,
        "--metrics-port",
        str(metrics_port),
    ]
    return Child("front door", argv, f"http://{listen}/health")


def sidecar_urls(config: Config) -> list[tuple[str, str]]:
    """The sidecars' addresses, for the start-up banner."""
    return [
        (f"sidecar {r.id} (OpenAI API)", f"http://{r.sidecar_listen}/v1")
        for r in config.replicas
        if r.sidecar_listen
    ]


def collector_child(config: Config, config_path: str) -> Child:
    """The collector, scraping the simulated dcgm-exporters and replicas."""
    ensure_free(*host_port(config.collector.listen), "collector listen address")
    argv = _infermeter("collect", "--config", config_path)
    return Child("collector", argv, f"http://{config.collector.listen}/healthz")


def billing_child(config: Config, config_path: str) -> Child:
    """The billing service, owning the ledger file ``billing.database``."""
    ensure_free(*host_port(config.billing.listen), "billing listen address")
    argv = _infermeter("billing", "--config", config_path)
    return Child("billing", argv, f"http://{config.billing.listen}/healthz")


def dashboard_child(config: Config, config_path: str) -> Child:
    """The dashboard, reading through the billing service."""
    ensure_free(*host_port(config.dashboard.listen), "dashboard listen address")
    argv = _infermeter("dashboard", "--config", config_path)
    return Child("dashboard", argv, f"http://{config.dashboard.listen}/")


# The demo's day is minutes long: the autoscaler acts within seconds and slots its history by
# the minute, so a scale-up and a scale-down both happen in one simulated morning.
DEMO_AUTOSCALE_SETTINGS = {
    "INFERMETER__AUTOSCALE__LOCAL__ENABLED": "true",
    "INFERMETER__AUTOSCALE__INTERVAL_SECONDS": "3",
    "INFERMETER__AUTOSCALE__HISTORY_SLOT_SECONDS": "60",
    "INFERMETER__SCALING__SCALE_UP_AFTER_SECONDS": "10",
    "INFERMETER__SCALING__SCALE_DOWN_AFTER_SECONDS": "30",
    # A simulated GPU is busy whenever one sequence runs: at night the demo still reads ~35%.
    "INFERMETER__SCALING__SCALE_DOWN_GPU_UTILIZATION": "0.5",
    "INFERMETER__SCALING__COOLDOWN_SECONDS": "20",
    "INFERMETER__SCALING__STARTUP_SECONDS": "10",
}


def autoscaler_child(config: Config, config_path: str, day_seconds: float) -> Child:
    """The autoscaler with its local hook: it starts and stops instances as demand changes."""
    ensure_free(*host_port(config.autoscale.listen), "autoscale listen address")
    argv = _infermeter(
        "autoscale", "run", "--config", config_path, "--day-seconds", str(day_seconds)
    )
    return Child(
        "autoscaler", argv, f"http://{config.autoscale.listen}/healthz", env=DEMO_AUTOSCALE_SETTINGS
    )


def spare_gpu_overrides(config: Config) -> dict[str, str]:
    """Environment overrides giving every node as many spare GPUs as its replicas hold.

    The demo's nodes get room for the autoscaler's instances without a second configuration.
    """
    held: dict[str, int] = {}
    for r in config.replicas:
        held[r.node] = held.get(r.node, 0) + r.gpu_count
    return {
        f"INFERMETER__NODES__{n.name}__GPU_COUNT": str(max(n.gpu_count, 2 * held[n.name]))
        for n in config.nodes
        if held.get(n.name)
    }


def traffic_child(config_path: str, args: argparse.Namespace) -> Child:
    """The traffic generator, as a child process."""
    argv = _infermeter(
        "simulate",
        "--config",
        config_path,
        "--traffic-only",
        "--peak-rps",
        str(args.peak_rps),
        "--day-seconds",
        str(args.day_seconds),
    )
    if getattr(args, "via_sidecars", False):
        argv.append("--via-sidecars")
    if getattr(args, "duration", None) is not None:
        argv += ["--duration", str(args.duration)]
    argv += _seed(getattr(args, "seed", None))
    # SIGINT: the generator is a plain asyncio.run program, which SIGINT cancels cleanly. It
    # starts once the rest of the fleet answers: its first requests would find no sidecar yet.
    return Child("traffic", argv, stop_signal=signal.SIGINT, after_ready=True)


def simulator_urls(config: Config) -> list[tuple[str, str]]:
    """What to print once the fleet is up: a label and a URL per endpoint."""
    urls = [(f"vLLM replica {r.id} ({r.model})", r.upstream_url) for r in config.replicas]
    urls += [
        (f"dcgm-exporter {n.name}", n.dcgm_exporter_url)
        for n in config.nodes
        if n.dcgm_exporter_url
    ]
    return urls


def writer_environments(config: Config, secret: bytes) -> dict[str, dict[str, str]]:
    """Per child name, what its environment gets so each writes to billing as itself.

    A sidecar as its replica (the one instance of its group, at its listen address), the
    collector for every node, the autoscaler and the dashboard (its audit events) as themselves. Billing gets the writer secret, and so
    does the autoscaler, whose local hook stands where the cluster would and issues the
    credentials of the instances it starts; no other child sees it.
    """
    secret_env = config.billing.writer_secret_env
    envs = {
        "billing": {secret_env: secret.decode()},
        "collector": {
            config.collector.credential_env: issue(
                secret, Writer.for_collector(config.node_names())
            ).token
        },
        "autoscaler": {
            config.autoscale.credential_env: issue(secret, Writer.for_autoscaler()).token,
            secret_env: secret.decode(),
        },
        "dashboard": {config.dashboard.credential_env: issue(secret, Writer.for_dashboard()).token},
    }
    for r in config.replicas:
        writer = Writer.for_instance(r.id, r.id, r.sidecar_listen)
        envs[f"sidecar {r.id}"] = {config.sidecar.credential_env: issue(secret, writer).token}
    return envs


def with_writer_credentials(
    children: Sequence[Child], config: Config, secret: bytes
) -> list[Child]:
    """``children``, each with what ``writer_environments`` gives it."""
    envs = writer_environments(config, secret)
    return [
        dataclasses.replace(child, env={**child.env, **envs.get(child.name, {})})
        for child in children
    ]


def run_simulated(args: argparse.Namespace, config: Config, config_path: str) -> int:
    """``infermeter simulate`` with no single process named: every replica, the dcgm-exporter
    stand-ins and, with ``--traffic``, the traffic generator, until Ctrl-C."""
    children = simulator_children(config, config_path, args.seed)
    if args.traffic:
        children.append(traffic_child(config_path, args))
    return run(children, simulator_urls(config))


def with_environment(children: Sequence[Child], env: Mapping[str, str]) -> list[Child]:
    """``children``, each with ``env`` added below its own variables (its own win)."""
    return [dataclasses.replace(child, env={**env, **child.env}) for child in children]


def run(children: list[Child], urls: list[tuple[str, str]]) -> int:
    """Start the children, print the URLs, and run until Ctrl-C (children that die restart).

    A child that fails to start stops the fleet (exit 1): that is a port or a file to fix.
    """
    supervisor = Supervisor(children)
    try:
        supervisor.start()
        width = max(len(label) for label, _ in urls)
        print("infermeter is up:")
        for label, url in urls:
            print(f"  {label:<{width}}  {url}")
        print("Ctrl-C stops everything.", flush=True)
        return supervisor.wait()
    except ChildFailedError as exc:
        print(f"infermeter: {exc}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop()
