"""The advisor's one edge: run the SQL on a ledger cursor and hand the rows to the pure parts.

A month is read whole (clipped to now): its hourly figures per replica group, engine instance
and team (``billing.efficiency.figures``), and what the replay is built from
(``billing.efficiency.replay_sql``): the requests as they arrived, the instances as they ran,
and what each replica group measured. The plan is then built from those rows alone
(``billing.efficiency.plan``, with the changes of ``billing.efficiency.changes``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import duckdb
import polars as pl

from billing.efficiency.advice import Policy, Recommendation, ranked
from billing.efficiency.changes import Facts, GroupEngine, propose, sizing_notes
from billing.efficiency.figures import (
    HOURS_PER_MONTH,
    Fleet,
    fleet_of,
    group_hourly_sql,
    instance_hourly_sql,
    team_hourly_sql,
)
from billing.efficiency.plan import GroupMeasured, Inputs, Note, Plan, Target, World, build_plan
from billing.efficiency.replay import Arrival, GroupSetup, ModelSetup, Run
from billing.efficiency.replay_sql import (
    arrivals_sql,
    group_engine_sql,
    group_measured_sql,
    hours_sql,
    runs_sql,
)
from billing.lifetimes import heartbeat_seconds
from billing.schema import SLOT_SECONDS
from infermeter.config import Config
from infermeter.months import month_bounds

__all__ = ["Report", "month_end_share", "month_slots", "policy_of", "read_plan", "read_report"]


@dataclass(frozen=True, slots=True)
class Report:
    """A month's figures and plan; ``team`` set when it is one team's view."""

    month: str
    start: float
    end: float
    team: str | None
    groups: pl.DataFrame
    instances: pl.DataFrame
    teams: pl.DataFrame
    recommendations: tuple[Recommendation, ...]
    notes: tuple[Note, ...] = ()
    hours: int = 0
    measured_usd: float = 0.0
    month_end_share: float = 1.0  # the elapsed share of the month the spend forecast divides by

    @property
    def saving_usd(self) -> float:
        """The plan's saving over the period measured (of the recommendations shown)."""
        return sum(r.saving_usd for r in self.recommendations)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values (frames as columns and rows, as the query API)."""
        per_month = HOURS_PER_MONTH / self.hours if self.hours else 0.0
        return {
            "month": self.month,
            "from": self.start,
            "to": self.end,
            "team": self.team,
            "recommendations": [r.to_json() for r in self.recommendations],
            "saving_usd_per_month": round(self.saving_usd * per_month, 2),
            "plan": {
                "hours_measured": self.hours,
                "saving_usd": self.saving_usd,
                "saving_usd_per_month": round(self.saving_usd * per_month, 2),
                "measured_usd": self.measured_usd,
                "measured_usd_per_month": round(self.measured_usd * per_month, 2),
                # As the spend forecast counts: the period's money over the elapsed share.
                "saving_usd_month_end": round(self.saving_usd / self.month_end_share, 2),
                "month_elapsed_share": self.month_end_share,
            },
            "notes": [n.to_json() for n in self.notes],
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


def month_end_share(month: str, now: float) -> float:
    """The elapsed share of ``month`` at ``now``, as the spend forecast divides by it (at least a
    minute, at most the whole month)."""
    start, end = month_bounds(month)
    return min(1.0, max(now - start, 60.0) / (end - start))


def _frame(cursor: duckdb.DuckDBPyConnection, built: tuple[str, dict[str, Any]]) -> pl.DataFrame:
    sql, params = built
    frame: pl.DataFrame = cursor.sql(sql, params=params).pl()
    return frame


def _rows(
    cursor: duckdb.DuckDBPyConnection, built: tuple[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    return list(_frame(cursor, built).iter_rows(named=True))


def policy_of(config: Config) -> Policy:
    """The advisor's default policy, with the scaling section's engine start-up time."""
    return Policy(startup_seconds=config.scaling.startup_seconds)


def _targets(config: Config) -> dict[tuple[str, str], Target]:
    """Each model's SLA, and each team's override of it (``alerts.slas``)."""

    def itl(tps: float) -> float | None:
        return 1.0 / tps if tps > 0 else None

    out = {
        (m.name, ""): Target(m.sla.ttft_p95_seconds, itl(m.sla.min_output_tokens_per_second))
        for m in config.models
    }
    for o in config.alerts.slas:
        base = config.model(o.model).sla
        tps = o.min_output_tokens_per_second
        out[(o.model, o.team)] = Target(
            o.ttft_p95_seconds or base.ttft_p95_seconds,
            itl(base.min_output_tokens_per_second if tps is None else tps),
        )
    return out


def _groups(
    config: Config, runs: list[dict[str, Any]], engines: Mapping[str, GroupEngine]
) -> dict[str, list[GroupSetup]]:
    """Each model's replica groups that ran, set up as configured and as their engines reported."""
    out: dict[str, list[GroupSetup]] = defaultdict(list)
    ran = {r["replica"] for r in runs}
    for r in config.replicas:
        if r.id not in ran:
            continue
        base = config.simulator.engine_for(r.model)
        measured = engines.get(r.id)
        kv = measured.kv_cache_tokens if measured and measured.kv_cache_tokens else None
        profile = base.model_copy(
            update={
                "max_num_seqs": r.max_num_seqs or base.max_num_seqs,
                "kv_cache_tokens": int(kv) if kv else base.kv_cache_tokens,
            }
        )
        hits = measured is not None and measured.prefix_cache_hits > 0
        dynamic = any(x["replica"] == r.id and x["instance"] != r.id for x in runs)
        out[r.model].append(
            GroupSetup(
                r.id,
                r.model,
                r.gpu_model,
                r.gpu_count,
                config.prices.usd_per_gpu_hour.get(r.gpu_model, 0.0),
                profile,
                hits,
                dynamic,
            )
        )
    return out


def read_plan(
    cursor: duckdb.DuckDBPyConnection,
    config: Config,
    lo: int,
    hi: int,
    policy: Policy,
    fleet: Fleet | None = None,
) -> Plan:
    """The plan for slots ``[lo, hi)``: replayed from the ledger's requests and instances."""
    fleet = fleet_of(config) if fleet is None else fleet
    models = {m.name for m in config.models}
    arrivals: dict[str, list[Arrival]] = defaultdict(list)
    for row in _frame(cursor, arrivals_sql(lo, hi)).iter_rows():
        t, team, model, prompt, completion, choices, stream, head, head_tokens, timed = row
        if model in models:
            arrivals[model].append(
                Arrival(
                    t, team, model, prompt, completion, choices, head, head_tokens, stream, timed
                )
            )
    runs = _rows(cursor, runs_sql(lo, hi, heartbeat_seconds(config)))
    engines = {
        row["replica"]: GroupEngine(**row) for row in _rows(cursor, group_engine_sql(lo, hi, fleet))
    }
    groups = _groups(config, runs, engines)
    replica_model = {r.id: r.model for r in config.replicas}
    measured = {
        row["replica"]: GroupMeasured(**(row | {"model": replica_model[row["replica"]]}))
        for row in _rows(cursor, group_measured_sql(lo, hi, fleet))
        if row["replica"] in replica_model and row["gpu_seconds"] > 0
    }
    setups = {
        model: ModelSetup(
            model,
            tuple(gs),
            tuple(
                Run(r["replica"], r["instance"], r["start"], r["end"], r["start"])
                for r in runs
                if r["replica"] in {g.replica for g in gs}
            ),
        )
        for model, gs in groups.items()
    }
    world = World(setups, {m: arrivals.get(m, []) for m in setups})
    [hours] = _frame(cursor, hours_sql(lo, hi))["hours"].to_list()
    facts = Facts(
        architectures={m.name: m.architecture for m in config.models if m.architecture},
        use_cases={m.name: m.use_case for m in config.models},
        served_versions={m.name: m.current_version for m in config.models},
        max_model_len={m.name: m.max_model_len for m in config.models},
        workloads={t.name: t.workload for t in config.teams},
        engines=engines,
        measured=measured,
        policy=policy,
        min_replicas=config.scaling.min_replicas,
        period_end=hi * SLOT_SECONDS,
    )
    inputs = Inputs(
        lo * SLOT_SECONDS,
        hi * SLOT_SECONDS,
        int(hours),
        world,
        measured,
        _targets(config),
        config.scaling.min_replicas,
        policy,
        tuple(sizing_notes(world, facts)),
    )
    return build_plan(inputs, propose(facts))


def read_report(
    cursor: duckdb.DuckDBPyConnection,
    config: Config,
    month: str,
    now: float,
    team: str | None = None,
    policy: Policy | None = None,
) -> Report:
    """``month``'s figures and plan; with ``team``, only what that team may see.

    A team sees its own hourly figures and the recommendations about its own requests (routing,
    off-peak); the replica groups, instances, fleet-wide changes and notes are the admin's.
    """
    policy = policy_of(config) if policy is None else policy
    fleet = fleet_of(config)
    lo, hi = month_slots(month, now)
    plan = read_plan(cursor, config, lo, hi, policy, fleet)
    recs = ranked(plan.recommendations)
    teams = _frame(cursor, team_hourly_sql(lo, hi, fleet, team))
    notes = plan.notes
    if team is None:
        groups = _frame(cursor, group_hourly_sql(lo, hi, fleet))
        instances = _frame(cursor, instance_hourly_sql(lo, hi, fleet))
    else:
        groups = instances = pl.DataFrame()
        recs = [r for r in recs if r.team == team]
        notes = ()
    return Report(
        month,
        lo * SLOT_SECONDS,
        hi * SLOT_SECONDS,
        team,
        groups,
        instances,
        teams,
        tuple(recs),
        tuple(notes),
        plan.hours,
        plan.measured_usd,
        month_end_share(month, min(now, hi * SLOT_SECONDS)),
    )
