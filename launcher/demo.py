"""``infermeter demo``: the whole platform on a simulated fleet, with traffic, on loopback.

The demo is composed here from every part's processes (``launcher.fleet``). What it sets for its
children (where they ship, the demo's public reader tokens, the spare GPUs the autoscaler starts
instances on) is given to each child's environment explicitly (``demo_environment``); this
process's own environment is left as it was. A variable the user set wins, as the supervisor
gives each child its parent's environment over what the child is given.

Imported to build the parser; the fleet and the configuration are imported by the handler.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, config_path, listen_arg, port_arg
from infermeter.writers import DEMO_SECRET

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = [
    "DEMO_METRICS_TOKEN",
    "DEMO_SPEND_TOKEN",
    "DEMO_WRITER_SECRET",
    "demo_environment",
    "demo_team_keys",
    "register",
]

DEMO_METRICS_TOKEN = "im-demo-metrics"  # public, like the demo team keys
DEMO_SPEND_TOKEN = "im-demo-spend"  # the sidecars' spend_reader token, public too
# What the demo's writer credentials are derived from (``infermeter.writers.DEMO_SECRET``): public
# too, and given only to billing and the autoscaler (``launcher.fleet.with_writer_credentials``).
DEMO_WRITER_SECRET = DEMO_SECRET.decode()


def register(subparsers: Subparsers) -> None:
    """Add the ``demo`` subcommand."""
    demo = subparsers.add_parser(
        "demo",
        help="run the whole platform on a simulated fleet, with traffic",
        description=(
            "The simulated fleet, a sidecar in front of every replica, the collector, the billing "
            "service with its DuckDB ledger, the dashboard, the autoscaler (starting and stopping "
            "simulated instances on spare GPUs as demand changes), and traffic from several "
            "teams through the sidecars, all on loopback. Ctrl-C stops everything."
        ),
    )
    add_config(demo)
    demo.add_argument("--peak-rps", type=float, default=6.0, help="requests/s at the morning peak")
    demo.add_argument(
        "--day-seconds", type=float, default=600.0, help="wall seconds per simulated day"
    )
    demo.add_argument(
        "--front-door",
        type=listen_arg,
        default="127.0.0.1:18100",
        metavar="HOST:PORT",
        help="where vLLM's router serves every model (the one base URL; default %(default)s)",
    )
    demo.add_argument(
        "--front-door-metrics-port",
        type=port_arg,
        default=18190,
        metavar="PORT",
        help="where the router serves its own metrics (default %(default)s)",
    )
    demo.set_defaults(handler=_demo)


def demo_environment(config: Config) -> dict[str, str]:
    """What every child of the demo gets in its environment (below a variable the user set).

    The instances the autoscaler starts inherit it from the autoscaler, so they agree with the
    fixed ones.
    """
    from launcher import fleet

    # Sidecars, the collector and the autoscaler (each change of a model's desired count, for the
    # Fleet page) ship to the demo's billing service, each with a writer credential of its own
    # (the shared ingest token is not taken: the demo is a new installation); a user's own
    # settings win.
    ingest = f"{config.billing.url.rstrip('/')}/v1/ingest"
    env = {
        "INFERMETER__SIDECAR__INGEST_URL": config.sidecar.ingest_url or ingest,
        "INFERMETER__COLLECTOR__INGEST_URL": config.collector.ingest_url or ingest,
        "INFERMETER__AUTOSCALE__INGEST_URL": config.autoscale.ingest_url or ingest,
        # The collector ships what a sidecar that is gone left in its spool: the records of an
        # instance the autoscaler stopped, or of a sidecar killed before it shipped them.
        "INFERMETER__COLLECTOR__ADOPT_SPOOLS_DIR": (
            config.collector.adopt_spools_dir or config.sidecar.spool_dir
        ),
        # The autoscaler reads the collector's and the sidecars' /metrics with the reader key.
        config.autoscale.metrics_token_env: DEMO_METRICS_TOKEN,
        # The sidecars read spend and the keys issued at run time with the spend_reader token,
        # not the admin's: from the demo's billing, so budgets are enforced (and an override
        # asked at a sidecar is billing's, for every sidecar).
        config.sidecar.budgets.spend_token_env: DEMO_SPEND_TOKEN,
        "INFERMETER__SIDECAR__BUDGETS__SPEND_URL": (
            config.sidecar.budgets.spend_url or config.billing.url
        ),
    }
    # Spare GPUs on every node, for the instances the autoscaler starts (every child must agree).
    env.update(fleet.spare_gpu_overrides(config))
    return env


def _demo(args: argparse.Namespace, config: Config) -> int:
    from infermeter.config import env_value
    from launcher import fleet

    path = config_path(args)
    args.via_sidecars = True
    args.duration = None
    children = [fleet.billing_child(config, path)]
    children += fleet.simulator_children(config, path)
    # The sidecars once billing answers: their first reads of its spend, rates and issued keys
    # then find it (started together, each warned that billing did not answer, once).
    sidecars = fleet.sidecar_children(config, path)
    if sidecars:
        sidecars[0] = dataclasses.replace(sidecars[0], after_ready=True)
    children += sidecars
    # One base URL for every model: vLLM's router in front of the sidecars.
    children.append(fleet.front_door_child(path, args.front_door, args.front_door_metrics_port))
    children.append(fleet.collector_child(config, path))
    children.append(fleet.dashboard_child(config, path))
    # The autoscaler once the collector (and the rest) answer: its first read finds their /metrics.
    autoscaler = fleet.autoscaler_child(config, path, args.day_seconds)
    children.append(dataclasses.replace(autoscaler, after_ready=True))
    children.append(fleet.traffic_child(path, args))
    children = fleet.with_environment(children, demo_environment(config))
    secret = env_value(config.billing.writer_secret_env) or DEMO_WRITER_SECRET
    children = fleet.with_writer_credentials(children, config, secret.encode())
    urls = [("front door: every model (OpenAI API)", f"http://{args.front_door}/v1")]
    urls += fleet.sidecar_urls(config) + fleet.simulator_urls(config)
    fleet_view = f"http://{config.collector.listen}/metrics"
    urls.append(("collector (fleet view) (metrics: im-demo-metrics)", fleet_view))
    urls.append(("billing API (admin: im-demo-admin)", f"{config.billing.url}/v1/spend"))
    urls.append(("dashboard (sign in: im-demo-admin)", f"http://{config.dashboard.listen}/"))
    urls.append(("autoscaler (desired replicas)", f"http://{config.autoscale.listen}/metrics"))
    keys = demo_team_keys(config)
    if keys:
        urls.append(("team keys (API and dashboard)", ", ".join(keys)))
    return fleet.run(children, urls)


def demo_team_keys(config: Config) -> list[str]:
    """The public demo keys (``im-demo-<team>``) that this configuration accepts, team by team."""
    from infermeter.config import hash_key

    return [
        f"im-demo-{t.name}"
        for t in config.teams
        if hash_key(f"im-demo-{t.name}") in t.api_key_sha256
    ]
