"""The ``infermeter`` command: help, the simulated fleet's life cycle, one-line errors."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG
from infermeter.serving import free_port
from infermeter.writers import Writer, issue
from launcher.cli import build_parser, main
from launcher.demo import DEMO_WRITER_SECRET
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
        "import sys; from launcher.cli import build_parser; build_parser(); "
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
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "simulate",
            "--config",
            str(path),
            "--traffic",
            "--peak-rps",
            "30",
            "--day-seconds",
            "20",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
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


@dataclass
class Demo:
    """A running ``infermeter demo``: its process, configuration and every line it printed."""

    proc: subprocess.Popen[str]
    path: Path
    config: dict[str, Any]
    tmp: Path
    lines: list[str]

    def wait_for_line(self, text: str, timeout: float = 60.0) -> str:
        """The first line printed (so far or within ``timeout``) that contains ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((x for x in list(self.lines) if text in x), None)
            if found is not None:
                return found
            assert self.proc.poll() is None, "".join(self.lines[-30:])
            time.sleep(0.2)
        raise AssertionError(f"no line with {text!r} in:\n" + "".join(self.lines[-30:]))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """`infermeter demo` on free ports and its own files, up; stopped after the module."""
    tmp = tmp_path_factory.mktemp("demo")
    path = _fleet_config(tmp)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    front_door = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "demo",
            "--config",
            str(path),
            "--front-door",
            front_door,
            "--front-door-metrics-port",
            str(free_port()),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp,
    )
    lines: list[str] = []
    out = proc.stdout
    assert out is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")))
    reader.start()
    running = Demo(proc, path, yaml.safe_load(path.read_text()), tmp, lines)
    try:
        running.wait_for_line("Ctrl-C stops everything", timeout=120)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        reader.join(10)


def test_demo_comes_up_and_meters_its_traffic(demo: Demo) -> None:
    """Every endpoint is listed, and traffic through the sidecars lands in their spools."""
    spool = demo.tmp / "spool"
    deadline = time.monotonic() + 30
    while not list(spool.glob("*/seg-*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert list(spool.glob("*/seg-*.jsonl")), "usage records from demo traffic"
    assert any("vLLM replica large-0" in x for x in demo.lines)
    assert any("sidecar small-0 (OpenAI API)" in x for x in demo.lines)
    assert any("collector (fleet view)" in x for x in demo.lines)


def test_demo_serves_every_model_at_one_base_url(demo: Demo) -> None:
    """The front door the demo prints answers both models with a team key, through their sidecars."""
    line = demo.wait_for_line("front door: every model (OpenAI API)")
    base = line.split()[-1]
    for model in ("chat-large", "chat-small"):
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        deadline = time.monotonic() + 30
        while True:
            answer = httpx.post(
                f"{base}/chat/completions",
                json=body,
                timeout=30,
                headers={"authorization": "Bearer im-demo-search"},
            )
            if answer.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the router registers the sidecars once they answer
        assert answer.status_code == 200, answer.text
        served = {r["served_version"] for r in demo.config["replicas"] if r["model"] == model}
        assert answer.json()["model"] in served


def test_demo_shows_each_scaling_decision(demo: Demo) -> None:
    """The autoscaler's change of a model's desired count is one line of the demo's output."""
    # chat-large has one configured replica and min_replicas 2: asked for at the first tick,
    # from the one replica seen serving (none, when the tick ran before the fleet was up).
    line = demo.wait_for_line("autoscale: chat-large: ")
    assert re.search(r"autoscale: chat-large: [01] -> 2 replicas: raised to min_replicas 2$", line)


def test_demo_ships_each_scaling_decision_to_billing(demo: Demo) -> None:
    """The change the autoscaler logged is the model's latest decision in billing's fleet view."""
    demo.wait_for_line("autoscale: chat-large: ")
    url = f"{demo.config['billing']['url']}/v1/fleet"
    deadline, large = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        body = httpx.get(url, headers={"authorization": "Bearer im-demo-admin"}, timeout=10).json()
        large = next(m for m in body["models"] if m["model"] == "chat-large")
        if large["last_decision"] is not None:
            break
        time.sleep(0.5)
    assert large is not None
    assert large["desired"] == 2
    assert large["last_decision"]["reasons"] == "raised to min_replicas 2"


def test_demo_restarts_a_sidecar_that_dies(demo: Demo) -> None:
    """A sidecar killed with SIGKILL is reported in one line, started again, and serves."""
    replica = next(r for r in demo.config["replicas"] if r["id"] == "small-1")
    pid = _child_pid(demo.proc.pid, "sidecar", "--replica", "small-1")
    os.kill(pid, signal.SIGKILL)
    line = demo.wait_for_line("sidecar small-1 was killed by SIGKILL; restarting it in 1 s")
    assert line == "infermeter: sidecar small-1 was killed by SIGKILL; restarting it in 1 s\n"
    _wait(f"http://{replica['sidecar_listen']}/healthz")
    assert _child_pid(demo.proc.pid, "sidecar", "--replica", "small-1") != pid
    assert _tracebacks(demo.lines) == []


def test_demo_ships_the_spool_of_an_instance_that_stopped(demo: Demo) -> None:
    """Records left in the spool of an instance that stopped reach billing; its directory goes."""
    listen = f"127.0.0.1:{free_port()}"
    # An instance of small-0 whose sidecar cannot ship (no ingest URL): its record stays behind,
    # sealed with the credential the demo's secret issues it (as the local scale hook would).
    writer = Writer.for_instance("small-0", "vllm-small-0-99", listen)
    env = {
        **os.environ,
        "INFERMETER_INSTANCE": "vllm-small-0-99",
        "INFERMETER_WRITER_CREDENTIAL": issue(DEMO_WRITER_SECRET.encode(), writer).token,
    }
    env.pop("INFERMETER__SIDECAR__INGEST_URL", None)
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "sidecar",
            "--config",
            str(demo.path),
            "--replica",
            "small-0",
            "--listen",
            listen,
        ],
        env=env,
        cwd=demo.tmp,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(f"http://{listen}/healthz")
        body = {
            "model": "chat-small",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        }
        headers = {"authorization": "Bearer im-demo-search", "x-request-id": "left-behind-1"}
        answer = httpx.post(
            f"http://{listen}/v1/chat/completions", json=body, headers=headers, timeout=30
        )
        assert answer.status_code == 200, answer.text
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(30)
    left = demo.tmp / "spool" / "vllm-small-0-99"
    assert list(left.glob("seg-*.jsonl")), "the stopped instance left its record in its spool"
    deadline = time.monotonic() + 60
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left.exists(), "the collector adopted the spool and removed it"
    found = httpx.get(
        f"{demo.config['billing']['url']}/v1/usage/records",
        params={"id": "left-behind-1", "by": "client_request_id"},
        headers={"authorization": "Bearer im-demo-admin"},
        timeout=10,
    ).json()
    assert [r["instance"] for r in found["records"]] == ["vllm-small-0-99"]


def test_sigterm_stops_the_whole_demo(demo: Demo) -> None:
    """SIGTERM stops every child and exits 0, with no traceback; no replica outlives it."""
    demo.proc.send_signal(signal.SIGTERM)
    assert demo.proc.wait(60) == 0
    assert all(_gone(r["upstream_url"] + "/health") for r in demo.config["replicas"]), (
        "no replica outlives the demo"
    )
    assert _tracebacks(demo.lines) == []


def _tracebacks(lines: list[str]) -> list[str]:
    """Each traceback in the output, with the two lines before it and the rest of it."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            end = next((j for j in range(i + 1, len(lines)) if not lines[j][:1].isspace()), i)
            found.append("".join(lines[max(0, i - 2) : end + 1]))
    return found


def _child_pid(parent: int, *words: str) -> int:
    """The pid of the child of ``parent`` whose command line holds every word in ``words``."""
    for task in Path(f"/proc/{parent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if all(w.encode() in argv for w in words):
                    return int(pid)
    raise AssertionError(f"no child of {parent} runs {words}")


def test_demo_lists_every_team_key(config):
    """The demo names the public key of every team the embedded configuration has."""
    from launcher.demo import demo_team_keys

    assert demo_team_keys(config) == [f"im-demo-{t.name}" for t in config.teams]


def test_parts_name_exactly_the_commands_each_module_registers():
    """``PARTS`` (which part a command needs) matches what each part's registrar adds."""
    import argparse

    from launcher.cli import PARTS

    for register, names in PARTS:
        sub = argparse.ArgumentParser().add_subparsers()
        register(sub)
        assert tuple(sub.choices) == names, register.__name__


def test_a_command_loads_only_its_own_part():
    """`infermeter sidecar ...` parses without importing any other part's command-line module."""
    code = (
        "import sys; from launcher.cli import build_parser, _command; "
        "argv = ['sidecar', '--replica', 'small-0']; "
        "args = build_parser(_command(argv)).parse_args(argv); "
        "print(args.command, ' '.join(sorted(m for m in sys.modules if m.endswith('.cli'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["sidecar", "launcher.cli", "sidecar.cli"]
