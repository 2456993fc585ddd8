"""Every mistake a user can make on the command line ends in one plain line, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from billing.cli_common import ledger_problem
from infermeter.config import DEFAULT_CONFIG
from infermeter.serving import free_port
from launcher.cli import build_parser, main

# A value for every required option of every subcommand, so the command gets past argparse.
REQUIRED = {
    "--for": "2h",
    "--month": "2026-11",
    "--out": "out",
    "--params": "8",
    "--reason": "launch week",
    "--replica": "large-0",
    "--role": "collector",
    "--team": "search",
}
# A value for every required positional argument, by its name.
POSITIONAL = {
    "key_id": "k-0123456789",
    "dest": "nightly",
    "src": "backups/nightly",
    "file": "invoice.csv",
    "root": "var/spool",
}


def leaf_commands() -> list[list[str]]:
    """Every runnable command path: ``["billing"]``, ``["billing", "close"]``, ``["plan"]``..."""

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[list[str]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or not subs[0].required:
            yield path
        for sub in subs:
            for name, child in sub.choices.items():
                yield from walk(child, [*path, name])

    return [p for p in walk(build_parser(), []) if p]


def required_args(path: list[str]) -> list[str]:
    """The required options and positional arguments of the command at ``path``, each with a
    valid value."""
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    args: list[str] = []
    for action in parser._actions:
        if action.required and action.option_strings:
            args += [action.option_strings[0], REQUIRED[action.option_strings[0]]]
        elif not action.option_strings and action.nargs is None and action.dest in POSITIONAL:
            args.append(POSITIONAL[action.dest])
    return args


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """``infermeter argv`` in this process: its exit code and its stderr lines (demo warning dropped)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors exit through SystemExit
        code = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if "WARNING: no --config" not in line]


def one_line(lines: list[str]) -> str:
    """The single error line of a failed command (argparse's usage lines dropped)."""
    errors = [line for line in lines if line.startswith("infermeter")]
    assert len(errors) == 1, lines
    return errors[0]


@pytest.mark.parametrize("path", leaf_commands(), ids=" ".join)
def test_unknown_option_is_a_usage_error(path, capsys):
    """Every subcommand answers an unknown option with argparse's usage line and exit 2."""
    code, lines = run([*path, *required_args(path), "--no-such-option"], capsys)
    assert code == 2
    assert "unrecognized arguments: --no-such-option" in one_line(lines)


@pytest.mark.parametrize("path", leaf_commands(), ids=" ".join)
def test_missing_config_file_is_one_line(path, tmp_path, capsys):
    """Every subcommand given a configuration file that is not there says so in one line."""
    missing = tmp_path / "absent.yaml"
    code, lines = run([*path, *required_args(path), "--config", str(missing)], capsys)
    assert code == 2
    assert (
        one_line(lines)
        == f"infermeter: config error: {missing}: cannot read file: No such file or directory"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["chargeback", "--month", "2026-13"],
            "argument --month: month '2026-13' is not of the form YYYY-MM",
        ),
        (
            ["billing", "close", "--month", "26-11"],
            "argument --month: month '26-11' is not of the form YYYY-MM",
        ),
        (["plan", "--params", "13"], "no model shape for 13B parameters: give --preset"),
        (["billing", "export", "--out", "x"], "export reads the ledger file"),
        (
            ["advise", "--month", "2026-13"],
            "argument --month: month '2026-13' is not of the form YYYY-MM",
        ),
        (
            ["billing", "--listen", "127.0.0.1:99999"],
            "argument --listen: '127.0.0.1:99999': the port must be a number from 1 to 65535",
        ),
        (
            ["collect", "--listen", "nohost"],
            "argument --listen: 'nohost': not HOST:PORT (such as 127.0.0.1:8080 or [::1]:8080)",
        ),
        (
            ["sidecar", "--replica", "small-0", "--upstream", "notaurl"],
            "argument --upstream: 'notaurl': an http:// or https:// URL expected",
        ),
        (
            ["dashboard", "--billing-url", "http://127.0.0.1:99999"],
            "argument --billing-url: 'http://127.0.0.1:99999': the port must be from 1 to 65535",
        ),
        (
            ["demo", "--front-door-metrics-port", "99999"],
            "argument --front-door-metrics-port: '99999': a port from 1 to 65535 expected",
        ),
        (
            ["demo", "--front-door", "127.0.0.1:0"],
            "argument --front-door: '127.0.0.1:0': the port must be a number from 1 to 65535",
        ),
    ],
)
def test_bad_values_are_one_line(argv, message, capsys):
    """A bad value names itself in the command's one error line."""
    code, lines = run(argv, capsys)
    assert code == 2
    assert message in one_line(lines)


def test_chargeback_without_token_says_which_variable(capsys, monkeypatch):
    """Without the admin token the chargeback command names the variable to set."""
    monkeypatch.delenv("INFERMETER_ADMIN_TOKEN", raising=False)
    code, lines = run(["chargeback", "--month", "2026-11"], capsys)
    assert code == 2
    assert one_line(lines) == (
        "infermeter: set $INFERMETER_ADMIN_TOKEN to the admin token (or use --database)"
    )


def test_chargeback_with_billing_down_is_one_line(capsys, monkeypatch):
    """A billing service that does not answer is one line naming its address, exit 1."""
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", "im-demo-admin")
    url = f"http://127.0.0.1:{free_port()}"
    code, lines = run(["chargeback", "--month", "2026-11", "--billing-url", url], capsys)
    assert code == 1
    assert one_line(lines).startswith(f"infermeter: billing at {url} did not answer")


@contextlib.contextmanager
def held(path: Path) -> Iterator[int]:
    """``path`` opened by another process (as the billing service holds its ledger); its PID."""
    code = f"import duckdb, sys, time; con = duckdb.connect({str(path)!r}); print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize(
    "argv",
    [
        ["chargeback", "--month", "2026-11"],
        ["billing", "close", "--month", "2026-10"],
        ["billing", "export", "--out", "x"],
    ],
)
def test_locked_ledger_is_one_line(argv, tmp_path, capsys):
    """A ledger file another process holds is one line naming the file and that process."""
    ledger = tmp_path / "ledger.duckdb"
    with held(ledger) as pid:
        code, lines = run([*argv, "--database", str(ledger)], capsys)
    assert code == 1
    assert one_line(lines) == (
        f"infermeter: the ledger {ledger} is in use by another process (PID {pid}), most likely "
        "the billing service: leave out --database to go through the service, or stop it first"
    )


def test_ledger_problem_keeps_other_reasons():
    """A reason that is not a lock is passed on as it is."""
    assert ledger_problem("x.duckdb", "x.duckdb: newer schema") == "x.duckdb: newer schema"


def test_env_override_error_names_the_variable(capsys, monkeypatch):
    """A bad value from the environment blames the variable, not the embedded defaults file."""
    monkeypatch.setenv("INFERMETER__PRICES__PUE", "9")
    code, lines = run(["plan", "--params", "8"], capsys)
    assert code == 2
    assert one_line(lines) == (
        "infermeter: config error: environment variable INFERMETER__PRICES__PUE: "
        "prices.pue = 9: Input should be less than or equal to 3"
    )


def test_typo_in_env_key_suggests_the_key(capsys, monkeypatch):
    """A misspelt key in an override variable is blamed on it, with the key it was probably meant to be."""
    monkeypatch.setenv("INFERMETER__BILING__LISTEN", "127.0.0.1:1")
    code, lines = run(["plan", "--params", "8"], capsys)
    assert code == 2
    assert one_line(lines) == (
        "infermeter: config error: environment variable INFERMETER__BILING__LISTEN: "
        "biling: unknown key (did you mean 'billing'?)"
    )


def test_typo_in_file_key_suggests_the_key(tmp_path, capsys):
    """A misspelt key in the file names the file, the key path and the key it was probably meant to be."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["teams"][0]["budget_usd_per_mnth"] = 5
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    code, lines = run(["plan", "--params", "8", "--config", str(path)], capsys)
    assert code == 2
    assert one_line(lines) == (
        f"infermeter: config error: {path}: teams[0].budget_usd_per_mnth: unknown key "
        "(did you mean 'budget_usd_per_month'?)"
    )


def test_unknown_list_entry_in_env_suggests_the_entry(capsys, monkeypatch):
    """An override naming a team that does not exist suggests the team it was probably meant to be."""
    monkeypatch.setenv("INFERMETER__TEAMS__SERCH__BUDGET_USD_PER_MONTH", "1")
    code, lines = run(["plan", "--params", "8"], capsys)
    assert code == 2
    assert one_line(lines) == (
        "infermeter: config error: environment variable "
        "INFERMETER__TEAMS__SERCH__BUDGET_USD_PER_MONTH: no such key: no entry 'SERCH' "
        "(did you mean 'search'?)"
    )


def test_a_key_cut_short_suggests_the_full_key(tmp_path, capsys):
    """A key typed short of its full name still gets the suggestion."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["teams"][0]["budgt"] = 5
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    code, lines = run(["plan", "--params", "8", "--config", str(path)], capsys)
    assert code == 2
    assert one_line(lines).endswith(
        "teams[0].budgt: unknown key (did you mean 'budget_usd_per_month'?)"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["alerts", "render", "--out", "/proc/no-such-dir/rules"],
    ],
)
def test_an_unusable_path_is_one_line(argv, capsys):
    """A directory that cannot be created is one line naming it, exit 1."""
    code, lines = run(argv, capsys)
    assert code == 1
    assert one_line(lines).startswith("infermeter: ")
    assert "/proc/no-such-dir" in one_line(lines)


@pytest.mark.parametrize(
    "argv",
    [
        ["chargeback", "--month", "2026-11"],
        ["advise", "--month", "2026-11"],
        ["billing", "close", "--month", "2026-10"],
        ["billing", "export", "--out", "x"],
    ],
)
def test_a_ledger_path_with_no_file_is_refused_not_made(argv, tmp_path, capsys):
    """A mistyped ``--database`` is one line naming it, exit 2, and no empty ledger is made in
    its place (it would be read as a month with nothing in it)."""
    typo = tmp_path / "ledgr.duckdb"
    code, lines = run([*argv, "--database", str(typo)], capsys)
    assert code == 2
    assert one_line(lines).startswith(f"infermeter: no ledger file at {typo} (--database)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            b"billing:\n  listen: 127.0.0.1:1\n",
            "line 97, column 1: malformed YAML: duplicate key 'billing' (first given on line 76)",
        ),
        (b"teams: [\xe9]\n", "line 97: not UTF-8 text (byte 0xe9)"),
    ],
)
def test_a_file_yaml_would_read_wrongly_is_refused_naming_the_line(text, message, tmp_path, capsys):
    """A section given twice (YAML would keep the second whole, the first's tokens gone) and a
    byte that is not UTF-8: one line naming the file and the line, no traceback."""
    path = tmp_path / "own.yaml"
    path.write_bytes(DEFAULT_CONFIG.read_bytes() + text)
    code, lines = run(["plan", "--params", "8", "--config", str(path)], capsys)
    assert code == 2
    assert one_line(lines) == f"infermeter: config error: {path}: {message}"


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        (
            "INFERMETER__PRICES__PUE",
            "[1,",
            "INFERMETER__PRICES__PUE: malformed YAML value: did not find expected node content",
        ),
        (
            "INFERMETER__PRICES__PUE",
            "!!python/object:os.system {}",
            "INFERMETER__PRICES__PUE: malformed YAML value: could not determine a constructor",
        ),
        (
            "INFERMETER__BILLING__LISTEN",
            "127.0.0.1:99999",
            "INFERMETER__BILLING__LISTEN: billing.listen = '127.0.0.1:99999': the port must be a "
            "number from 1 to 65535",
        ),
        (
            "INFERMETER__SIDECAR__INGEST_URL",
            "127.0.0.1:29600",
            "INFERMETER__SIDECAR__INGEST_URL: sidecar.ingest_url = '127.0.0.1:29600': an http:// or "
            "https:// URL expected (such as http://host:8000)",
        ),
        (
            "INFERMETER__SIDECAR__SHARED_LIMITS__REDIS_URL",
            "localhost:6379",
            "INFERMETER__SIDECAR__SHARED_LIMITS__REDIS_URL: sidecar.shared_limits.redis_url = "
            "'localhost:6379': a redis://, rediss:// or unix:// URL expected",
        ),
        (
            "INFERMETER__PRICES__USD_PER_GPU_HOUR__H100",
            ".inf",
            "INFERMETER__PRICES__USD_PER_GPU_HOUR__H100: prices.usd_per_gpu_hour.H100 = inf: Input "
            "should be a finite number",
        ),
    ],
)
def test_a_value_that_would_fail_only_at_run_time_is_refused_at_load(
    var, value, message, capsys, monkeypatch
):
    """Listen addresses, URLs and numbers are checked when the configuration is read: a port
    out of range, a URL without its scheme, an infinite price or a YAML value that does not
    parse is one line naming the variable, not a traceback or a service retrying for ever."""
    monkeypatch.setenv(var, value)
    code, lines = run(["plan", "--params", "8"], capsys)
    assert code == 2
    assert one_line(lines).startswith(f"infermeter: config error: environment variable {message}")
