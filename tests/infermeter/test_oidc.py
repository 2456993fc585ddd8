"""Single sign-on's pure parts: groups to a caller, and the configuration's checks with their messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infermeter.auth import ADMIN, FINANCE, VIEWER, Caller
from infermeter.config import DEFAULT_CONFIG, ConfigError, load_config
from infermeter.oidc import Unmapped, caller_for_groups, groups_of, looks_like_jwt, person_of

MAPPING = {
    "ops": "admin",
    "money": "finance",
    "auditors": "viewer",
    "search-leads": "lead:search",
    "search": "member:search",
    "analytics": "member:analytics",
}


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        (["ops"], Caller(ADMIN, person="p")),
        (["money"], Caller(FINANCE, person="p")),
        (["auditors", "search"], Caller(VIEWER, person="p")),
        (["search"], Caller("search", person="p")),
        (["search", "search-leads", "unrelated"], Caller("search", lead=True, person="p")),
        (["search", "ops"], Caller(ADMIN, person="p")),
    ],
)
def test_groups_map_to_the_strongest_role(groups: list[str], expected: Caller) -> None:
    """A person gets the strongest role their mapped groups give; unmapped groups add nothing."""
    assert caller_for_groups(groups, MAPPING, "p") == expected


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([], r"none of your groups \(none\) is given a role here"),
        (["marketing"], r"none of your groups \(marketing\) is given a role here"),
        (["search", "analytics"], r"more than one team \(analytics, search\)"),
    ],
)
def test_groups_that_give_no_single_role_are_refused(groups: list[str], message: str) -> None:
    """No mapped group, or groups naming two teams, is a refusal that says which."""
    with pytest.raises(Unmapped, match=message):
        caller_for_groups(groups, MAPPING, "p")


def test_claims_read_as_idps_send_them() -> None:
    """Groups may be a list or one string; the person is the e-mail, else user name, else subject."""
    assert groups_of({"groups": ["a", 3, "b"]}, "groups") == ["a", "b"]
    assert groups_of({"roles": "a"}, "roles") == ["a"]
    assert groups_of({}, "groups") == []
    assert person_of({"sub": "s1", "preferred_username": "ana"}) == "ana"
    assert person_of({"sub": "s1", "email": "ana@example.com"}) == "ana@example.com"
    assert person_of({"sub": "s1"}) == "s1"


def test_a_jwt_is_told_from_an_api_key() -> None:
    """Only a three-part token starting like a JSON header is taken for an ID token."""
    assert looks_like_jwt("eyJhbGciOi.eyJzdWIi.c2ln")
    assert not looks_like_jwt("imk_k3x9q2m1a8zt_secret")
    assert not looks_like_jwt("im-demo-admin")


def _config_error(tmp_path: Path, oidc: dict[str, Any]) -> str:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("dashboard", {})["oidc"] = oidc
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    return str(info.value)


def test_a_group_mapped_to_an_unknown_team_names_the_file_key_and_value(tmp_path: Path) -> None:
    """A mapping to a team the configuration lacks is refused naming the group and the role."""
    message = _config_error(
        tmp_path,
        {"issuer": "https://idp.example", "client_id": "c", "groups": {"g": "member:nobody"}},
    )
    assert "infermeter.yaml" in message
    assert "dashboard.oidc.groups['g'] = 'member:nobody': no such team" in message


def test_a_group_mapped_to_no_role_is_refused(tmp_path: Path) -> None:
    """A role other than admin, finance, viewer, lead:<team>, member:<team> is refused at its key."""
    message = _config_error(
        tmp_path, {"issuer": "https://idp.example", "client_id": "c", "groups": {"g": "root"}}
    )
    assert "dashboard.oidc.groups.g = 'root'" in message
    assert "must be admin, finance, viewer, lead:<team> or member:<team>" in message


def test_scopes_without_openid_are_refused(tmp_path: Path) -> None:
    """Without the openid scope there is no ID token to check: refused, naming the scopes."""
    message = _config_error(
        tmp_path, {"issuer": "https://idp.example", "client_id": "c", "scopes": ["email"]}
    )
    assert "must include 'openid'" in message


def test_single_sign_on_is_off_by_default() -> None:
    """The embedded configuration signs in with keys only."""
    assert load_config(DEFAULT_CONFIG, environ={}).dashboard.oidc is None
