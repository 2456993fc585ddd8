"""Budget overrides in the ledger: what ingest keeps and refuses, and the admin's query."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from billing import queries
from billing.ledger import Ledger
from infermeter.records import MAX_OVERRIDE_REASON, BudgetOverride

NOW = time.time()


def override(**changes: Any) -> dict[str, Any]:
    """One valid override record, with ``changes``."""
    record = BudgetOverride("o-1", "search", "launch week", NOW + 3600, NOW, "small-0-a").to_json()
    return {**record, **changes}


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    """A ledger file knowing the teams search and assistant."""
    led = Ledger.open(tmp_path / "ledger.duckdb", ["search", "assistant"], {})
    yield led
    led.close()


def lines(*records: dict[str, Any]) -> bytes:
    """Records as NDJSON, as a spool segment holds them."""
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"team": "nobody"}, "unknown team"),
        ({"admin_reason": " "}, "admin_reason: empty"),
        ({"admin_reason": "x" * (MAX_OVERRIDE_REASON + 1)}, "longer than"),
        ({"until": NOW - 1}, "until is not after issued_at"),
        ({"issued_by": ""}, "issued_by: empty"),
    ],
)
def test_a_bad_override_is_refused_naming_why(ledger, changes, reason):
    """Each check refuses its record with its reason."""
    result = ledger.ingest_lines("budget_overrides", lines(override(**changes)), now=NOW)
    assert result.accepted == 0
    assert reason in result.rejected[0].reason


def test_the_admin_query_lists_overrides_newest_first_once_each(ledger):
    """A resent override is kept once; the query filters by team and sorts by issue time."""
    older = override(override_id="o-0", issued_at=NOW - 600, team="assistant")
    ledger.ingest_lines("budget_overrides", lines(older, override()), now=NOW)
    again = ledger.ingest_lines("budget_overrides", lines(override()), now=NOW)
    with ledger.reader() as cur:
        every = queries.run(cur, "budget_overrides", queries.params_from(NOW - 3600, NOW + 60))
        search = queries.run(
            cur, "budget_overrides", queries.params_from(NOW - 3600, NOW + 60, team="search")
        )
    assert again.duplicates == 1
    assert every["override_id"].to_list() == ["o-1", "o-0"]
    assert search["override_id"].to_list() == ["o-1"]
