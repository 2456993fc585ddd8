"""The demo's composition: what its children are given, passed to them, not set in this process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, load_config
from launcher import fleet
from launcher.cli import main
from launcher.demo import DEMO_METRICS_TOKEN, DEMO_SPEND_TOKEN, demo_environment
from launcher.supervisor import Child
from tests.ports import off_demo_ports


def _config_file(tmp_path: Path) -> Path:
    data = off_demo_ports(yaml.safe_load(DEFAULT_CONFIG.read_text()))
    data["sidecar"]["spool_dir"] = str(tmp_path / "spool")
    data["billing"]["database"] = str(tmp_path / "infermeter.duckdb")
    data["simulator"]["instances_file"] = str(tmp_path / "instances.json")
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_demo_environment_points_every_writer_at_the_demos_billing(tmp_path):
    """Sidecars, collector and autoscaler ship to the configured billing; readers get demo tokens."""
    config = load_config(_config_file(tmp_path), environ={})
    env = demo_environment(config)
    ingest = f"{config.billing.url.rstrip('/')}/v1/ingest"
    assert env["INFERMETER__SIDECAR__INGEST_URL"] == ingest
    assert env["INFERMETER__COLLECTOR__INGEST_URL"] == ingest
    assert env["INFERMETER__AUTOSCALE__INGEST_URL"] == ingest
    assert env["INFERMETER__COLLECTOR__ADOPT_SPOOLS_DIR"] == config.sidecar.spool_dir
    assert env[config.autoscale.metrics_token_env] == DEMO_METRICS_TOKEN
    assert env[config.sidecar.budgets.spend_token_env] == DEMO_SPEND_TOKEN
    # Budgets enforced from the demo's billing, where an override asked at a sidecar is kept.
    assert env["INFERMETER__SIDECAR__BUDGETS__SPEND_URL"] == config.billing.url
    assert set(fleet.spare_gpu_overrides(config).items()) <= set(env.items())


def test_demo_gives_its_settings_to_each_child_and_leaves_its_own_environment(
    tmp_path, monkeypatch
):
    """Every child's environment holds the demo's settings; this process's environment is unchanged."""
    started: list[Child] = []

    def run(children: list[Child], urls: list[tuple[str, str]]) -> int:
        started.extend(children)
        return 0

    monkeypatch.setattr(fleet, "run", run)
    before = dict(os.environ)
    assert main(["demo", "--config", str(_config_file(tmp_path))]) == 0
    assert dict(os.environ) == before
    assert started
    for child in started:
        assert "INFERMETER__SIDECAR__INGEST_URL" in child.env, child.name


@pytest.mark.parametrize("seed", [None, 7])
def test_simulated_children_run_on_the_seed_they_were_given(tmp_path, seed):
    """``simulate --seed`` reaches each replica and dcgm-exporter process as its own ``--seed``."""
    path = _config_file(tmp_path)
    children = fleet.simulator_children(load_config(path, environ={}), str(path), seed)
    assert children
    for child in children:
        argv = list(child.argv)
        if seed is None:
            assert "--seed" not in argv
        else:
            assert argv[argv.index("--seed") + 1] == "7"


def test_overrides_win_over_the_environment():
    """A command's own setting (``simulate --seed``) wins over the same variable in the environment."""
    environ = {"INFERMETER__SIMULATOR__SEED": "1"}
    overrides = {"INFERMETER__SIMULATOR__SEED": "2"}
    assert load_config(DEFAULT_CONFIG, environ=environ, overrides=overrides).simulator.seed == 2
    assert load_config(DEFAULT_CONFIG, environ=environ).simulator.seed == 1
