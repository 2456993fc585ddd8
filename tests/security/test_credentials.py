"""No shipped or demo credential can be used against a real deployment, and no key acts twice.

Adversary: any holder of a team key. A team key that is also the ingest token forges usage for
every team; a hash copied from an example or the demo is a key the whole world knows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, HASH_HINT, ConfigError, hash_key, load_config
from infermeter.serving import free_port
from launcher.cli import main

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "infermeter.yaml"
CONFIGMAP = ROOT / "deploy" / "kubernetes" / "configmap.yaml"
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


def _demo() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return data


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _own_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a fresh, distinct key hash for every principal: a deployment's own keys."""
    for team in data["teams"]:
        team["api_key_sha256"] = [hash_key(f"own key of {team['name']}")]
    data["admin_token_sha256"] = [hash_key("own admin token")]
    data["metrics_token_sha256"] = [hash_key("own metrics token")]
    data["spend_token_sha256"] = [hash_key("own spend token")]
    data["billing"]["ingest_token_sha256"] = [hash_key("own ingest token")]
    return data


def _configmap_text() -> str:
    text: str = yaml.safe_load(CONFIGMAP.read_text())["data"]["infermeter.yaml"]
    return text


# -- one hash, one principal ---------------------------------------------------------------------


def _set(data: dict[str, Any], path: str, digest: str) -> None:
    node: Any = data
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = [digest]


@pytest.mark.parametrize(
    ("first", "second", "first_path", "second_path"),
    [
        (
            "teams.1.api_key_sha256",
            "billing.ingest_token_sha256",
            "teams[1].api_key_sha256[0]",
            "billing.ingest_token_sha256[0]",
        ),
        (
            "teams.0.api_key_sha256",
            "teams.2.api_key_sha256",
            "teams[0].api_key_sha256[0]",
            "teams[2].api_key_sha256[0]",
        ),
        (
            "teams.3.api_key_sha256",
            "admin_token_sha256",
            "teams[3].api_key_sha256[0]",
            "admin_token_sha256[0]",
        ),
        (
            "admin_token_sha256",
            "metrics_token_sha256",
            "admin_token_sha256[0]",
            "metrics_token_sha256[0]",
        ),
        (
            "metrics_token_sha256",
            "billing.ingest_token_sha256",
            "metrics_token_sha256[0]",
            "billing.ingest_token_sha256[0]",
        ),
    ],
)
def test_one_hash_held_by_two_principals_is_refused(
    tmp_path, first, second, first_path, second_path
):
    """A key hash shared by two principals fails, naming the file and both keys, not the key or hash."""
    key = "a-key-used-twice"
    data = _own_keys(_demo())
    _set(data, first, hash_key(key))
    _set(data, second, hash_key(key))
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    (line,) = str(info.value).splitlines()
    assert line.startswith(f"{path}: ")
    assert first_path in line
    assert second_path in line
    assert "same key hash" in line
    assert key not in line
    assert hash_key(key) not in line
    assert not HEX64.search(line)


def test_the_same_hash_twice_for_one_principal_is_allowed(tmp_path):
    """Listing one key twice for the same team grants nothing new, so it is not an error."""
    data = _own_keys(_demo())
    data["teams"][0]["api_key_sha256"] *= 2
    load_config(_write(tmp_path, data), environ={})


def test_distinct_hashes_for_every_principal_load(tmp_path):
    """A configuration with a key of its own for each principal is valid."""
    config = load_config(_write(tmp_path, _own_keys(_demo())), environ={})
    assert config.billing.ingest_token_sha256 == [hash_key("own ingest token")]


# -- shipped files carry placeholders, not hashes --------------------------------------------------


@pytest.mark.parametrize(
    "text", [EXAMPLE.read_text(), _configmap_text()], ids=["example", "configmap"]
)
def test_shipped_configurations_hold_no_key_hash(text):
    """examples/infermeter.yaml and the ConfigMap carry placeholders, not a single hash."""
    assert not HEX64.search(text)
    assert '"<sha256 of ' in text


@pytest.mark.parametrize("source", ["example", "configmap"])
def test_shipped_placeholders_fail_with_one_line_saying_what_to_put(tmp_path, source):
    """Every placeholder fails validation with one line: its key path and the command whose output goes there."""
    text = EXAMPLE.read_text() if source == "example" else _configmap_text()
    path = tmp_path / "infermeter.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    lines = str(info.value).splitlines()
    assert len(lines) == len(_placeholders(yaml.safe_load(text)))
    for line in lines:
        assert re.fullmatch(
            rf"{re.escape(str(path))}: \S+_sha256\[0\]: {re.escape(HASH_HINT)}", line
        )
    assert 'printf %s "$KEY" | sha256sum' in HASH_HINT


def test_a_key_pasted_where_its_hash_belongs_is_not_echoed(tmp_path):
    """A clear-text key in a hash field is refused without being written to the log."""
    data = _own_keys(_demo())
    data["admin_token_sha256"] = ["sk-live-very-secret-admin-key"]
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, data), environ={})
    assert "admin_token_sha256[0]" in str(info.value)
    assert "sk-live-very-secret-admin-key" not in str(info.value)


def _placeholders(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [p for v in node.values() for p in _placeholders(v)]
    if isinstance(node, list):
        return [p for v in node for p in _placeholders(v)]
    return [node] if isinstance(node, str) and node.startswith("<sha256 of ") else []


# -- the demo configuration ------------------------------------------------------------------------


def test_falling_back_to_the_demo_configuration_warns_once(monkeypatch, capsys):
    """A command run with no --config and no $INFERMETER_CONFIG prints one WARNING line on stderr."""
    monkeypatch.delenv("INFERMETER_CONFIG", raising=False)
    assert main(["plan", "--params", "8", "--gpu", "L4"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1
    assert "demo configuration" in warnings[0]


@pytest.mark.parametrize(
    "argv",
    [["simulate", "--replica", "nope"], ["plan", "--params", "8", "--config", str(DEFAULT_CONFIG)]],
    ids=["simulate", "explicit --config"],
)
def test_no_warning_for_the_demo_commands_or_a_chosen_file(monkeypatch, capsys, argv):
    """`infermeter simulate` (and `demo`) are made for the demo file; a --config is a choice: no warning."""
    monkeypatch.delenv("INFERMETER_CONFIG", raising=False)
    main(argv)
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "key",
    [
        "billing.listen",
        "collector.listen",
        "dashboard.listen",
        "autoscale.listen",
        "replicas.0.sidecar_listen",
    ],
)
def test_demo_hashes_with_a_reachable_listen_address_refuse_to_start(tmp_path, capsys, key):
    """Demo key hashes and any non-loopback listen address in the file: exit 2, naming both."""
    data = _demo()
    node: Any = data
    *parents, last = key.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[last] = f"0.0.0.0:{free_port()}"
    path = _write(tmp_path, data)
    assert main(["plan", "--params", "8", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    where = key.replace(".0.", "[0].")
    assert f"{where} = '0.0.0.0:" in err
    assert "admin_token_sha256[0] is the hash of a public demo key" in err
    assert "ingest_token_sha256[0] is the hash of a public demo key" in err


def test_own_hashes_may_listen_anywhere(tmp_path, capsys):
    """With keys of its own, a configuration listening on every interface starts."""
    data = _own_keys(_demo())
    data["billing"]["listen"] = f"0.0.0.0:{free_port()}"
    assert main(["plan", "--params", "8", "--config", str(_write(tmp_path, data))]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["sidecar", "--replica", "small-0"],
        ["billing"],
        ["collect"],
        ["dashboard"],
        ["autoscale", "run"],
    ],
    ids=["sidecar", "billing", "collector", "dashboard", "autoscaler"],
)
def test_servers_on_the_demo_config_refuse_a_reachable_listen_flag(tmp_path, argv):
    """Every server started on the demo configuration with --listen 0.0.0.0 exits 2 before listening."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("INFERMETER_CONFIG", None)
    listen = f"0.0.0.0:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "launcher", *argv, "--listen", listen],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"--listen = '{listen}'" in done.stderr
    assert "is the hash of a public demo key" in done.stderr
    assert not (tmp_path / "var").exists()
