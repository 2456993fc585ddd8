"""``infermeter collect``: GPU telemetry and vLLM engine state, joined to replicas.

Imported to build the parser; the scrape loop and its server are imported by the handler.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, listen_arg

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register"]


def register(subparsers: Subparsers) -> None:
    """Add the ``collect`` subcommand."""
    col = subparsers.add_parser(
        "collect",
        help="scrape GPU telemetry (dcgm-exporter or NVML) and vLLM engine state",
        description=(
            "Scrape every node's dcgm-exporter (or this node's GPUs through NVML) and every "
            "engine instance's vLLM /metrics (from the replicas, billing's instance registry or "
            "the Kubernetes API: collector.discovery), join each GPU sample to its replica and "
            "instance, compute energy, spool and ship the samples to billing, and serve the "
            "joined fleet view on /metrics."
        ),
    )
    add_config(col)
    col.add_argument(
        "--listen",
        type=listen_arg,
        metavar="HOST:PORT",
        help="where to serve /metrics (default: collector.listen)",
    )
    col.set_defaults(handler=_collect)


def _collect(args: argparse.Namespace, config: Config) -> int:
    import asyncio
    import sys

    from collectors.serve import serve_collector
    from infermeter.kubernetes import KubernetesApiError
    from infermeter.otlp import OtlpConfigError
    from infermeter.writers import WriterError

    try:
        asyncio.run(serve_collector(config, args.listen))
    except KubernetesApiError as exc:
        print(f"infermeter: collector.kubernetes: {exc}", file=sys.stderr)
        return 2
    except OtlpConfigError as exc:
        print(f"infermeter: cannot export metrics over OTLP: {exc}", file=sys.stderr)
        return 2
    except WriterError as exc:
        print(f"infermeter: collector.credential_env: {exc}", file=sys.stderr)
        return 2
    return 0
