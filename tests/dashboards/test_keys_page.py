"""The keys page's pure parts: the form to billing's request, and billing's keys to the table."""

from __future__ import annotations

from typing import Any

import pytest

from dashboards.pages.keys import key_request, keys_frame, team_options
from dashboards.sessions import Session

LEAD = Session("token", "search", "search", False, person="lia@example.com")
ADMIN = Session("token", "@admin", None, True)


def test_a_team_key_takes_the_signed_in_team_when_none_is_picked() -> None:
    """A lead's member key is for their own team; empty fields are left out, days become seconds."""
    body = key_request(LEAD, None, "member", " rag ", "", 2, " why ")
    assert body == {
        "role": "member",
        "team": "search",
        "member": "rag",
        "reason": "why",
        "expires_in_seconds": 172_800.0,
    }


def test_a_role_key_names_no_team() -> None:
    """A finance key is of no team, whatever team the form still shows."""
    assert key_request(ADMIN, "search", "finance", None, None, None, None) == {
        "role": "finance",
        "reason": "",
    }


def test_keys_are_listed_newest_first_with_their_state() -> None:
    """Active, expired and revoked keys say so; the newest is first; times are the viewer's."""
    now = 1_800_000_000.0
    keys: list[dict[str, Any]] = [
        {
            "key_id": "a" * 12,
            "role": "member",
            "team": "search",
            "created_at": now - 300,
            "created_by": "lia@example.com",
            "expires_at": now - 1,
        },
        {
            "key_id": "b" * 12,
            "role": "finance",
            "team": None,
            "created_at": now - 100,
            "created_by": "@admin",
            "revoked_at": now - 50,
        },
        {
            "key_id": "c" * 12,
            "role": "lead",
            "team": "search",
            "created_at": now - 200,
            "created_by": "@admin",
            "member": "ana",
        },
    ]
    frame = keys_frame(keys, now, "Asia/Kolkata")
    assert frame["key_id"].to_list() == ["b" * 12, "c" * 12, "a" * 12]
    assert frame["state"].to_list() == ["revoked", "active", "expired"]
    assert frame["expires"].to_list()[1] == "never"
    assert frame["created"].to_list()[0] == "2027-01-15 13:28"


def test_an_expiry_that_is_not_a_positive_number_of_days_is_refused_not_never() -> None:
    """Half a day is half a day; 0, a negative, text or an infinity is refused with what to
    type: a number field handed the form nothing for them, and nothing meant "never"."""
    assert key_request(LEAD, None, "member", None, None, " 0.5 ", None)["expires_in_seconds"] == (
        43_200.0
    )
    assert "expires_in_seconds" not in key_request(LEAD, None, "member", None, None, "", None)
    for days in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match="not a positive number of days"):
            key_request(LEAD, None, "member", None, None, days, None)


def test_the_form_offers_a_team_its_own_name_only() -> None:
    """The admin picks any team; a lead's form offers its own team, not the others' names;
    signed out, none."""
    teams = ["search", "assistant", "research"]
    assert [o["value"] for o in team_options(ADMIN, teams)] == teams
    assert team_options(LEAD, teams) == [{"label": "search", "value": "search"}]
    assert team_options(None, teams) == []
