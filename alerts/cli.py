"""``infermeter alerts render``: write the rule files (and optionally the PrometheusRule)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, config_path

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register", "write_rules"]


def register(subparsers: Subparsers) -> None:
    """Add ``alerts`` and its ``render`` subcommand to the ``infermeter`` parser."""
    alerts = subparsers.add_parser(
        "alerts",
        help="Prometheus recording and alerting rules from the SLAs and scaling policy",
        description="Prometheus rules rendered from the configuration's SLAs, scaling and budgets.",
    )
    sub = alerts.add_subparsers(dest="alerts_command", metavar="ACTION", required=True)
    render = sub.add_parser(
        "render",
        help="write the recording and alerting rule files",
        description=(
            "Render recording and alerting rules from the configuration into DIR (one file for "
            "each kind), and with --prometheusrule also a Prometheus-operator PrometheusRule "
            "manifest of the same groups. A configuration the rules cannot honour is an error."
        ),
    )
    add_config(render)
    render.add_argument(
        "--out", type=Path, default=Path("alerts/rules"), metavar="DIR",
        help="directory for the rule files (default: alerts/rules)",
    )  # fmt: skip
    render.add_argument(
        "--prometheusrule", type=Path, default=None, metavar="FILE",
        help="also write the groups as a PrometheusRule manifest to FILE",
    )  # fmt: skip
    render.set_defaults(handler=_render)


def write_rules(config: Config, source: str, out: Path, manifest: Path | None = None) -> list[Path]:
    """Render ``config``'s rules and write them; the paths written, in order."""
    from alerts.rules import prometheus_rule, render, to_yaml

    groups = render(config, source)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, file_groups in groups.items():
        path = out / name
        path.write_text(to_yaml({"groups": file_groups}), encoding="utf-8")
        written.append(path)
    if manifest is not None:
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(to_yaml(prometheus_rule(groups)), encoding="utf-8")
        written.append(manifest)
    return written


def _render(args: argparse.Namespace, config: Config) -> int:
    for path in write_rules(config, config_path(args), args.out, args.prometheusrule):
        print(f"wrote {path}")
    return 0
