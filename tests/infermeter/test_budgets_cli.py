"""``infermeter budgets`` against a real billing on loopback: list, override, revoke."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from infermeter.budgets_cli import override_state
from launcher.cli import main
from tests.billing.conftest import batch, gpu_samples, usage
from tests.conftest import config_ledger
from tests.infermeter.conftest import billing_over


async def budgets(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["budgets", "--billing-url", url, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def listed(out: str) -> dict[str, list[str]]:
    """``budgets list``'s rows by team, each its cells (the override's two words as one)."""
    [header, *rows] = out.splitlines()
    assert header.split() == ["team", "spent_usd", "budget_usd", "used", "override", "reason"]
    cells = {}
    for row in rows:
        team, spent, budget, used, *rest = row.split()
        override = " ".join(rest[:2]) if rest[0] != "-" else "-"
        cells[team] = [spent, budget, used, override, " ".join(rest[2 if override != "-" else 1 :])]
    return cells


async def test_an_override_then_its_revocation_as_billing_serves_them(billing, capsys, monkeypatch):
    """``override --for 2h``: billing's spend carries it for search, ``list`` shows its end;
    ``revoke``: the last grant is a revocation, and ``list`` says so; other teams have none."""
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", "im-demo-admin")
    before = time.time()
    code, _, err = await budgets(
        capsys, billing, "override", "--team", "search", "--for", "2h", "--reason", "launch week"
    )
    assert code == 0, err
    assert "team search may pass its budget until" in err
    async with httpx.AsyncClient(base_url=billing) as client:
        rows = (
            await client.get("/v1/spend", headers={"authorization": "Bearer im-demo-admin"})
        ).json()
    [served] = [row["override"] for row in rows if "override" in row]
    assert before + 7200 <= served["until"] <= time.time() + 7200
    assert served["reason"] == "launch week"
    code, out, _ = await budgets(capsys, billing, "list")
    assert code == 0
    shown = listed(out)
    assert shown["search"][1:] == [
        "6000.00",
        "0.0%",
        f"until {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime(served['until']))}",
        "launch week",
    ]
    assert {team for team, cells in shown.items() if cells[3] != "-"} == {"search"}

    code, _, err = await budgets(
        capsys, billing, "revoke", "--team", "search", "--reason", "granted by mistake"
    )
    assert code == 0, err
    assert "team search has no override from now on" in err
    code, out, _ = await budgets(capsys, billing, "list")
    assert listed(out)["search"][3].startswith("revoked ")
    assert listed(out)["search"][4] == "granted by mistake"


async def test_a_refusal_is_one_line_with_billing_s_reason(billing, capsys, monkeypatch):
    """Past a month, a team key instead of the admin's, no token, a bad duration: exit 2 and
    one line, nothing granted."""
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", "im-demo-admin")
    args = ("override", "--team", "search", "--reason", "x", "--for")
    code, _, err = await budgets(capsys, billing, *args, "32d")
    assert code == 2
    assert "billing refused: HTTP 400: minutes:" in err
    monkeypatch.setenv("INFERMETER_TOKEN", "im-demo-search")
    code, _, err = await budgets(capsys, billing, *args, "1h")
    assert code == 2
    assert "billing refused: HTTP 403" in err
    monkeypatch.delenv("INFERMETER_TOKEN")
    monkeypatch.delenv("INFERMETER_ADMIN_TOKEN")
    code, _, err = await budgets(capsys, billing, *args, "1h")
    assert code == 2
    assert "set $INFERMETER_TOKEN to the admin token" in err
    with pytest.raises(SystemExit) as exited:
        await budgets(capsys, billing, *args, "soon")
    assert exited.value.code == 2
    assert "a duration such as" in capsys.readouterr().err
    async with httpx.AsyncClient(base_url=billing) as client:
        rows = (
            await client.get("/v1/spend", headers={"authorization": "Bearer im-demo-admin"})
        ).json()
    assert [row for row in rows if "override" in row] == []


@pytest.mark.parametrize(
    ("override", "state"),
    [
        (None, "-"),
        ({"until": 2000.0, "issued_at": 900.0, "reason": "r"}, "until 1970-01-01T00:33Z"),
        ({"until": 950.0, "issued_at": 900.0, "reason": "r"}, "ended 1970-01-01T00:15Z"),
        ({"until": 900.0, "issued_at": 900.0, "reason": "r"}, "revoked 1970-01-01T00:15Z"),
    ],
)
def test_override_state(override, state):
    """In force until its end; a grant of 0 minutes is a revocation; one that ran out ended."""
    row = {"team": "search"} | ({"override": override} if override else {})
    assert override_state(row, 1000.0) == state


@pytest.fixture
async def priced_billing(config, tmp_path):
    """Billing over a ledger that holds this month's last ten minutes of one GPU's samples
    and two teams' requests in them, their budgets a few cents, so ``list`` shows a
    share of each spent (assistant's past its budget)."""
    budgets = {"search": 0.5, "assistant": 0.04}
    config = config.model_copy(
        update={
            "teams": [
                t.model_copy(update={"budget_usd_per_month": budgets[t.name]})
                if t.name in budgets
                else t
                for t in config.teams
            ]
        }
    )
    now = time.time()
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    ledger.ingest(batch("gpu_samples", gpu_samples(start=now - 700, seconds=600)), now=now)
    ledger.ingest(
        batch("usage", [usage("search", now - 650, 300), usage("assistant", now - 600, 100)]),
        now=now,
    )
    async with billing_over(config, ledger) as url:
        yield url


async def test_list_shows_each_team_s_spend_against_its_budget(priced_billing, capsys, monkeypatch):
    """Spent and used as billing's month-to-date spend gives them: the share of the budget
    (past 100% when the team is over it), none for a team without a budget."""
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", "im-demo-admin")
    async with httpx.AsyncClient(base_url=priced_billing) as client:
        rows = (
            await client.get("/v1/spend", headers={"authorization": "Bearer im-demo-admin"})
        ).json()
    spend = {row["team"]: row for row in rows}
    assert spend["search"]["spent_usd"] > 0
    assert spend["assistant"]["spent_usd"] > 0
    code, out, err = await budgets(capsys, priced_billing, "list")
    assert code == 0, err
    shown = listed(out)
    for team in ("search", "assistant"):
        row = spend[team]
        assert shown[team][0] == f"{row['spent_usd']:.2f}"
        assert shown[team][2] == f"{100 * row['spent_usd'] / row['budget_usd']:.1f}%"
    assert (shown["search"][1], shown["assistant"][1]) == ("0.50", "0.04")
    assert (
        0 < float(shown["search"][2].rstrip("%")) < 100 < float(shown["assistant"][2].rstrip("%"))
    )
    assert shown["research"][:3] == ["0.00", "2000.00", "0.0%"]
