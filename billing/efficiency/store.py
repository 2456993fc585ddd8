"""The advisor's one edge: run the figures' SQL on a ledger cursor and hand rows to the rules.

A month is read whole (clipped to now): its hourly figures per replica group, engine instance
and team, each model's summary, and the short requests per model and team; the
recommendations are then computed from those rows alone (``billing.efficiency.advice``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import polars as pl

from billing.efficiency.advice import (
    ModelFigures,
    Policy,
    Recommendation,
    ShortRequests,
    advise,
    ranked,
)
from billing.efficiency.figures import (
    Fleet,
    fleet_of,
    group_hourly_sql,
    instance_hourly_sql,
    model_gpu_sql,
    model_hourly_sql,
    model_summary_sql,
    prefix_sql,
    short_requests_sql,
    team_hourly_sql,
    team_peak_sql,
    workload_sql,
)
from billing.efficiency.offpeak import TeamHour, TeamWorkload, is_batch, off_peak
from billing.efficiency.prefix import PrefixFigures, prefix_cache
from billing.efficiency.schedule import HourFigures, schedule
from billing.schema import SLOT_SECONDS
from infermeter.config import Config
from infermeter.months import month_bounds

__all__ = [
    "Report",
    "month_slots",
    "policy_of",
    "read_hours",
    "read_models",
    "read_per_gpu",
    "read_prefixes",
    "read_report",
    "read_shorts",
    "read_team_hours",
    "read_workloads",
]


@dataclass(frozen=True, slots=True)
class Report:
    """A month's figures and recommendations; ``team`` set when it is one team's view."""

    month: str
    start: float
    end: float
    team: str | None
    groups: pl.DataFrame
    instances: pl.DataFrame
    teams: pl.DataFrame
    recommendations: tuple[Recommendation, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values (frames as columns and rows, as the query API)."""
        return {
            "month": self.month,
            "from": self.start,
            "to": self.end,
            "team": self.team,
            "recommendations": [r.to_json() for r in self.recommendations],
            "saving_usd_per_month": round(
                sum(r.saving_usd_per_month for r in self.recommendations), 2
            ),
            "figures": {
                name: {"columns": frame.columns, "rows": frame.rows()}
                for name, frame in (
                    ("groups", self.groups),
                    ("instances", self.instances),
                    ("teams", self.teams),
                )
            },
        }


def month_slots(month: str, now: float) -> tuple[int, int]:
    """The month's first slot and the slot after its last, ending no later than ``now``."""
    start, end = month_bounds(month)
    end = min(end, max(start, now))
    return int(start // SLOT_SECONDS), math.ceil(end / SLOT_SECONDS)


def _frame(cursor: duckdb.DuckDBPyConnection, built: tuple[str, dict[str, Any]]) -> pl.DataFrame:
    sql, params = built
    frame: pl.DataFrame = cursor.sql(sql, params=params).pl()
    return frame


def _figures(row: dict[str, Any], known: dict[str, Any], *, per_gpu: bool) -> ModelFigures:
    """A model's figures from one row of ``model_summary_sql`` or (``per_gpu``) ``model_gpu_sql``.

    The per-GPU rows carry no GPU-hours and no engine peaks.
    """
    model = known.get(row["model"])
    return ModelFigures(
        model=row["model"],
        served_version=model.current_version if model else row["model"],
        gpu_model=row["gpu_model"] or "", replicas=int(row["replicas"]),
        gpus_per_engine=float(row["gpus_per_engine"] or 0), hours=int(row["hours"] or 0),
        gpu_hours=0.0 if per_gpu else float(row["gpu_hours"] or 0),
        gpu_usd=float(row["gpu_usd"] or 0), cost_usd=float(row["cost_usd"] or 0),
        requests=int(row["requests"] or 0), prompt_tokens=int(row["prompt_tokens"] or 0),
        completion_tokens=int(row["completion_tokens"] or 0),
        ttft_within_sla_share=row["ttft_within_sla_share"],
        max_num_seqs=None if per_gpu else row["max_num_seqs"],
        peak_running=None if per_gpu else row["peak_running"],
        peak_waiting=None if per_gpu else row["peak_waiting"],
        max_model_len=model.max_model_len if model else 8192,
        engines=None if per_gpu else row["engines"],
    )  # fmt: skip


def read_models(cursor: duckdb.DuckDBPyConnection, config: Config, fleet: Fleet, lo: int,
                hi: int) -> list[ModelFigures]:  # fmt: skip
    """Each model's measured summary, joined to how the configuration serves it."""
    known = {m.name: m for m in config.models}
    rows = _frame(cursor, model_summary_sql(lo, hi, fleet)).iter_rows(named=True)
    return [_figures(row, known, per_gpu=False) for row in rows]


def read_per_gpu(cursor: duckdb.DuckDBPyConnection, config: Config, fleet: Fleet, lo: int,
                 hi: int) -> list[ModelFigures]:  # fmt: skip
    """Each model's measured summary on each GPU type it runs on (no engine peaks)."""
    known = {m.name: m for m in config.models}
    rows = _frame(cursor, model_gpu_sql(lo, hi, fleet)).iter_rows(named=True)
    return [_figures(row, known, per_gpu=True) for row in rows]


def read_shorts(cursor: duckdb.DuckDBPyConnection, policy: Policy, lo: int,
                hi: int) -> list[ShortRequests]:  # fmt: skip
    """Short requests per model and team, as the policy's thresholds define them."""
    built = short_requests_sql(lo, hi, policy.short_prompt_tokens, policy.short_completion_tokens)
    return [ShortRequests(**row) for row in _frame(cursor, built).iter_rows(named=True)]


def read_hours(cursor: duckdb.DuckDBPyConnection, fleet: Fleet, lo: int,
               hi: int) -> list[HourFigures]:  # fmt: skip
    """Each model's measured hours: GPU cost and the busiest minute's demand."""
    return [HourFigures(**row) for row in _frame(cursor, model_hourly_sql(lo, hi, fleet)).iter_rows(named=True)]  # fmt: skip


def read_prefixes(cursor: duckdb.DuckDBPyConnection, policy: Policy, lo: int,
                  hi: int) -> list[PrefixFigures]:  # fmt: skip
    """Each model's shared prompt heads and prefix-cache counters."""
    built = prefix_sql(lo, hi, policy.min_shared_requests)
    return [PrefixFigures(**row) for row in _frame(cursor, built).iter_rows(named=True)]


def read_team_hours(cursor: duckdb.DuckDBPyConnection, lo: int, hi: int,
                    pairs: Sequence[tuple[str, str]]) -> list[TeamHour]:  # fmt: skip
    """Each asked-for team's part of a model's measured hours: the peak without it, its work."""
    if not pairs:
        return []
    built = team_peak_sql(lo, hi, pairs)
    return [TeamHour(**row) for row in _frame(cursor, built).iter_rows(named=True)]


def read_workloads(cursor: duckdb.DuckDBPyConnection, lo: int, hi: int) -> list[TeamWorkload]:
    """Each team's finished requests per model, and those not streamed."""
    return [
        TeamWorkload(**row) for row in _frame(cursor, workload_sql(lo, hi)).iter_rows(named=True)
    ]


def _off_peak(cursor: duckdb.DuckDBPyConnection, config: Config, models: list[ModelFigures],
              hours: list[HourFigures], policy: Policy, lo: int,
              hi: int) -> list[Recommendation]:  # fmt: skip
    """The off-peak advice for every batch-type team's work on every model.

    The teams' hourly parts are read only for the work that can wait, usually none or few.
    """
    declared = {t.name: t.workload for t in config.teams}
    by_model = {m.model: m for m in models}
    batch = [w for w in read_workloads(cursor, lo, hi)
             if w.model in by_model and is_batch(w, declared.get(w.team, "auto"), policy)]  # fmt: skip
    team_hours = read_team_hours(cursor, lo, hi, [(w.model, w.team) for w in batch])
    found = []
    for w in batch:
        m = by_model[w.model]
        mine = [th for th in team_hours if th.model == w.model and th.team == w.team]
        rec = off_peak(m, [h for h in hours if h.model == m.model], mine, w,
                       declared.get(w.team, "auto"), policy)  # fmt: skip
        found += [rec] if rec is not None else []
    return found


def policy_of(config: Config) -> Policy:
    """The advisor's default policy, with the scaling section's engine start-up time."""
    return Policy(startup_seconds=config.scaling.startup_seconds)


def read_report(cursor: duckdb.DuckDBPyConnection, config: Config, month: str, now: float,
                team: str | None = None, policy: Policy | None = None) -> Report:  # fmt: skip
    """``month``'s figures and recommendations; with ``team``, only what that team may see.

    A team sees its own hourly figures and the recommendations about its own requests; the
    replica groups, instances and fleet-wide recommendations are the admin's.
    """
    policy = policy_of(config) if policy is None else policy
    fleet = fleet_of(config)
    lo, hi = month_slots(month, now)
    weights = (fleet.prompt_weight, fleet.completion_weight)
    models = read_models(cursor, config, fleet, lo, hi)
    recs = advise(models, read_shorts(cursor, policy, lo, hi), fleet.usd_per_gpu_hour, weights,
                  policy, read_per_gpu(cursor, config, fleet, lo, hi))  # fmt: skip
    hours = read_hours(cursor, fleet, lo, hi)
    prefixes = {p.model: p for p in read_prefixes(cursor, policy, lo, hi)}
    for m in models:
        found = schedule(m, [h for h in hours if h.model == m.model], policy)
        recs += [found] if found is not None else []
        shared = prefixes.get(m.model)
        found = None if shared is None else prefix_cache(m, shared, weights, policy)
        recs += [found] if found is not None else []
    recs = ranked([*recs, *_off_peak(cursor, config, models, hours, policy, lo, hi)])
    teams = _frame(cursor, team_hourly_sql(lo, hi, fleet, team))
    if team is None:
        groups = _frame(cursor, group_hourly_sql(lo, hi, fleet))
        instances = _frame(cursor, instance_hourly_sql(lo, hi, fleet))
    else:
        groups = instances = pl.DataFrame()
        recs = [r for r in recs if r.team == team]
    return Report(month, lo * SLOT_SECONDS, hi * SLOT_SECONDS, team, groups, instances, teams,
                  tuple(recs))  # fmt: skip
