"""Projects and end users: checked by the sidecar, carried on the record, budgeted per project."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.ledger import Ledger
from sidecar.tags import MAX_USER_CHARS, PROJECT_HEADER
from tests.servers import serving
from tests.sidecar.conftest import StackFactory
from tests.sidecar.test_budgets import FakeSpend, wait_for

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROJECTS = {
    "teams.0.projects": ["alpha", "beta"],
    "teams.0.project_pattern": "exp-[0-9]+",
    "teams.0.project_budgets_usd_per_month": {"beta": 5.0},
}


def _error(r: Any) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


@pytest.mark.parametrize(
    ("team", "headers", "body", "param", "code"),
    [
        ("search", {PROJECT_HEADER: "gamma"}, {}, PROJECT_HEADER, "invalid_project"),
        ("search", {PROJECT_HEADER: "exp-1x"}, {}, PROJECT_HEADER, "invalid_project"),
        ("assistant", {PROJECT_HEADER: "alpha"}, {}, PROJECT_HEADER, "invalid_project"),
        ("search", {PROJECT_HEADER: "exp-" + "1" * 125}, {}, PROJECT_HEADER, "invalid_project"),
        ("search", {}, {"user": "u" * (MAX_USER_CHARS + 1)}, "user", "invalid_user"),
        ("search", {}, {"user": "line\nbreak"}, "user", "invalid_user"),
        ("search", {}, {"user": 42}, "user", "invalid_user"),
    ],
)
async def test_a_project_the_team_does_not_allow_or_a_bad_user_is_an_openai_400_before_vllm(
    stack_factory: StackFactory,
    team: str,
    headers: dict[str, str],
    body: dict[str, Any],
    param: str,
    code: str,
) -> None:
    """An unknown project (or one for a team without projects, or one the pattern matches but
    longer than a name may be) and an oversized, unprintable or non-string user are refused 400
    naming the header or field; vLLM sees no request."""
    stack = await stack_factory(**PROJECTS)
    async with stack.client(team) as c:
        r = await c.post("/v1/chat/completions", json=CHAT | body, headers=headers)
    assert r.status_code == 400
    error = _error(r)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert stack.sim.finished_requests == 0
    assert (await stack.records())[-1]["status"] == "bad_request"


async def test_the_user_and_an_allowed_project_are_on_the_usage_record_and_in_the_ledger(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    """A listed or pattern-matched project and the body's user land on the usage record, and
    billing keeps them from the spool's lines as the sidecar wrote them."""
    stack = await stack_factory(**PROJECTS)
    async with stack.client() as c:
        listed = await c.post(
            "/v1/chat/completions",
            json=CHAT | {"user": "ana@example.com"},
            headers={PROJECT_HEADER: "alpha"},
        )
        matched = await c.post(
            "/v1/chat/completions", json=CHAT | {"stream": True}, headers={PROJECT_HEADER: "exp-7"}
        )
        plain = await c.post("/v1/chat/completions", json=CHAT)
    assert [r.status_code for r in (listed, matched, plain)] == [200, 200, 200]
    tags = [(r["user"], r["project"], r["status"]) for r in (await stack.records())]
    assert tags == [("ana@example.com", "alpha", "ok"), (None, "exp-7", "ok"), (None, None, "ok")]
    body = b"".join(p.read_bytes() for p in sorted(stack.spool.glob("seg-*.jsonl")))
    ledger = Ledger.open(tmp_path / "ledger.duckdb", ["search", "assistant"], {})
    try:
        assert ledger.ingest_lines("usage", body).accepted == 3
        with ledger.reader() as cur:
            kept = cur.execute(
                'SELECT project, "user", sum(requests) FROM usage_tags GROUP BY ALL ORDER BY ALL'
            ).fetchall()
    finally:
        ledger.close()
    assert kept == [("", "", 1), ("alpha", "ana@example.com", 1), ("exp-7", "", 1)]


async def test_a_project_past_its_budget_is_refused_while_the_team_and_its_other_projects_are_not(
    stack_factory: StackFactory,
) -> None:
    """Billing's spend says project beta reached its $5 budget: beta's requests get 429
    budget_exceeded at the next refresh; alpha's and untagged requests of the team still pass."""
    spend = FakeSpend()
    projects: dict[str, float] = {}

    async def handle(scope: Any, receive: Any, send: Any) -> None:
        rows = [
            {
                "team": t,
                "month": "2026-12",
                "spent_usd": s,
                "budget_usd": 100.0,
                "forecast_usd": s,
                "projects": projects,
            }
            for t, s in spend.spent.items()
        ]
        from starlette.responses import JSONResponse

        await JSONResponse(rows)(scope, receive, send)

    async with serving(handle, lifespan="off") as billing:
        stack = await stack_factory(
            **PROJECTS,
            **{
                "sidecar.budgets": {"spend_url": billing, "refresh_seconds": 0.1},
                "teams.0.budget_usd_per_month": 100.0,
            },
        )
        async with stack.client() as c:
            spend.spent["search"] = 10.0
            projects["beta"] = 5.0

            async def refused() -> bool:
                r = await c.post(
                    "/v1/chat/completions", json=CHAT, headers={PROJECT_HEADER: "beta"}
                )
                return bool(r.status_code == 429)

            await wait_for(refused)
            beta = await c.post("/v1/chat/completions", json=CHAT, headers={PROJECT_HEADER: "beta"})
            alpha = await c.post(
                "/v1/chat/completions", json=CHAT, headers={PROJECT_HEADER: "alpha"}
            )
            untagged = await c.post("/v1/chat/completions", json=CHAT)
    assert beta.status_code == 429
    assert _error(beta)["code"] == "budget_exceeded"
    assert "Project beta of team search" in _error(beta)["message"]
    assert [alpha.status_code, untagged.status_code] == [200, 200]
    assert (await stack.records())[-3]["project"] == "beta"
    assert (await stack.records())[-3]["status"] == "rate_limited"


def test_spend_from_a_billing_without_projects_refuses_no_project() -> None:
    """A spend answer of the previous version (no ``projects``) leaves every project unbudgeted."""
    from sidecar.budgets import parse_project_spend

    assert parse_project_spend([{"team": "a", "spent_usd": 1.0}]) == {}
    assert parse_project_spend([{"team": "a", "spent_usd": 1.0, "projects": {"x": 2}}]) == {
        "a": {"x": 2.0}
    }


async def test_the_span_carries_the_end_user_and_the_project(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    """enduser.id and infermeter.project on the request's span; a request naming neither has
    neither attribute."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sidecar.app import Sidecar
    from tests.sidecar.conftest import make_config

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = await stack_factory()
    config = make_config(stack.upstream, **PROJECTS)
    traced = Sidecar(config, "small-0", spool_dir=tmp_path / "traced", tracer_provider=provider)
    async with serving(traced) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        auth = {"authorization": "Bearer im-demo-search"}
        await c.post(
            "/v1/chat/completions",
            json=CHAT | {"user": "ana"},
            headers=auth | {PROJECT_HEADER: "beta"},
        )
        await c.post("/v1/chat/completions", json=CHAT, headers=auth)
    tagged, plain = (dict(s.attributes or {}) for s in exporter.get_finished_spans())
    assert (tagged["enduser.id"], tagged["infermeter.project"]) == ("ana", "beta")
    assert "enduser.id" not in plain
    assert "infermeter.project" not in plain
