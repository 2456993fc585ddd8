"""Federation past one cluster: what a cluster's closed month is on the wire, and the central's
statement across clusters.

Pure functions over frames and dicts; the ledger's side is ``billing.federation_store``, the
pulling ``billing.federation_pull``. A closed month never changes, so its content has one
digest (SHA-256 of its canonical JSON): the central pulls a (cluster, month) again only when the
cluster lists another digest for it (a month reopened and closed again), and checks each payload
against the digest it came with.

A month closed with its hours (``billing.closed_hours``: cost, usage, reconciliation and
lifetimes per hour) carries them in ``hours``, inside its digest. A month closed without them, or served by a
cluster of an earlier version, has none and the same digest as before, so a fleet upgrades one
cluster at a time (the central first: an earlier central cannot check a digest over hours).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
import polars as pl

from billing.closed_hours import KINDS, month_hours
from exporters.focus import focus_frame
from infermeter.config import Config, Prices
from infermeter.statement import LINE_SCHEMA, POOL_SCHEMA, Statement, empty_pools

__all__ = [
    "FEDERATED_SCHEMA",
    "MAX_HOUR_ROWS",
    "ClusterState",
    "FederationError",
    "MonthPayload",
    "central_focus",
    "central_hours",
    "central_statement",
    "digest",
    "month_payload",
    "parse_hours",
    "parse_payload",
]

# A federated line: the cluster's frozen statement line and which cluster it came from.
FEDERATED_SCHEMA: Final = {"cluster": pl.String, **LINE_SCHEMA}
# The most rows of one kind of hour a payload may carry: a month of 744 hours with over 300
# (team, model) pairs; a payload beyond it is refused rather than stored half.
MAX_HOUR_ROWS: Final = 250_000

Hours = dict[str, list[dict[str, Any]]]


class FederationError(ValueError):
    """A cluster's answer that the central will not store (wrong month, cluster or digest)."""


def digest(
    month: str,
    basis: str,
    pools: Sequence[Mapping[str, Any]],
    lines: Sequence[Mapping[str, Any]],
    hours: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> str:
    """The SHA-256 of a closed month's content, in a canonical JSON form (sorted keys, lines in
    the ledger's order), so the same frozen month gives the same digest on every read.

    ``hours`` are in it when the month has them; without, the digest is the one a month had
    before hours were kept, so a month pulled then is not pulled again for nothing.
    """
    body: dict[str, Any] = {
        "month": month,
        "basis": basis,
        "pools": list(pools),
        "lines": list(lines),
    }
    if hours is not None:
        body["hours"] = {k: list(v) for k, v in hours.items()}
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True, slots=True)
class MonthPayload:
    """One cluster's closed month, as the cluster serves it and the central keeps it."""

    cluster: str
    month: str
    basis: str
    pools: list[dict[str, Any]]
    lines: list[dict[str, Any]]
    total_cents: int
    digest: str
    # The cluster's price book when it served the month (``Prices`` as JSON): not part of the
    # digest, as it is not frozen with the month; None from a cluster that sent none.
    prices: dict[str, Any] | None = None
    # The month's hours (``billing.closed_hours.KINDS`` -> rows); None for a month closed
    # without them or a cluster of an earlier version.
    hours: Hours | None = None

    def to_json(self) -> dict[str, Any]:
        """The route's answer (``hours`` only when the month has them, as before they were)."""
        out = {
            "cluster": self.cluster,
            "month": self.month,
            "basis": self.basis,
            "pools": self.pools,
            "lines": self.lines,
            "total_cents": self.total_cents,
            "digest": self.digest,
            "prices": self.prices,
        }
        if self.hours is not None:
            out["hours"] = self.hours
        return out


def month_payload(
    cluster: str,
    month: str,
    basis: str,
    pools: pl.DataFrame,
    lines: pl.DataFrame,
    prices: dict[str, Any] | None = None,
    hours: Mapping[str, pl.DataFrame] | None = None,
) -> MonthPayload:
    """A closed month's frozen lines (``LINE_SCHEMA``), basis and node pools, with its digest,
    the cluster's price book (``prices``) and the month's hours (``billing.closed_hours``)."""
    line_rows = lines.select(list(LINE_SCHEMA)).to_dicts()
    pool_rows = pools.select(list(POOL_SCHEMA)).to_dicts() if pools.height else []
    total = int(lines["total_cents"].sum()) if lines.height else 0
    hour_rows = (
        None
        if hours is None
        else {k: hours[k].select(list(schema)).to_dicts() for k, (schema, _) in KINDS.items()}
    )
    return MonthPayload(
        cluster,
        month,
        basis,
        pool_rows,
        line_rows,
        total,
        digest(month, basis, pool_rows, line_rows, hour_rows),
        prices,
        hour_rows,
    )


# Columns of an hour that may be below zero: the engines' tokens less the ledger's, and money
# (a line's cents carry credits).
_SIGNED: Final = frozenset({"hour", "difference_tokens", "total_cents"})


def _impossible(schema: Mapping[str, type[pl.DataType]]) -> pl.Expr:
    """The rows no cluster can have measured: a count or quantity below zero or not finite, or
    (lifetimes) more instance-hours in an hour than instances alive in it."""
    amounts = [c for c, t in schema.items() if t in (pl.Int64, pl.Float64) and c not in _SIGNED]
    floats = [c for c, t in schema.items() if t == pl.Float64]
    bad = pl.any_horizontal(*(pl.col(c) < 0 for c in amounts))
    if floats:
        bad = bad | pl.any_horizontal(*(~pl.col(c).is_finite() for c in floats))
    if "instance_hours" in schema:
        bad = bad | (pl.col("instance_hours") > pl.col("instances") + 1e-9)
    return bad


def parse_hours(sent: Any, month: str) -> dict[str, pl.DataFrame] | None:
    """A payload's ``hours`` as frames, each in its kind's schema; None when it sent none.

    FederationError unless every kind is there, within ``MAX_HOUR_ROWS``, and each row is of an
    hour of ``month``.
    """
    if sent is None:
        return None
    if not isinstance(sent, Mapping) or set(sent) != set(KINDS):
        raise FederationError(f"month {month}: its hours are not {sorted(KINDS)}")
    first, after = month_hours(month)
    frames = {}
    for kind, (schema, _) in KINDS.items():
        rows = sent[kind]
        if not isinstance(rows, list):
            raise FederationError(f"month {month}: its {kind} hours are not a list")
        if len(rows) > MAX_HOUR_ROWS:
            raise FederationError(
                f"month {month}: {len(rows)} {kind} hours, more than {MAX_HOUR_ROWS}"
            )
        try:
            frame = pl.DataFrame(rows, schema=dict(schema), strict=True) if rows else None
        except (TypeError, ValueError, pl.exceptions.PolarsError) as exc:
            raise FederationError(f"month {month}: its {kind} hours ({exc})") from None
        frame = frame if frame is not None else pl.DataFrame(schema=dict(schema))
        if frame.null_count().sum_horizontal().item():
            raise FederationError(f"month {month}: a {kind} hour with a missing value")
        outside = frame.filter(
            (pl.col("month") != month) | (pl.col("hour") < first) | (pl.col("hour") >= after)
        )
        if outside.height:
            raise FederationError(f"month {month}: a {kind} hour of another month")
        if frame.filter(_impossible(schema)).height:
            raise FederationError(
                f"month {month}: a {kind} hour with a negative or infinite quantity, or more "
                "instance-hours than instances"
            )
        frames[kind] = frame
    return frames


def parse_payload(body: Mapping[str, Any], cluster: str, month: str) -> MonthPayload:
    """``body`` as the month ``month`` of ``cluster``; FederationError unless it is that month of
    that cluster, its lines and pools have their schemas, and its digest and total hold."""
    if body.get("cluster") != cluster:
        raise FederationError(f"the cluster at that address says it is {body.get('cluster')!r}")
    if body.get("month") != month:
        raise FederationError(f"asked for {month}, the cluster answered {body.get('month')!r}")
    try:
        lines = pl.DataFrame(body["lines"], schema=LINE_SCHEMA) if body["lines"] else None
        pools = pl.DataFrame(body["pools"], schema=POOL_SCHEMA) if body["pools"] else None
        basis, stated, total = str(body["basis"]), str(body["digest"]), int(body["total_cents"])
        sent = body.get("prices")
        prices = None if sent is None else Prices.model_validate(sent).model_dump(mode="json")
    except (KeyError, TypeError, ValueError, pl.exceptions.PolarsError) as exc:
        raise FederationError(f"month {month}: not a closed month's payload ({exc})") from None
    hours = parse_hours(body.get("hours"), month)
    line_frame = lines if lines is not None else pl.DataFrame(schema=LINE_SCHEMA)
    payload = month_payload(
        cluster,
        month,
        basis,
        pools if pools is not None else empty_pools(),
        line_frame,
        prices,
        hours,
    )
    if payload.digest != stated:
        raise FederationError(f"month {month}: the content does not match its digest")
    if payload.total_cents != total:
        raise FederationError(
            f"month {month}: the lines add up to {payload.total_cents} cents, "
            f"the cluster's total is {total}"
        )
    if line_frame.filter(pl.col("month") != month).height:
        raise FederationError(f"month {month}: a line of another statement")
    if hours is not None:
        own = int(line_frame.filter(pl.col("for_month") == month)["total_cents"].sum())
        hourly = int(hours["cost"]["total_cents"].sum())
        if hourly != own:
            raise FederationError(
                f"month {month}: its hours add up to {hourly} cents, its own lines to {own}"
            )
    return payload


@dataclass(frozen=True, slots=True)
class ClusterState:
    """What the central knows of one configured cluster and of its month asked for.

    ``stale_since``: when pulls from it began to fail (None: the last pull succeeded);
    ``pulled_at``: its last successful pull (None: never). ``total_cents``: the cluster's own
    total for the month (None: the central holds no closed month of it).
    """

    cluster: str
    pulled_at: float | None
    stale_since: float | None
    error: str | None
    total_cents: int | None = None
    basis: str | None = None
    pools: list[dict[str, Any]] | None = None
    prices: dict[str, Any] | None = None
    # Whether the month held of it came with its hours (``billing.closed_hours``).
    hourly: bool = False

    @property
    def stale(self) -> bool:
        """Whether what the central holds of it may be behind: its pulls fail, or never ran."""
        return self.stale_since is not None or self.pulled_at is None


def central_statement(
    month: str, lines: pl.DataFrame, clusters: Sequence[ClusterState]
) -> dict[str, Any]:
    """One statement across clusters: every line with its cluster, totals per cluster and
    overall, and whether the lines add up to the clusters' own totals, to the cent."""
    per_cluster = {
        c: int(t) for c, t in lines.group_by("cluster").agg(pl.col("total_cents").sum()).iter_rows()
    }
    stated = sum(c.total_cents or 0 for c in clusters)
    total = int(lines["total_cents"].sum()) if lines.height else 0
    return {
        "month": month,
        "lines": lines.sort("cluster", "for_month", "team", "model").to_dicts(),
        "clusters": [
            {
                "cluster": c.cluster,
                "closed": c.total_cents is not None,
                "total_cents": per_cluster.get(c.cluster, 0),
                "stated_total_cents": c.total_cents,
                "basis": c.basis,
                "pools": c.pools or [],
                "stale": c.stale,
                "stale_since": c.stale_since,
                "pulled_at": c.pulled_at,
                "error": c.error,
            }
            for c in clusters
        ],
        "total_cents": total,
        "stated_total_cents": stated,
        "reconciles": total == stated,
        "stale_clusters": [c.cluster for c in clusters if c.stale],
    }


# The reconciliation's counts summed across hours, groups and clusters.
_TOKENS: Final = [
    c for c in KINDS["reconciliation"][0] if c not in ("month", "hour", "replica", "model")
]


def _reconciliation_summary(rows: pl.DataFrame) -> dict[str, Any]:
    """The reconciliation's counts summed over ``rows``, and the difference's share of what the
    engines counted (None when they counted nothing)."""
    sums = {c: int(rows[c].sum()) if rows.height else 0 for c in _TOKENS}
    engine = sums["engine_tokens"]
    return sums | {"difference_share": sums["difference_tokens"] / engine if engine else None}


def central_hours(
    month: str,
    hours: Mapping[str, pl.DataFrame],
    lines: pl.DataFrame,
    clusters: Sequence[ClusterState],
    with_rows: bool = True,
) -> dict[str, Any]:
    """The clusters' hours of ``month`` (``hours``: each kind's rows with their cluster), per
    cluster whether its hourly cost adds up to its own lines for the month (``lines``, the
    federated lines), its reconciliation summed and its instances' hours alive, and the
    reconciliation across clusters.

    A cluster whose month came without hours (an earlier version, or a month closed before
    hours were kept) is listed with ``hourly`` false: its lines are in the statement, not here.
    Without ``with_rows``, the figures only (a dashboard's summary): no hour's row.
    """
    own = lines.filter(pl.col("for_month") == month)
    states = []
    for c in clusters:
        cost = hours["cost"].filter(pl.col("cluster") == c.cluster)
        stated = int(own.filter(pl.col("cluster") == c.cluster)["total_cents"].sum())
        hourly = int(cost["total_cents"].sum()) if cost.height else 0
        states.append(
            {
                "cluster": c.cluster,
                "closed": c.total_cents is not None,
                "hourly": c.hourly,
                "hourly_cents": hourly,
                "own_month_cents": stated,
                "adds_up": (not c.hourly) or hourly == stated,
                "stale": c.stale,
                "stale_since": c.stale_since,
                "reconciliation": _reconciliation_summary(
                    hours["reconciliation"].filter(pl.col("cluster") == c.cluster)
                ),
                "instance_hours": float(
                    hours["lifetimes"]
                    .filter(pl.col("cluster") == c.cluster)["instance_hours"]
                    .sum()
                ),
            }
        )
    order = {
        "cost": ("cluster", "hour", "replica", "gpu_model"),
        "usage": ("cluster", "hour", "team", "model"),
        "reconciliation": ("cluster", "hour", "replica", "model"),
        "lifetimes": ("cluster", "hour", "replica", "model", "gpu_model"),
    }
    return {
        "month": month,
        "hours": {k: hours[k].sort(*order[k]).to_dicts() for k in KINDS} if with_rows else None,
        "clusters": states,
        "reconciliation": _reconciliation_summary(hours["reconciliation"]),
        "adds_up": all(s["adds_up"] for s in states),
        "stale_clusters": [c.cluster for c in clusters if c.stale],
    }


def central_focus(
    month: str, lines: pl.DataFrame, clusters: Sequence[ClusterState], config: Config
) -> pl.DataFrame:
    """The clusters' month as FOCUS 1.2 rows: each cluster's statement through ``focus_frame``,
    its teams as ``SubAccountId`` ``<cluster>/<team>`` and the cluster in ``x_Cluster``.

    Unit prices and SKUs are each cluster's price book's (as pulled with the month; the
    central's for a cluster that sent none). The cluster goes into the sub-account because the same team name in two clusters is two
    budgets (each cluster's own chargeback), and a FOCUS reader groups by SubAccountId; a tag
    would leave both under one sub-account.
    """
    frames = []
    for state in clusters:
        own = lines.filter(pl.col("cluster") == state.cluster).drop("cluster")
        if state.total_cents is None or own.height == 0:
            continue
        this_month = int(own.filter(pl.col("for_month") == month)["total_cents"].sum())
        pools = pl.DataFrame(state.pools, schema=POOL_SCHEMA) if state.pools else empty_pools()
        # The cluster's own price book gives the unit prices and SKUs, as its own file would.
        priced = (
            config
            if state.prices is None
            else config.model_copy(update={"prices": Prices.model_validate(state.prices)})
        )
        statement = Statement(
            month,
            True,
            own,
            this_month,
            state.total_cents - this_month,
            basis=state.basis or "list",
            pools=pools,
        )
        account = pl.format("{}/{}", pl.lit(state.cluster), pl.col("SubAccountId"))
        frames.append(
            focus_frame(statement, priced, "1.2").with_columns(
                account.alias("SubAccountId"),
                pl.format("{}/{}", pl.lit(state.cluster), pl.col("SubAccountName")).alias(
                    "SubAccountName"
                ),
                pl.lit(state.cluster).alias("x_Cluster"),
            )
        )
    if not frames:
        return focus_frame(
            Statement(month, True, pl.DataFrame(schema=LINE_SCHEMA), 0, 0), config, "1.2"
        ).with_columns(pl.lit(None, pl.String).alias("x_Cluster"))
    return pl.concat(frames, how="diagonal_relaxed")
