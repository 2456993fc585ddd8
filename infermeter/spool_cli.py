"""``infermeter spool reship ROOT``: ship again what the spools under ROOT kept after billing
acknowledged it (``sidecar.spool_keep_acked_seconds``), after billing's ledger was restored.

Each spool that keeps acknowledged segments gets a ``reship`` file; its owner (the sidecar, or
whoever opens the spool next) puts them back in line at its next shipping round, and billing
keeps each record once. It reads no setting: it only marks directories.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register"]


def register(subparsers: Subparsers) -> None:
    """Add ``spool`` and its action ``reship``."""
    cmd = subparsers.add_parser(
        "spool", help="act on the spools of records on their way to billing"
    )
    add_config(cmd)
    actions = cmd.add_subparsers(dest="spool_command", metavar="ACTION", required=True)
    reship = actions.add_parser(
        "reship",
        help="ship again the acknowledged records the spools under ROOT still keep",
        description=(
            "After billing's ledger was restored to a backup: every spool under ROOT that keeps "
            "acknowledged segments ships them again at its next round; billing drops the records "
            "it still has as repeats."
        ),
    )
    add_config(reship, nested=True)
    reship.add_argument("root", type=Path, metavar="ROOT", help="a spool, or a directory of them")
    reship.set_defaults(handler=_reship)


def _reship(args: argparse.Namespace, config: Config) -> int:
    from infermeter.spool import request_reship

    del config  # no setting is read: the directories are named
    asked = request_reship(args.root)
    for directory in asked:
        print(directory)
    print(f"{len(asked)} spools asked to ship their acknowledged records again")
    return 0
