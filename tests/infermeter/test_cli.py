"""The ``infermeter`` command: help, the simulated fleet's life cycle, one-line errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from infermeter.cli import build_parser, main
from infermeter.config import DEFAULT_CONFIG
from tests.ports import off_demo_ports


def test_every_subcommand_has_help(capsys):
    """`infermeter --help` lists the subcommands, each with a description."""
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    for name in ("simulate", "demo"):
        assert name in out
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--help"])
    assert "--traffic" in capsys.readouterr().out


def test_help_imports_no_heavy_library():
    """Building the parser, as `infermeter --help` does, imports no server, web or validation library."""
    heavy = ("asyncio", "pydantic", "yaml", "httpx", "uvicorn", "dash", "duckdb", "polars", "tqdm")
    code = (
        "import sys; from infermeter.cli import build_parser; build_parser(); "
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


def _fleet_config(tmp_path: Path) -> Path:
    """The demo fleet moved to free ports so tests never collide with a running demo."""
    data = off_demo_ports(yaml.safe_load(DEFAULT_CONFIG.read_text()))
    data["sidecar"]["spool_dir"] = str(tmp_path / "spool")
    data["collector"]["spool_dir"] = str(tmp_path / "collector-spool")
    data["billing"]["database"] = str(tmp_path / "infermeter.duckdb")
    data["autoscale"]["history_file"] = str(tmp_path / "autoscale-history.json")
    data["simulator"]["instances_file"] = str(tmp_path / "instances.json")
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered")


def _gone(url: str) -> bool:
    try:
        httpx.get(url, timeout=0.5)
    except httpx.HTTPError:
        return True
    return False


def test_simulate_starts_the_fleet_and_ctrl_c_stops_it(tmp_path):
    """Every replica and dcgm-exporter answers; SIGINT stops them all and exits 0."""
    path = _fleet_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    proc = subprocess.Popen([sys.executable, "-m", "infermeter", "simulate", "--config", str(path), "--traffic",
                             "--peak-rps", "30", "--day-seconds", "20"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        urls = [r["upstream_url"] + "/health" for r in config["replicas"]]
        urls += [n["dcgm_exporter_url"] for n in config["nodes"]]
        for url in urls:
            _wait(url)
        first = config["replicas"][1]["upstream_url"]
        deadline = time.monotonic() + 30
        generated = 0.0
        while generated == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            text = httpx.get(f"{first}/metrics").text
            line = next(
                x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total")
            )
            generated = float(line.rsplit(" ", 1)[1])
        assert generated > 0, "traffic reached the replica"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "infermeter is up:" in out
    assert all(_gone(u) for u in urls)


def test_port_in_use_is_a_one_line_error(tmp_path, capsys):
    """A replica port that is taken stops start-up with exit 2 and names the replica."""
    path = _fleet_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    port = int(config["replicas"][0]["upstream_url"].rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        assert main(["simulate", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"infermeter: port {port} on 127.0.0.1 (replica large-0 upstream_url) is already in use"
    )


def test_unknown_replica_is_a_one_line_error(capsys):
    """Asking for a replica the config does not have exits 2 naming it."""
    assert main(["simulate", "--replica", "nope"]) == 2
    assert "no replica 'nope'" in capsys.readouterr().err


def test_demo_command_runs_the_fleet(tmp_path):
    """`infermeter demo` comes up, traffic flows through the sidecars into the spool; SIGTERM stops it."""
    path = _fleet_config(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "infermeter", "demo", "--config", str(path)],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        deadline = time.monotonic() + 30
        while not list((tmp_path / "spool").glob("*/seg-*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert list((tmp_path / "spool").glob("*/seg-*.jsonl")), "usage records from demo traffic"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert any("vLLM replica large-0" in x for x in lines)
    assert any("sidecar small-0 (OpenAI API)" in x for x in lines)
    assert any("collector (fleet view)" in x for x in lines)
    config = yaml.safe_load(path.read_text())
    assert all(_gone(r["upstream_url"] + "/health") for r in config["replicas"]), (
        "no replica outlives the demo"
    )


def test_demo_lists_every_team_key(config):
    """The demo names the public key of every team the embedded configuration has."""
    from infermeter.cli import demo_team_keys

    assert demo_team_keys(config) == [f"im-demo-{t.name}" for t in config.teams]


def test_parts_name_exactly_the_commands_each_module_registers():
    """``PARTS`` (which module a command needs) matches what each part's ``register`` adds."""
    import argparse
    import importlib

    from infermeter.cli import PARTS

    for module, names in PARTS:
        if module is None:
            continue
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert tuple(sub.choices) == names, module


def test_a_command_loads_only_its_own_part():
    """`infermeter sidecar ...` parses without importing any other part's command-line module."""
    code = (
        "import sys; from infermeter.cli import build_parser, _command; "
        "argv = ['sidecar', '--replica', 'small-0']; "
        "args = build_parser(_command(argv)).parse_args(argv); "
        "print(args.command, ' '.join(sorted(m for m in sys.modules if m.endswith('.cli'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["sidecar", "infermeter.cli", "sidecar.cli"]
