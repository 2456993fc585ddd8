"""``infermeter keys`` against a real billing on loopback: create, list, rotate, revoke."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from infermeter.keys_cli import parse_duration
from launcher.cli import main


async def keys(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["keys", "--billing-url", url, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_the_command_issues_lists_rotates_and_revokes(billing, capsys, monkeypatch):
    """A created key is printed alone on stdout and works; a rotated one replaces it; revoked, it stops."""
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", "im-demo-admin")
    code, out, err = await keys(
        capsys,
        billing,
        "create",
        "--team",
        "search",
        "--member",
        "ana",
        "--expires-in",
        "30d",
        "--requests-per-minute",
        "60",
    )
    assert code == 0
    secret = out.strip()
    assert secret.startswith("imk_")
    assert "shown this once" in err
    async with httpx.AsyncClient(base_url=billing) as client:
        assert (
            await client.get("/v1/spend", headers={"authorization": f"Bearer {secret}"})
        ).status_code == 200
    code, out, _ = await keys(capsys, billing, "list")
    assert code == 0
    [header, row] = out.splitlines()
    assert header.split()[:4] == ["key_id", "role", "team", "member"]
    key_id = row.split()[0]
    assert row.split()[1:4] == ["member", "search", "ana"]
    code, out, _ = await keys(capsys, billing, "rotate", key_id, "--reason", "yearly")
    fresh = out.strip()
    assert code == 0
    assert fresh.startswith("imk_")
    assert fresh != secret
    new_id = fresh.split("_")[1]
    code, _, err = await keys(capsys, billing, "revoke", new_id, "--reason", "left the team")
    assert code == 0
    assert f"revoked {new_id}" in err
    async with httpx.AsyncClient(base_url=billing) as client:
        for key in (secret, fresh):
            assert (
                await client.get("/v1/spend", headers={"authorization": f"Bearer {key}"})
            ).status_code == 401


async def test_a_refusal_is_one_line_naming_billings_reason(billing, capsys, monkeypatch):
    """A team member's key may not issue keys: exit 2 and billing's reason, no traceback."""
    monkeypatch.setenv("INFERMETER_TOKEN", "im-demo-search")
    code, out, err = await keys(capsys, billing, "create", "--team", "search")
    assert code == 2
    assert out == ""
    assert "HTTP 403" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("15m", 900), ("12h", 43200), ("2w", 1209600)]
)
def test_durations_read_as_people_write_them(text, seconds):
    """A duration is seconds, or a number with s, m, h, d or w."""
    assert parse_duration(text) == seconds


def test_a_duration_that_is_not_one_is_refused():
    """Anything else is an argparse error naming the text."""
    with pytest.raises(argparse.ArgumentTypeError, match="'soon'"):
        parse_duration("soon")


def test_signer_prints_the_key_billing_signs_the_set_with(capsys, monkeypatch):
    """``keys signer`` prints, from the writer secret alone, the public key billing's publisher
    names: what sidecar.shared_limits.key_signer takes. Without the secret it says which
    variable to set."""
    from billing.key_publish import RedisPublisher
    from infermeter.config import SharedLimitsSettings
    from infermeter.key_set_seal import signing_key

    monkeypatch.delenv("INFERMETER_TOKEN", raising=False)
    monkeypatch.delenv("INFERMETER_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("INFERMETER_WRITER_SECRET", "a writer secret")
    assert main(["keys", "signer"]) == 0
    printed = capsys.readouterr().out.strip()
    publisher = RedisPublisher(
        SharedLimitsSettings(redis_url="redis://127.0.0.1:1"), signing_key(b"a writer secret")
    )
    assert printed == publisher.signer_hex
    monkeypatch.delenv("INFERMETER_WRITER_SECRET")
    assert main(["keys", "signer"]) != 0
    assert "INFERMETER_WRITER_SECRET" in capsys.readouterr().err
