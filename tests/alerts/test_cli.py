"""`infermeter alerts render`: files written, and one-line errors with exit code 2."""

from __future__ import annotations

import pytest
import yaml

from alerts.rules import ALERTING_FILE, RECORDING_FILE, prometheus_rule, render, to_yaml
from infermeter.config import DEFAULT_CONFIG, load_config
from launcher.cli import build_parser, main


def test_alerts_render_has_help(capsys):
    """`infermeter alerts --help` lists render; `render --help` lists its options."""
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["alerts", "--help"])
    assert "render" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["alerts", "render", "--help"])
    out = capsys.readouterr().out
    assert "--out" in out
    assert "--prometheusrule" in out


def test_render_writes_rule_files_and_manifest(tmp_path, capsys, monkeypatch):
    """Both rule files go to --out and the manifest to --prometheusrule, as rendered."""
    monkeypatch.delenv("INFERMETER_CONFIG", raising=False)
    manifest = tmp_path / "k8s" / "prometheusrule.yaml"
    code = main(
        ["alerts", "render", "--out", str(tmp_path / "rules"), "--prometheusrule", str(manifest)]
    )
    assert code == 0
    groups = render(load_config(DEFAULT_CONFIG, environ={}))
    for name in (RECORDING_FILE, ALERTING_FILE):
        assert (tmp_path / "rules" / name).read_text() == to_yaml({"groups": groups[name]})
    assert manifest.read_text() == to_yaml(prometheus_rule(groups))
    assert capsys.readouterr().out.count("wrote ") == 3


def test_render_refuses_a_budget_cap_below_one_replica(tmp_path, capsys):
    """The error names the file and key, exits 2, and nothing is written."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["scaling"]["monthly_budget_cap_usd"] = 1000
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(data))
    code = main(["alerts", "render", "--config", str(config), "--out", str(tmp_path / "rules")])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"infermeter: config error: {config}: scaling.monthly_budget_cap_usd = 1000.0: below the "
        "monthly cost of one replica of 'chat-large' (2 x H100 at 3.90 USD/GPU-hour x 730 h = 5694.00 USD)",
        f"infermeter: config error: {config}: scaling.monthly_budget_cap_usd = 1000.0: below the "
        "monthly cost of one replica of 'chat-small' (1 x L40S at 1.60 USD/GPU-hour x 730 h = 1168.00 USD)",
    ]
    assert not (tmp_path / "rules").exists()


def test_render_reports_an_unknown_model_in_an_sla_override(tmp_path, capsys):
    """An alerts.slas entry naming no model is a one-line config error, exit 2."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["alerts"] = {"slas": [{"team": "search", "model": "chat-huge", "ttft_p95_seconds": 1}]}
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["alerts", "render", "--config", str(config), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "alerts.slas[0].model = 'chat-huge': no such model" in err
    assert err.startswith(f"infermeter: config error: {config}: ")


def test_render_without_out_prints_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Without --out the rules go to stdout, one document per file, and no file is touched."""
    monkeypatch.delenv("INFERMETER_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["alerts", "render"]) == 0
    documents = capsys.readouterr().out.split("---\n")
    groups = render(load_config(DEFAULT_CONFIG, environ={}))
    assert documents == [
        f"# file: {name}\n" + to_yaml({"groups": groups[name]})
        for name in (RECORDING_FILE, ALERTING_FILE)
    ]
    assert [yaml.safe_load(d)["groups"] for d in documents] == [
        groups[RECORDING_FILE],
        groups[ALERTING_FILE],
    ]
    assert list(tmp_path.iterdir()) == []
