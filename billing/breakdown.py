"""Attribution below the team: a statement's lines split by project and end user.

A line (one team and model in a month) is what the team owes; its requests name a project
(``X-Infermeter-Project``) and an end user (OpenAI's ``user`` field) or not, and billing keeps
their use per hour in ``usage_tags``. ``tag_split`` divides each line among the (project,
user) pairs of its team and model in proportion to their use under the statement's own
allocation rule:

- ``in_flight``: their in-flight seconds;
- ``tokens``: their weighted tokens (prompt, cached prompt and completion weights);
- ``requests``: their requests.

Cents and counts are split in whole units by largest remainder (``billing.rounding.split``), so
the rows of a line add up to it exactly, column by column: a project's or a user's cost is a
part of the team's, never a second estimate of it. Requests and tokens are split by the pairs'
own counts (exact whenever the line counts what ``usage_tags`` counts); GPU-hours and energy,
floats, in the rule's proportion. A line no tagged use stands behind (idle capacity, the
unattributed line, a team without records) is one row with no project and no user.

The rows (``BREAKDOWN_SCHEMA``): every column of ``infermeter.statement.LINE_SCHEMA`` and

- ``project``: the request's project tag, null when it carried none;
- ``user``: the end user, null when it named none, ``OTHER_USERS`` for the users of a team past
  its ``max_users`` (ranked by spend over the statement, ties by name), so a team that puts a
  fresh id on every request cannot make a statement unbounded.

The exporters (CSV, FOCUS) read these columns as they are; ``breakdown`` and
``project_spend`` are the glue that reads ``usage_tags`` from a ledger.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final, Literal

import polars as pl

from billing.ledger import Ledger
from billing.rounding import split
from billing.schema import HOUR_SECONDS
from infermeter.config import Config
from infermeter.months import month_bounds
from infermeter.statement import LINE_SCHEMA, Statement, for_team

__all__ = [
    "BREAKDOWN_SCHEMA",
    "DEFAULT_MAX_USERS",
    "OTHER_USERS",
    "TAG_SCHEMA",
    "Breakdowns",
    "ProjectSpends",
    "Rule",
    "breakdown",
    "month_tags",
    "project_spend",
    "tag_split",
    "with_tags",
]

Rule = Literal["in_flight", "tokens", "requests"]
OTHER_USERS: Final = "(other users)"
DEFAULT_MAX_USERS: Final = 1000
# A month's use per team, model, project and user (null: none given), as ``month_tags`` reads it.
TAG_SCHEMA: Final = {
    "for_month": pl.String,
    "team": pl.String,
    "model": pl.String,
    "project": pl.String,
    "user": pl.String,
    "requests": pl.Int64,
    "prompt_tokens": pl.Int64,
    "cached_prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "inflight_seconds": pl.Float64,
}
BREAKDOWN_SCHEMA: Final = {**LINE_SCHEMA, "project": pl.String, "user": pl.String}

_PARTS: Final = ("compute_cents", "energy_cents", "idle_cents")
_COUNTS: Final = ("requests", "prompt_tokens", "completion_tokens")
_FLOATS: Final = ("gpu_hours", "energy_kwh")
_Key = tuple[str, str, str]


def _split_signed(total: int, weights: Sequence[float]) -> list[int]:
    """``split`` for an amount of either sign (an adjustment line may be negative)."""
    parts = split(abs(total), weights)
    return parts if total >= 0 else [-p for p in parts]


def _rule_weight(tag: Mapping[str, Any], rule: Rule, weights: Mapping[str, float]) -> float:
    """What ``tag``'s use weighs under ``rule``."""
    if rule == "in_flight":
        return float(tag["inflight_seconds"])
    if rule == "requests":
        return float(tag["requests"])
    prompt, cached = int(tag["prompt_tokens"]), int(tag["cached_prompt_tokens"])
    cached_weight = weights.get("cached_prompt")
    if cached_weight is None:  # no discount for cache hits: every prompt token alike
        prompt_part = weights["prompt"] * prompt
    else:
        prompt_part = weights["prompt"] * max(0, prompt - cached) + cached_weight * cached
    return prompt_part + weights["completion"] * int(tag["completion_tokens"])


def _shares(
    tags: Sequence[Mapping[str, Any]], rule: Rule, weights: Mapping[str, float]
) -> list[float]:
    """The weights a line is split by: the rule's, else requests, else tokens; all zero when
    the tagged pairs used nothing at all."""
    for measure in (
        [_rule_weight(t, rule, weights) for t in tags],
        [float(t["requests"]) for t in tags],
        [float(t["prompt_tokens"] + t["completion_tokens"]) for t in tags],
    ):
        if sum(measure) > 0:
            return measure
    return [0.0] * len(tags)


def _split_line(
    line: Mapping[str, Any],
    tags: Sequence[Mapping[str, Any]],
    rule: Rule,
    weights: Mapping[str, float],
) -> list[dict[str, Any]]:
    """``line`` as rows per (project, user) of ``tags``; one untagged row when none used anything."""
    shares = _shares(tags, rule, weights) if tags else []
    if not shares or sum(shares) == 0:
        return [{**line, "project": None, "user": None}]
    rows: list[dict[str, Any]] = [
        {**line, "project": t["project"], "user": t["user"]} for t in tags
    ]
    for column in _PARTS:
        for row, part in zip(rows, _split_signed(int(line[column]), shares), strict=True):
            row[column] = part
    if int(line["total_cents"]) == sum(int(line[c]) for c in _PARTS):
        for row in rows:
            row["total_cents"] = sum(row[c] for c in _PARTS)
    else:  # a line whose total is not its parts' sum: its total split on its own
        for row, part in zip(rows, _split_signed(int(line["total_cents"]), shares), strict=True):
            row["total_cents"] = part
    for column in _COUNTS:
        own = [float(t[column]) for t in tags]
        by = own if sum(own) > 0 else shares
        for row, part in zip(rows, _split_signed(int(line[column]), by), strict=True):
            row[column] = part
    whole = sum(shares)
    for column in _FLOATS:
        for row, share in zip(rows, shares, strict=True):
            row[column] = float(line[column]) * share / whole
    return rows


def _fold_users(
    rows: list[dict[str, Any]], max_users: Mapping[str, int], default_max_users: int
) -> None:
    """Rename, in place, the users of each team past its bound to ``OTHER_USERS``."""
    spent: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        if row["user"] is not None:
            spent[row["team"]][row["user"]] += int(row["total_cents"])
    for team, users in spent.items():
        bound = max_users.get(team, default_max_users)
        if len(users) <= bound:
            continue
        ranked = sorted(users, key=lambda u: (-users[u], u))
        folded = set(ranked[bound:])
        for row in rows:
            if row["team"] == team and row["user"] in folded:
                row["user"] = OTHER_USERS


def tag_split(
    lines: pl.DataFrame,
    tags: pl.DataFrame,
    rule: Rule,
    weights: Mapping[str, float],
    max_users: Mapping[str, int] | None = None,
    default_max_users: int = DEFAULT_MAX_USERS,
) -> pl.DataFrame:
    """Each of ``lines`` (``LINE_SCHEMA``) split by project and user, as the module says.

    ``tags`` (``TAG_SCHEMA``): the use behind the lines, per month the line is for
    (``for_month``), team, model, project and user. ``weights``: ``prompt``, ``completion`` and
    optionally ``cached_prompt`` (the ``tokens`` rule). ``max_users``: the bound per team
    (``default_max_users`` for a team it does not name). Rows come in the lines' order, then by
    project and user (nulls first); a line's rows add up to it in every integer column.

    Columns of ``lines`` beyond ``LINE_SCHEMA`` (an export's ``instance``, a line type) are
    carried to each of the line's rows as they are, before ``project`` and ``user``; a line
    split by instance is split again by its team and model's use, which knows no instance.
    """
    by_key: dict[_Key, list[dict[str, Any]]] = defaultdict(list)
    for tag in tags.iter_rows(named=True):
        by_key[(tag["for_month"], tag["team"], tag["model"])].append(tag)
    extra = [c for c in lines.columns if c not in LINE_SCHEMA and c not in ("project", "user")]
    schema: dict[str, pl.DataType | type[pl.DataType]] = {
        **lines.select(extra).schema,
        **BREAKDOWN_SCHEMA,
    }
    order = [*lines.select(*LINE_SCHEMA, *extra).columns, "project", "user"]
    rows: list[dict[str, Any]] = []
    for index, line in enumerate(lines.select(*LINE_SCHEMA, *extra).iter_rows(named=True)):
        key = (line["for_month"], line["team"], line["model"])
        ordered = sorted(by_key.get(key, []), key=lambda t: (t["project"] or "", t["user"] or ""))
        rows += ({**row, "_line": index} for row in _split_line(line, ordered, rule, weights))
    _fold_users(rows, max_users or {}, default_max_users)
    if not rows:
        return pl.DataFrame(schema={c: schema[c] for c in order})
    frame = pl.DataFrame(rows, schema={**schema, "_line": pl.Int64})
    summed = (*_COUNTS, *_FLOATS, *_PARTS, "total_cents")
    kept = [c for c in order if c not in summed and c not in ("project", "user")]
    return (
        frame.group_by("_line", "project", "user", maintain_order=True)
        .agg(pl.col(*summed).sum(), pl.col(*kept).first())
        .sort("_line", "project", "user", nulls_last=False, maintain_order=True)
        .select(order)
        .cast(schema)  # type: ignore[arg-type]
    )


def month_tags(
    ledger: Ledger, months: Iterable[str], teams: Iterable[str] | None = None, by_user: bool = True
) -> pl.DataFrame:
    """``usage_tags`` summed over each of ``months`` (``TAG_SCHEMA``), for ``teams`` only when
    given (a team's view reads no other team's rows); ``by_user`` False sums the users of a
    project together (user null)."""
    wanted = None if teams is None else sorted(set(teams))
    parts = []
    with ledger.reader() as cur:
        for month in sorted(set(months)):
            start, end = month_bounds(month)
            sql = """
SELECT $month AS for_month, team, model, nullif(project, '') AS project, {user} AS "user",
    sum(requests)::BIGINT, sum(prompt_tokens)::BIGINT, sum(cached_prompt_tokens)::BIGINT,
    sum(completion_tokens)::BIGINT, sum(inflight_seconds)
FROM usage_tags
WHERE hour >= $lo AND hour < $hi AND (CAST($teams AS VARCHAR[]) IS NULL OR list_contains($teams, team))
GROUP BY ALL""".format(user="""nullif("user", '')""" if by_user else "NULL::VARCHAR")
            params = {
                "month": month,
                "lo": int(start // HOUR_SECONDS),
                "hi": int(end // HOUR_SECONDS),
                "teams": wanted,
            }
            parts.append(
                pl.DataFrame(cur.execute(sql, params).fetchall(), schema=TAG_SCHEMA, orient="row")
            )
    if not parts:
        return pl.DataFrame(schema=TAG_SCHEMA)
    return pl.concat(parts)


def _split_of(config: Config) -> tuple[Rule, dict[str, float]]:
    b = config.billing
    return b.allocation, {k: float(v) for k, v in b.token_weights.model_dump().items()}


def with_tags(ledger: Ledger, statement: Statement, config: Config) -> Statement:
    """``statement`` with its lines split by project and end user for the exports, when the
    requests of its months named any; as it is otherwise (the CSV then has no project, FOCUS
    no project or user tag). Extra columns (an instance split's) are kept on every row."""
    lines = statement.lines
    if lines.height == 0:
        return statement
    tags = month_tags(ledger, lines["for_month"].to_list(), sorted(set(lines["team"].to_list())))
    if tags.filter(pl.col("project").is_not_null() | pl.col("user").is_not_null()).height == 0:
        return statement
    rule, weights = _split_of(config)
    split = tag_split(lines, tags, rule, weights, {t.name: t.max_users for t in config.teams})
    return replace(statement, lines=split)


def breakdown(ledger: Ledger, statement: Statement, config: Config) -> pl.DataFrame:
    """``statement``'s lines split by project and user (``BREAKDOWN_SCHEMA``), with the
    ledger's ``usage_tags`` of the months its lines are for and the configuration's rule."""
    lines = statement.lines
    teams = sorted(set(lines["team"].to_list()))
    tags = month_tags(ledger, lines["for_month"].to_list(), teams)
    rule, weights = _split_of(config)
    bounds = {t.name: t.max_users for t in config.teams}
    return tag_split(lines, tags, rule, weights, bounds)


def project_spend(
    ledger: Ledger, statement: Statement, config: Config
) -> dict[str, dict[str, float]]:
    """Month-to-date USD per project of each team that budgets its projects, from ``statement``.

    Only those teams' rows are read, so a fleet without project budgets pays nothing for it.
    Every project such a team used is present, and every one it budgets (0 when unused).
    """
    budgeted = {t.name: t for t in config.teams if t.project_budgets_usd_per_month}
    lines = statement.lines.filter(pl.col("team").is_in(list(budgeted)))
    out = {
        team: dict.fromkeys(t.project_budgets_usd_per_month, 0.0) for team, t in budgeted.items()
    }
    if lines.height == 0:
        return out
    # By project alone: the users' split would only be summed again.
    tags = month_tags(ledger, lines["for_month"].to_list(), budgeted, by_user=False)
    rule, weights = _split_of(config)
    rows = tag_split(lines, tags, rule, weights)
    cents = (
        rows.filter(pl.col("project").is_not_null())
        .group_by("team", "project")
        .agg(pl.col("total_cents").sum())
    )
    for team, project, total in cents.iter_rows():
        out[team][project] = int(total) / 100
    return out


class ProjectSpends:
    """``project_spend`` of each statement computed once: the sidecars of a fleet all read
    ``/v1/spend``, which answers from one cached statement until it is recomputed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The statement and configuration it was computed for, held so that neither is taken
        # for another object that later gets its address.
        self._last: tuple[Statement, Config, dict[str, dict[str, float]]] | None = None

    def of(
        self, ledger: Ledger, statement: Statement, config: Config
    ) -> dict[str, dict[str, float]]:
        """``project_spend(ledger, statement, config)``, reused while both are the same objects."""
        with self._lock:
            last = self._last
        if last is not None and last[0] is statement and last[1] is config:
            return last[2]
        found = project_spend(ledger, statement, config)
        with self._lock:
            self._last = (statement, config, found)
        return found


class Breakdowns:
    """``breakdown`` of each statement and team computed once, the last ``entries`` kept: every
    signed-in dashboard asks for the month's rows at each refresh, from one cached statement."""

    def __init__(self, entries: int = 16) -> None:
        self._lock = threading.Lock()
        self._entries = entries
        # By (statement, configuration, team), holding both objects so that neither is taken
        # for another object that later gets its address.
        self._kept: OrderedDict[
            tuple[int, int, str | None], tuple[Statement, Config, pl.DataFrame]
        ] = OrderedDict()

    def of(
        self, ledger: Ledger, statement: Statement, config: Config, team: str | None
    ) -> pl.DataFrame:
        """``breakdown`` of ``statement`` as ``team`` sees it (None: every team)."""
        key = (id(statement), id(config), team)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and kept[0] is statement and kept[1] is config:
                self._kept.move_to_end(key)
                return kept[2]
        found = breakdown(ledger, for_team(statement, team), config)
        with self._lock:
            self._kept[key] = (statement, config, found)
            while len(self._kept) > self._entries:
                self._kept.popitem(last=False)
        return found
