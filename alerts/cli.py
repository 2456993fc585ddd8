"""``infermeter alerts render``: print the rule files, or write them to ``--out``.

Printing is the default so that trying the command never replaces the committed rules in
``alerts/rules``; writing files is asked for by naming the directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, config_path

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register", "rules_text", "write_rules"]


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
        help="print (or write to --out) the recording and alerting rule files",
        description=(
            "Render recording and alerting rules from the configuration: printed to stdout, "
            "one YAML document per file, or written into DIR with --out (one file for each "
            "kind). With --prometheusrule also a Prometheus-operator PrometheusRule manifest "
            "of the same groups. A configuration the rules cannot honour is an error."
        ),
    )
    add_config(render)
    render.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="write the rule files into DIR (default: print them to stdout)",
    )  # fmt: skip
    render.add_argument(
        "--prometheusrule", type=Path, default=None, metavar="FILE",
        help="also write the groups as a PrometheusRule manifest to FILE",
    )  # fmt: skip
    render.set_defaults(handler=_render)


def write_rules(config: Config, source: str, out: Path | None,
                manifest: Path | None = None) -> list[Path]:  # fmt: skip
    """Render ``config``'s rules and write them (to ``out`` when given); the paths written, in order."""
    from alerts.rules import prometheus_rule, render, to_yaml

    groups = render(config, source)
    written = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, file_groups in groups.items():
            path = out / name
            path.write_text(to_yaml({"groups": file_groups}), encoding="utf-8")
            written.append(path)
    if manifest is not None:
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(to_yaml(prometheus_rule(groups)), encoding="utf-8")
        written.append(manifest)
    return written


def rules_text(config: Config, source: str) -> str:
    """Every rule file as one YAML stream: a ``# file: NAME`` comment, then the file, per document."""
    from alerts.rules import render, to_yaml

    return "---\n".join(
        f"# file: {name}\n{to_yaml({'groups': groups})}"
        for name, groups in render(config, source).items()
    )


def _render(args: argparse.Namespace, config: Config) -> int:
    source = config_path(args)
    if args.out is None:
        # The rules go to stdout, so the names of files written go to stderr.
        sys.stdout.write(rules_text(config, source))
    if args.out is None and args.prometheusrule is None:
        return 0
    for path in write_rules(config, source, args.out, args.prometheusrule):
        print(f"wrote {path}", file=sys.stdout if args.out else sys.stderr)
    return 0
