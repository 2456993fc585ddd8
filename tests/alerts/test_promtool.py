"""promtool checks the committed rules and runs the unit tests written for every alert."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from alerts.cli import write_rules
from infermeter.config import Config, load_config
from tests.alerts.prometheus import promtool
from tests.placeholders import filled_copy

ROOT = Path(__file__).parents[2]
RULES = ROOT / "alerts" / "rules"
UNIT_TESTS = ROOT / "alerts" / "tests"
EXAMPLE = ROOT / "examples" / "infermeter.yaml"


def _alert_names(rule_files: list[Path]) -> set[str]:
    names = set()
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            names |= {r["alert"] for r in group["rules"] if "alert" in r}
    return names


def _cases(test_files: list[Path]) -> list[dict[str, Any]]:
    return [
        case
        for path in test_files
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]


def _example_rules(tmp_path: Path) -> Path:
    """Rules rendered from examples/infermeter.yaml, with the unit tests written for them."""
    config = load_config(filled_copy(EXAMPLE, tmp_path), environ={})
    write_rules(config, str(EXAMPLE), tmp_path)
    for path in (UNIT_TESTS / "example").glob("*.test.yml"):
        shutil.copy(path, tmp_path)
    return tmp_path


def test_committed_rules_pass_promtool_check():
    """`promtool check rules` accepts both committed rule files (syntax, PromQL, no duplicates)."""
    files = sorted(RULES.glob("*.yml"))
    assert len(files) == 2
    result = promtool("check", "rules", *map(str, files))
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_tests_pass_on_the_committed_rules():
    """`promtool test rules` passes every test of alerts/tests against the committed rules."""
    files = sorted(UNIT_TESTS.glob("*.test.yml"))
    result = promtool("test", "rules", *map(str, files))
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_tests_pass_on_rules_with_team_overrides(tmp_path):
    """The per-team SLA alerts, rendered from the example config, pass their promtool tests."""
    where = _example_rules(tmp_path)
    files = sorted(where.glob("*.rules.yml"))
    checked = promtool("check", "rules", *map(str, files))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", *sorted(p.name for p in where.glob("*.test.yml")), cwd=where)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_not_firing(tmp_path):
    """Each alert of the default and example rules has a promtool case where it fires and one where it does not."""
    rendered = sorted(RULES.glob("*.yml")) + sorted(_example_rules(tmp_path).glob("*.rules.yml"))
    cases = _cases(sorted(UNIT_TESTS.rglob("*.test.yml")))
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    names = _alert_names(rendered)
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"


def test_odd_windows_and_durations_pass_promtool_check(tmp_path):
    """Windows and waits that are not whole minutes render as durations Prometheus accepts."""
    data = load_config(filled_copy(EXAMPLE, tmp_path), environ={}).model_dump(mode="json")
    data["alerts"].update(
        rate_window_seconds=90, sla_for_seconds=1.5, evaluation_interval_seconds=2.5
    )
    config = Config.model_validate(data)
    files = write_rules(config, "test", tmp_path)
    assert "rate1m30s" in files[0].read_text()
    result = promtool("check", "rules", *map(str, files))
    assert result.returncode == 0, result.stdout + result.stderr
