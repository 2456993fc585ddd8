"""What a GPU board can physically draw: its power limit by model, for bounding samples.

A GPU sample says how much power a board drew and how much energy over an interval; billing
turns energy into money. One sample claiming more than any board can draw (``energy_joules``
1e15 on an L40S bills $52.5M) must be refused, not billed, so billing checks every sample
against the board's power limit with a margin (``billing.ingest_sql``). The collector holds
the energy counter it reads to the same limit (``collectors.energy``), so a counter that jumps
is measured from power instead of shipping a sample billing would refuse, its GPU time and all.

The table holds the board power limits NVIDIA publishes for the common data-centre models
(the TDP/TGP of each form factor). The names are what a configuration or dcgm-exporter calls
them (``gpu_model`` of a replica or node, or the product name ``NVIDIA H100 80GB HBM3``); they
are compared without case, spaces, dashes or an ``NVIDIA`` prefix. A name that covers several
form factors (``H100``: SXM 700 W or PCIe 350 W) has the largest of them, since a sample
from either is plausible. A model the table does not name is held to ``UNKNOWN_BOARD_WATTS``,
the largest board it knows, until the configuration names it (``billing.gpu_max_watts``,
or the simulator's ``simulator.gpus`` for its stand-in boards).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = [
    "BOARD_WATTS",
    "COUNTER_SLACK_SECONDS",
    "POWER_MARGIN",
    "UNKNOWN_BOARD_WATTS",
    "board_key",
    "board_watts",
    "configured_watts",
    "max_watts",
]

# A reading may run this far over the board's power limit (transients, meter error).
POWER_MARGIN: Final = 0.25
# dcgm-exporter refreshes a board's energy counter every 30 s by default: one interval may carry
# the increase of up to that much more time than its own length. Twice that, for a slow exporter.
COUNTER_SLACK_SECONDS: Final = 60.0

# Board power limits in watts, by the names boards go by.
BOARD_WATTS: Final[Mapping[str, float]] = MappingProxyType(
    {
        # Blackwell
        "GB200": 1200.0,
        "B200": 1000.0,
        "B100": 700.0,
        "RTX PRO 6000 Blackwell": 600.0,
        # Hopper
        "H200": 700.0,
        "H200 SXM": 700.0,
        "H200 NVL": 600.0,
        "H200 141GB HBM3e": 700.0,
        "H100": 700.0,
        "H100 SXM": 700.0,
        "H100 80GB HBM3": 700.0,
        "H100 SXM5 80GB": 700.0,
        "H100 PCIe": 350.0,
        "H100 80GB PCIe": 350.0,
        "H100 NVL": 400.0,
        "H800": 700.0,
        "H20": 400.0,
        "GH200": 1000.0,
        # Ampere
        "A100": 400.0,
        "A100-80GB": 400.0,
        "A100-40GB": 400.0,
        "A100 SXM4 80GB": 400.0,
        "A100-SXM4-80GB": 400.0,
        "A100-SXM4-40GB": 400.0,
        "A100 80GB PCIe": 300.0,
        "A100-PCIE-40GB": 250.0,
        "A100 PCIe": 300.0,
        "A800": 400.0,
        "A10G": 300.0,
        "A10": 150.0,
        "A30": 165.0,
        "A40": 300.0,
        "A16": 250.0,
        "A2": 60.0,
        "RTX A6000": 300.0,
        "RTX A5000": 230.0,
        "RTX A4000": 140.0,
        # Ada Lovelace
        "L40S": 350.0,
        "L40": 300.0,
        "L20": 275.0,
        "L4": 72.0,
        "RTX 6000 Ada": 300.0,
        "RTX 6000 Ada Generation": 300.0,
        "RTX 5000 Ada": 250.0,
        "RTX 5000 Ada Generation": 250.0,
        "RTX 4000 Ada": 130.0,
        "RTX 4000 Ada Generation": 130.0,
        "RTX 4000 SFF Ada": 70.0,
        "RTX 4000 SFF Ada Generation": 70.0,
        # Turing and Volta
        "T4": 70.0,
        "Tesla T4": 70.0,
        "V100": 300.0,
        "V100-SXM2-32GB": 300.0,
        "V100-SXM2-16GB": 300.0,
        "V100-PCIE-32GB": 250.0,
        "V100-PCIE-16GB": 250.0,
        "Tesla V100-SXM2-32GB": 300.0,
        "Tesla V100-PCIE-32GB": 250.0,
    }
)

# A board the table does not name: the largest the table knows.
UNKNOWN_BOARD_WATTS: Final = max(BOARD_WATTS.values())

_NOISE: Final = re.compile(r"[ _\-]+")


def board_key(name: str) -> str:
    """``name`` as the table compares it: upper case, no spaces, dashes or ``NVIDIA`` prefix."""
    key = _NOISE.sub("", name).upper()
    return key.removeprefix("NVIDIA")


_BY_KEY: Final = {board_key(name): watts for name, watts in BOARD_WATTS.items()}


def board_watts(name: str) -> float | None:
    """The table's power limit for ``name`` (W), or None when it does not name it."""
    return _BY_KEY.get(board_key(name))


def max_watts(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """Every board name's limit (W) with ``overrides`` applied, keyed by ``board_key``.

    ``overrides`` (name -> watts) replace or add entries: the configuration's word on its own
    boards wins over the table.
    """
    limits = dict(_BY_KEY)
    limits.update({board_key(name): float(watts) for name, watts in (overrides or {}).items()})
    return limits


def configured_watts(config: Config) -> dict[str, float]:
    """The overrides ``config`` makes of the table (name -> W): the simulator's stand-in boards
    (``simulator.gpus``) draw up to their ``max_watts``; ``billing.gpu_max_watts`` has the last
    word over both them and the table."""
    watts = {name: gpu.max_watts for name, gpu in config.simulator.gpus.items()}
    watts.update(config.billing.gpu_max_watts)
    return watts
