"""How figures read on the pages: column headers in words, money, counts, percentages and times.

Pure functions over plain values, so every table and tile formats a number the same way and the
tests can check a cell against the ledger by formatting the ledger's number. A column's kind
comes from its name (``*_usd`` is money, ``*_pct`` a percentage, ``*_tokens`` a count...), the
same names billing answers with, so a new column is formatted without being listed.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from typing import Final, Literal

__all__ = [
    "LABELS",
    "MISSING",
    "Kind",
    "as_of",
    "compact",
    "format_cell",
    "kind_of",
    "label",
    "parse_number",
    "percent",
    "usd",
]

# The one notation for a value there is none of: no price, no budget, nothing to divide by.
MISSING: Final = "\u2014"

Kind = Literal[
    "text", "count", "usd", "percent", "share", "hours", "kwh", "seconds", "gb", "bool", "number"
]

# Headers that the plain rule (underscores to spaces, unit suffix to words) would get wrong.
LABELS: Final[Mapping[str, str]] = {
    "team": "Team",
    "model": "Model",
    "use_case": "Use case",
    "line_type": "Line",
    "for_month": "Usage month",
    "month": "Month",
    "requests": "Requests",
    "failed_requests": "Failed requests",
    "prompt_tokens": "Prompt tokens",
    "cached_prompt_tokens": "Cached prompt tokens",
    "completion_tokens": "Completion tokens",
    "tokens": "Tokens",
    "gpu_hours": "GPU-hours",
    "energy_kwh": "Energy (kWh)",
    "compute_usd": "Compute",
    "energy_usd": "Energy cost",
    "idle_usd": "Idle capacity",
    "total_usd": "Total",
    "team_budget_usd": "Monthly budget",
    "team_budget_used_percent": "Budget used",
    "budget_usd": "Monthly budget",
    "budget_used_pct": "Budget used",
    "spent_usd": "Spent (month to date)",
    "forecast_usd": "Forecast (month end)",
    "cost_usd": "Cost",
    "usd_per_million_tokens": "Cost per 1M tokens",
    "ttft_p95_target_seconds": "TTFT p95 target",
    "ttft_requests": "Requests with a first token",
    "within_sla": "Within target",
    "compliance_pct": "Within target (share)",
    "p95_seconds": "TTFT p95",
    "over_target": "Over target",
    "hour": "Hour",
    "configured": "Configured",
    "reporting": "Reporting now",
    "desired": "Desired (autoscaler)",
    "live": "Live now",
    "gpu_ids": "GPUs",
    "why": "Why (the autoscaler's reasons)",
    "gpu": "GPU",
    "memory_gb": "Memory",
    "gpus": "GPUs (tensor parallel)",
    "per_gpu_gb": "Per GPU",
    "usd_per_hour": "Cost per hour",
    "replica": "Replica group",
    "instance": "Instance",
    "node": "Node",
    "gpu_model": "GPU model",
    "efficiency_pct": "Efficiency",
    "unattributed_tokens": "Unattributed tokens",
}


def kind_of(column: str) -> Kind:
    """The kind of a column, from its name."""
    if column.endswith("_usd") or column.startswith("usd_per_"):
        return "usd"
    if column.endswith(("_pct", "_percent")):
        return "percent"
    if column.endswith(("_share", "_ratio", "utilization", "kv_cache_usage")):
        return "share"
    if column.endswith("_hours"):
        return "hours"
    if column.endswith("_kwh"):
        return "kwh"
    if column.endswith("_seconds"):
        return "seconds"
    if column.endswith("_gb"):
        return "gb"
    if column.startswith(("over_", "is_")):
        return "bool"
    if column.endswith(("requests", "tokens", "_sla", "configured")):
        return "count"
    return "text"


def label(column: str) -> str:
    """The header a person reads for ``column``."""
    if column in LABELS:
        return LABELS[column]
    words = column.removesuffix("_usd").replace("_", " ")
    return words[:1].upper() + words[1:]


def usd(value: float | None, cents: bool = True) -> str:
    """Money: ``$1,234.56`` (``-$3.10`` when negative); ``MISSING`` when there is none."""
    if value is None or math.isnan(value):
        return MISSING
    sign = "-" if value < 0 else ""
    return f"{sign}${abs(value):,.2f}" if cents else f"{sign}${abs(value):,.0f}"


def percent(value: float | None, digits: int = 1) -> str:
    """A percentage already on the 0-100 scale: ``12.5 %``; ``MISSING`` when there is none."""
    if value is None or math.isnan(value):
        return MISSING
    return f"{value:,.{digits}f} %"


def compact(value: float) -> str:
    """A large count at a glance: ``950``, ``12.3 k``, ``4.56 M``, ``1.2 B``."""
    for size, suffix in ((1e9, " B"), (1e6, " M"), (1e3, " k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:,.0f}"


def format_cell(value: object, kind: Kind) -> str:
    """One table cell of ``kind``; ``MISSING`` for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if kind == "bool" or isinstance(value, bool):
        return "Yes" if value else "No"
    if not isinstance(value, int | float):
        return str(value)
    formats: dict[Kind, str] = {
        "usd": usd(float(value)),
        "percent": percent(float(value), 2 if abs(value) < 1 and value else 1),
        "share": percent(100 * float(value)),
        "count": f"{value:,.0f}",
        "hours": f"{value:,.3f}",
        "kwh": f"{value:,.3f}",
        "seconds": f"{value:,.3f} s",
        "gb": f"{value:,.1f} GB",
    }
    return formats.get(kind, f"{value:,.4g}" if isinstance(value, float) else f"{value:,}")


def parse_number(text: str) -> float | None:
    """The number a formatted cell shows (``$1,234.56``, ``-$0.05``, ``12.5 %``, ``6,000``)."""
    cleaned = text.replace("$", "").replace(",", "").replace("%", "").strip()
    cleaned = cleaned.removesuffix(" s").removesuffix(" GB").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


def moment(t: float, tz: str | None) -> str:
    """A time up to a month away, in the viewer's own zone: ``2026-12-08 14:03``."""
    return _in_zone(t, tz).strftime("%Y-%m-%d %H:%M")


def _in_zone(t: float, tz: str | None) -> dt.datetime:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        zone = ZoneInfo(tz or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        zone = ZoneInfo("UTC")
    return dt.datetime.fromtimestamp(t, zone)


def as_of(t: float, tz: str | None) -> str:
    """A time the viewer reads in their own zone: ``14:03:22``."""
    return _in_zone(t, tz).strftime("%H:%M:%S")
