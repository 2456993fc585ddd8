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

__all__ = ["configmap_config", "register", "rules_text", "write_manifests", "write_rules"]


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
            "of the same groups; with --scaledobjects KEDA's ScaledObjects, with "
            "--inference-routing the Gateway API Inference Extension's pools, route and "
            "objectives. --configmap reads the configuration from a ConfigMap manifest's "
            "infermeter.yaml (deploy/kubernetes/configmap.yaml, once its keys are filled). A "
            "configuration the rules cannot honour is an error."
        ),
    )
    add_config(render)
    render.add_argument(
        "--configmap",
        type=Path,
        default=None,
        metavar="FILE",
        help="read the configuration from the infermeter.yaml of the ConfigMap in FILE",
    )
    render.add_argument(
        "--scaledobjects",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write KEDA ScaledObjects of the autoscaled Deployments to FILE",
    )
    render.add_argument(
        "--inference-routing",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the InferencePools, HTTPRoute and InferenceObjectives to FILE",
    )
    render.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the rule files into DIR (default: print them to stdout)",
    )
    render.add_argument(
        "--prometheusrule",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the groups as a PrometheusRule manifest to FILE",
    )
    render.set_defaults(handler=_render)


def write_rules(
    config: Config, source: str, out: Path | None, manifest: Path | None = None
) -> list[Path]:
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


def configmap_config(path: Path) -> Config:
    """The configuration in the ``infermeter.yaml`` key of the ConfigMap manifest at ``path``.

    ConfigError naming the file when it holds no such ConfigMap or the configuration is bad.
    """
    import tempfile

    import yaml

    from infermeter.config import ConfigError, load_config

    try:
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), [f"cannot read the manifest: {exc}"]) from None
    texts = [
        d["data"]["infermeter.yaml"]
        for d in docs
        if isinstance(d, dict)
        and d.get("kind") == "ConfigMap"
        and isinstance(d.get("data"), dict)
        and "infermeter.yaml" in d["data"]
    ]
    if len(texts) != 1:
        raise ConfigError(str(path), ["no ConfigMap with one infermeter.yaml key in the file"])
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "infermeter.yaml"
        copy.write_text(texts[0], encoding="utf-8")
        try:
            return load_config(copy, environ={})
        except ConfigError as exc:
            raise ConfigError(f"{path} (infermeter.yaml)", exc.problems) from None


def _render(args: argparse.Namespace, config: Config) -> int:
    source = config_path(args)
    if args.configmap is not None:
        config, source = configmap_config(args.configmap), str(args.configmap)
    if args.out is None:
        # The rules go to stdout, so the names of files written go to stderr.
        sys.stdout.write(rules_text(config, source))
    written = []
    if args.out is not None or args.prometheusrule is not None:
        written += write_rules(config, source, args.out, args.prometheusrule)
    written += write_manifests(config, args.scaledobjects, args.inference_routing)
    for path in written:
        print(f"wrote {path}", file=sys.stdout if args.out else sys.stderr)
    return 0


def write_manifests(config: Config, scaledobjects: Path | None, routing: Path | None) -> list[Path]:
    """Write KEDA's ScaledObjects and the inference routing objects where asked; the paths."""
    from alerts.manifests import inference_routing, scaled_objects, to_yaml

    written = []
    for path, render in ((scaledobjects, scaled_objects), (routing, inference_routing)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(to_yaml(render(config)), encoding="utf-8")
            written.append(path)
    return written
