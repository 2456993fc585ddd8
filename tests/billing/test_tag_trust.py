"""A usage record's project and user are the ones the sidecar would have let a request carry.

Any pod holding a sidecar's writer credential can write usage records with any tags: unchecked,
one such pod could open thousands of projects under a team, each a row of its statement's
breakdown and of the exports. Billing applies the sidecar's own rules (``infermeter.tags``) at
ingest: a record whose project its team does not allow, or whose user the sidecar would refuse,
is quarantined with the reason (kept, counted, on the statement, billed under no tag). Real
billing on loopback, over a ledger opened as the service opens it, written to with an
instance's credential.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import duckdb
import httpx
import orjson
import pytest

from billing.ledger import Ledger
from billing.quarantine import refused_tags
from billing.serve import open_ledger
from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.months import month_of
from infermeter.tags import MAX_USER_CHARS, project_rules
from sidecar.tags import PROJECT_HEADER, TagRefusal, project_of, user_of
from tests.security.writers import (
    ADMIN,
    COLLECTOR_B,
    SMALL_0,
    billing,
    gpu,
    post,
    quarantined_total,
    usage,
)

# search allows two listed projects and those its pattern matches whole; assistant none.
PROJECTS = {
    "INFERMETER__TEAMS__SEARCH__PROJECTS": "[alpha, beta]",
    "INFERMETER__TEAMS__SEARCH__PROJECT_PATTERN": r"exp-\d+",
}


def projects_config(**environ: str) -> Config:
    """The demo configuration with search's projects (``PROJECTS``), and ``environ`` over it."""
    return load_config(DEFAULT_CONFIG, environ=PROJECTS | environ)


@pytest.fixture
def config() -> Config:
    """The demo configuration, search with projects."""
    return projects_config()


@pytest.fixture
def ledger(config: Config) -> Iterator[Ledger]:
    """An in-memory ledger opened as the billing service opens it (``open_ledger``)."""
    led = open_ledger(config, ":memory:")
    yield led
    led.close()


@pytest.fixture
async def url(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """Billing on loopback, holding the writer secret small-0's credential derives from."""
    async with billing(config, ledger) as base:
        yield base


def _ids(answer: httpx.Response, key: str) -> list[str]:
    return [r["id"] for r in answer.json()[key]]


def _quarantine(ledger: Ledger) -> list[tuple[str, str | None, str | None]]:
    """Each quarantined record's (label, project, user)."""
    with ledger.reader() as cur:
        rows = cur.execute("SELECT label, record FROM quarantine ORDER BY record_id").fetchall()
    return [(label, orjson.loads(r)["project"], orjson.loads(r)["user"]) for label, r in rows]


def _kept_tags(ledger: Ledger) -> set[tuple[str, str | None]]:
    with ledger.reader() as cur:
        return set(cur.execute("SELECT team, project FROM usage").fetchall())


@pytest.mark.parametrize(
    ("team", "project", "refused"),
    [
        ("search", "alpha", False),
        ("search", "exp-12", False),
        ("search", "exp-", True),
        ("search", "exp-1" + "2" * 200, True),  # matched, but longer than a name may be
        ("assistant", "alpha", True),  # uses no projects
        ("nobody", "alpha", True),
    ],
)
def test_refused_tags_names_the_pairs_and_users_the_sidecar_would_refuse(
    config: Config, team: str, project: str, refused: bool
) -> None:
    """The pure verdict over a transaction's distinct tags; without rules, no project refused."""
    rules = project_rules(config)
    assert refused_tags(rules, [(team, project)], ["ana", ""]) == (
        [(team, project)] if refused else [],
        [""],
    )
    assert refused_tags(None, [(team, project)], []) == ([], [])


async def test_a_project_the_team_does_not_allow_is_quarantined_and_on_no_statement_row(
    ledger: Ledger, url: str
) -> None:
    """Listed and matched projects are kept; a project search does not allow, and any project of
    a team that uses none, are quarantined with the reason, counted, shown on the statement, and
    on no row of its lines, breakdown or raw usage."""
    listed, matched, plain = usage(project="alpha"), usage(project="exp-7"), usage()
    forged = [usage(project=f"forged-{i}") for i in range(3)]
    other_team = usage(team="assistant", project="alpha")
    records = [listed, *forged, matched, other_team, plain]
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, url, "usage", records, SMALL_0)
        assert (await post(client, url, "gpu_samples", [gpu()], COLLECTOR_B)).status_code == 200
        counted = await quarantined_total(client, url)
        month = month_of(time.time())
        statement = (await client.get(f"{url}/v1/chargeback/{month}", headers=ADMIN)).json()
        breakdown = await client.get(f"{url}/v1/chargeback/{month}/breakdown", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["accepted"], body["rejected"]) == (3, [])
    assert _ids(answer, "quarantined") == [r["request_id"] for r in [*forged, other_team]]
    assert [q["reason"] for q in body["quarantined"]] == [
        'project "forged-0" is not one team "search" allows',
        'project "forged-1" is not one team "search" allows',
        'project "forged-2" is not one team "search" allows',
        'project "alpha" is not one team "assistant" allows',
    ]
    assert counted == {("usage", "project_not_allowed"): 4.0}
    assert {"kind": "usage", "reason": "project_not_allowed", "records": 4} in statement[
        "quarantined"
    ]
    assert _kept_tags(ledger) == {("search", "alpha"), ("search", "exp-7"), ("search", None)}
    assert sum(ln["requests"] for ln in statement["lines"] if ln["team"] == "search") == 3
    assert all(ln["team"] != "assistant" or ln["requests"] == 0 for ln in statement["lines"])
    assert breakdown.status_code == 200, breakdown.text
    rows = {(r["team"], r["project"]) for r in breakdown.json()["rows"]}
    assert ("search", "alpha") in rows
    assert rows <= {("search", "alpha"), ("search", "exp-7"), ("search", None), ("platform", None)}
    with ledger.reader() as cur:
        tagged = cur.execute("SELECT DISTINCT team, project FROM usage_tags").fetchall()
    assert set(tagged) == {("search", "alpha"), ("search", "exp-7"), ("search", "")}


@pytest.mark.parametrize(
    ("pattern", "project", "python", "re2"),
    [
        # Python's \w is any Unicode word character, RE2's (DuckDB's regexp functions) ASCII
        # only; "é" reaches the sidecar in a header (read as Latin-1) and the record as sent.
        (r"proj-\w+", "proj-caf\u00e9", True, False),
        # A lookahead: Python has it, RE2 cannot compile the pattern.
        (r"(?!admin)[a-z]+", "ranking", True, None),
        (r"(?!admin)[a-z]+", "admins", False, None),
    ],
)
def test_a_pattern_is_judged_as_python_reads_it_as_the_sidecar_does(
    pattern: str, project: str, python: bool, re2: bool | None
) -> None:
    """Billing keeps a project exactly when the sidecar lets a request carry it, for patterns
    that DuckDB's RE2 reads otherwise, or cannot read."""
    config = projects_config(INFERMETER__TEAMS__SEARCH__PROJECT_PATTERN=pattern)
    with duckdb.connect() as con:
        try:
            row = con.execute("SELECT regexp_full_match(?, ?)", [project, pattern]).fetchone()
            read: bool | None = bool(row and row[0])
        except duckdb.Error:
            read = None
    assert read is re2  # what RE2 would have said
    headers = [(PROJECT_HEADER.lower().encode(), project.encode("latin-1"))]
    try:
        sidecar = project_of(project_rules(config), "search", headers) == project
    except TagRefusal:
        sidecar = False
    ledger = open_ledger(config, ":memory:")
    try:
        result = ledger.ingest_lines("usage", _lines([usage(project=project)]))
    finally:
        ledger.close()
    assert (sidecar, result.accepted == 1, not result.quarantined) == (python,) * 3


@pytest.mark.parametrize(
    "user",
    ["", "x" * (MAX_USER_CHARS + 1), "ana\n", "ana\x00", "ana\u200b"],
    ids=["empty", "over-long", "newline", "nul", "zero-width space"],
)
def test_a_user_the_sidecar_would_refuse_is_quarantined(ledger: Ledger, user: str) -> None:
    """An empty, over-long or non-printable user is quarantined as ``bad_user``; the rest kept."""
    with pytest.raises(TagRefusal):
        user_of({"user": user})
    good = [usage(user="ana@example.com"), usage(user="x" * MAX_USER_CHARS)]
    bad = usage(user=user)
    result = ledger.ingest_lines("usage", _lines([good[0], bad, good[1]]))
    assert (result.accepted, result.rejected) == (2, [])
    assert [(q.id, q.reason) for q in result.quarantined] == [
        (bad["request_id"], f"user: not a string of 1 to {MAX_USER_CHARS} printable characters")
    ]
    assert _quarantine(ledger) == [("bad_user", None, user)]


def test_the_records_checked_one_by_one_are_judged_alike(ledger: Ledger) -> None:
    """A batch with a record of the wrong type (checked inside DuckDB from its JSON text) keeps
    the allowed tags and quarantines the others the same way."""
    wrong = usage(prompt_tokens="100")
    kept = usage(project="exp-12", user="ana")
    forged, nameless = usage(project="nope"), usage(user="")
    result = ledger.ingest_lines("usage", _lines([wrong, kept, forged, nameless]))
    assert result.accepted == 1
    assert [r.id for r in result.rejected] == [wrong["request_id"]]
    assert [q.id for q in result.quarantined] == [forged["request_id"], nameless["request_id"]]
    assert sorted(_quarantine(ledger)) == [
        ("bad_user", None, ""),
        ("project_not_allowed", "nope", None),
    ]
    assert _kept_tags(ledger) == {("search", "exp-12")}


def test_a_batch_of_thousands_of_fresh_projects_opens_no_project(ledger: Ledger) -> None:
    """5,000 records, each with a project of its own, are all quarantined in one batch."""
    records = [usage(project=f"p-{i}", user=f"u-{i}") for i in range(5000)]
    result = ledger.ingest_lines("usage", _lines(records))
    assert (result.accepted, len(result.quarantined)) == (0, 5000)
    assert _kept_tags(ledger) == set()


@pytest.mark.parametrize(
    ("status", "label"),
    [("ok", "unknown_team"), ("unauthorized", "project_not_allowed")],
)
def test_a_team_unknown_to_billing_allows_no_project(
    ledger: Ledger, status: str, label: str
) -> None:
    """A charged record of an unknown team is quarantined as that; an audit record of one (no
    team check) carrying a project is quarantined for the project, which no sidecar writes."""
    result = ledger.ingest_lines(
        "usage", _lines([usage(team="nobody", status=status, project="a")])
    )
    assert result.accepted == 0
    assert [label for label, _, _ in _quarantine(ledger)] == [label]


def test_a_reload_judges_the_next_batch_by_the_new_rules(ledger: Ledger) -> None:
    """A project allowed by a reload is kept from then on; one the reload removes is
    quarantined from then on."""
    first = ledger.ingest_lines("usage", _lines([usage(project="gamma"), usage(project="beta")]))
    new = projects_config(INFERMETER__TEAMS__SEARCH__PROJECTS="[alpha, gamma]")
    ledger.reconfigure([t.name for t in new.teams], {}, projects=project_rules(new))
    second = ledger.ingest_lines("usage", _lines([usage(project="gamma"), usage(project="beta")]))
    assert [q.reason for q in first.quarantined] == [
        'project "gamma" is not one team "search" allows'
    ]
    assert [q.reason for q in second.quarantined] == [
        'project "beta" is not one team "search" allows'
    ]
    assert (first.accepted, second.accepted) == (1, 1)


def test_a_ledger_not_told_the_projects_keeps_them_and_still_judges_users(config: Config) -> None:
    """A ledger opened by a tool without the teams' rules checks no project; the user rule
    needs no configuration and holds there too."""
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    try:
        result = ledger.ingest_lines(
            "usage", _lines([usage(project="anything"), usage(user="a\tb")])
        )
    finally:
        ledger.close()
    assert result.accepted == 1
    assert [q.reason.split(":")[0] for q in result.quarantined] == ["user"]


def _lines(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)
