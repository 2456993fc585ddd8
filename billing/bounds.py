"""Physical bounds on samples: what ingest refuses as impossible before it can cost anything.

A GPU sample is money: its interval is GPU time at the price book's rate, its energy is kWh at
the energy price. Types and signs are not enough (one finite ``energy_joules`` of 1e15 on an
L40S billed $52.5M), so every sample is held to what the board it names can physically do
(``infermeter.boards``), and engine samples to what a counter or a gauge can hold. The checks
themselves are SQL in ``billing.ingest_sql``; this module says what the limits are and puts
them where that SQL reads them (macros ``_board_watts`` and ``_max_measured_seconds``, made per connection).

- **Power.** ``power_watts`` at most the board's power limit plus ``POWER_MARGIN`` (readings
  run a little over the limit in bursts).
- **Energy.** ``energy_joules`` at most what the board can draw at that power over the interval
  plus ``COUNTER_SLACK_SECONDS``: the collector takes energy from the board's counter, which
  dcgm-exporter refreshes on its own clock (every 30 s by default), so one interval can carry
  the increase of a little more than its own length, and the next one less.
- **Intervals.** Not negative (0 is a board's first reading: no time, so no energy either); a
  measured interval (``gap`` false) at most ``max_measured_seconds``, since the collector calls
  a longer one a gap; a gap at most ``MAX_GAP_SECONDS``.
- **Counters and gauges.** An engine's counters between 0 and ``MAX_COUNTER``; its KV-cache
  usage a fraction; request gauges at most ``MAX_REQUESTS``; a board's memory at most
  ``MAX_BOARD_MIB``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import duckdb

from infermeter.boards import (
    COUNTER_SLACK_SECONDS,
    POWER_MARGIN,
    UNKNOWN_BOARD_WATTS,
    configured_watts,
    max_watts,
)
from infermeter.config import Config
from infermeter.records import MAX_ENGINE_COUNTER, MAX_ENGINE_REQUESTS

__all__ = [
    "COUNTER_SLACK_SECONDS",
    "MAX_BOARD_MIB",
    "MAX_COUNTER",
    "MAX_GAP_SECONDS",
    "MAX_MEASURED_SECONDS",
    "MAX_REQUESTS",
    "POWER_MARGIN",
    "SampleBounds",
    "board_key_sql",
    "bounds_tables",
]

# The longest interval the collector measures in any configuration with the defaults' gap
# limit (3 intervals of 10 s) or a restored reading (at most 10 minutes old): a longer measured
# interval is not one the collector made. A configuration with a longer gap limit raises it.
MAX_MEASURED_SECONDS: Final = 600.0
# A gap (nothing measured in between) counts its time; at most a day, as before the bounds.
MAX_GAP_SECONDS: Final = 86_400.0
# Engine counters: a trillion tokens a day for thirty years; exact in a double.
MAX_COUNTER: Final = MAX_ENGINE_COUNTER
# Requests running or waiting on one engine (the autoscaler holds its readings to it too).
MAX_REQUESTS: Final = MAX_ENGINE_REQUESTS
# Memory of one board (or slice), used plus free: 1 TiB.
MAX_BOARD_MIB: Final = float(1 << 20)


@dataclass(frozen=True, slots=True)
class SampleBounds:
    """The limits ingest holds samples to; the defaults need no configuration.

    ``board_watts``: overrides of ``infermeter.boards``' table (name -> W). ``max_measured_seconds``:
    the longest measured interval taken.
    """

    board_watts: Mapping[str, float] = field(default_factory=dict)
    max_measured_seconds: float = MAX_MEASURED_SECONDS

    @classmethod
    def of(cls, config: Config) -> SampleBounds:
        """The bounds ``config`` implies: its boards' limits and its collector's gap limit.

        The simulator's stand-in boards (``simulator.gpus``) draw up to their ``max_watts``;
        ``billing.gpu_max_watts`` has the last word over both them and the table.
        """
        c = config.collector
        gap_limit = c.gap_after_intervals * c.scrape_interval_seconds
        return cls(configured_watts(config), max(MAX_MEASURED_SECONDS, gap_limit))

    def limits(self) -> dict[str, float]:
        """Every board's power limit (W) by ``board_key``; ``""`` is a board no entry names."""
        return {**max_watts(self.board_watts), "": UNKNOWN_BOARD_WATTS}


def board_key_sql(column: str) -> str:
    """SQL for ``infermeter.boards.board_key`` of ``column``."""
    spaced = f"replace(replace(replace({column}, ' ', ''), '-', ''), '_', '')"
    return f"regexp_replace(upper({spaced}), '^NVIDIA', '')"


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def bounds_tables(con: duckdb.DuckDBPyConnection, bounds: SampleBounds) -> None:
    """(Re)create what the sample checks read: macro ``_board_watts(gpu_model)`` (the board's
    limit in W, from a map: no join per sample) and ``_max_measured_seconds()``."""
    limits = bounds.limits()
    unknown = limits.pop("")
    entries = ", ".join(f"{_literal(k)}: {float(w)!r}" for k, w in sorted(limits.items()))
    con.execute(
        f"CREATE OR REPLACE TEMP MACRO _board_watts(gpu_model) AS "
        f"coalesce(MAP {{{entries}}}[{board_key_sql('gpu_model')}], {float(unknown)!r})"
    )
    con.execute(
        "CREATE OR REPLACE TEMP MACRO _max_measured_seconds() AS "
        f"{float(bounds.max_measured_seconds)!r}"
    )
