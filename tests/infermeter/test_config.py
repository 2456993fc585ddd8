"""The configuration file: what parses, what environment variables change, how errors read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, ConfigError, hash_key, load_config
from launcher.cli import main
from tests.placeholders import filled_copy

EXAMPLE = Path(__file__).parents[2] / "examples" / "infermeter.yaml"


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def _base() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return data


def _error(tmp_path: Path, data: object, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, data), environ=environ or {})
    return str(info.value)


def test_embedded_defaults_describe_the_demo_fleet():
    """The embedded fleet has at least 2 models, 3 replicas, 4 GPUs and 4 teams."""
    config = load_config(DEFAULT_CONFIG, environ={})
    assert len(config.models) >= 2
    assert len(config.replicas) >= 3
    assert sum(r.gpu_count for r in config.replicas) >= 4
    assert len(config.teams) >= 4


def test_example_file_is_complete_and_valid(tmp_path):
    """examples/infermeter.yaml, its key placeholders filled, parses and sets every section the schema has."""
    config = load_config(filled_copy(EXAMPLE, tmp_path), environ={})
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert set(raw) == set(type(config).model_fields)


def test_demo_keys_are_stored_only_as_hashes():
    """A team's key appears in the file as its SHA-256 digest, never in clear."""
    text = DEFAULT_CONFIG.read_text().split("\nteams:", 1)[1]
    config = load_config(DEFAULT_CONFIG, environ={})
    assert hash_key("im-demo-search") in config.teams[0].api_key_sha256
    assert "im-demo-search" not in text.replace("# ", "")


def test_environment_overrides_a_scalar():
    """INFERMETER__PRICES__USD_PER_KWH replaces prices.usd_per_kwh."""
    config = load_config(DEFAULT_CONFIG, environ={"INFERMETER__PRICES__USD_PER_KWH": "0.21"})
    assert config.prices.usd_per_kwh == 0.21


def test_environment_addresses_list_items_by_name_or_id():
    """List entries are found by their name or id, case-insensitively, dashes as underscores."""
    environ = {
        "INFERMETER__TEAMS__SEARCH__BUDGET_USD_PER_MONTH": "12000",
        "INFERMETER__REPLICAS__LARGE_0__UPSTREAM_URL": "http://10.0.0.7:8000",
    }
    config = load_config(DEFAULT_CONFIG, environ=environ)
    assert config.teams[0].budget_usd_per_month == 12000
    assert config.replica("large-0").upstream_url == "http://10.0.0.7:8000"


def test_environment_override_is_validated_like_the_file():
    """A bad value from the environment fails with the key path, like one from the file."""
    with pytest.raises(
        ConfigError, match=r"prices\.pue = 9: Input should be less than or equal to 3"
    ):
        load_config(DEFAULT_CONFIG, environ={"INFERMETER__PRICES__PUE": "9"})


def test_environment_override_of_unknown_list_item_names_the_variable():
    """An override that points at no list entry is an error naming the variable."""
    with pytest.raises(ConfigError, match="INFERMETER__TEAMS__NOBODY__BUDGET_USD_PER_MONTH"):
        load_config(
            DEFAULT_CONFIG, environ={"INFERMETER__TEAMS__NOBODY__BUDGET_USD_PER_MONTH": "1"}
        )


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    """Broken YAML is reported with its position, not a traceback."""
    message = _error(tmp_path, "teams: [\n  - name: a\n prices: {")
    assert message.startswith(str(tmp_path / "infermeter.yaml") + ": line ")
    assert "malformed YAML" in message


@pytest.mark.parametrize(
    "text",
    [
        "teams: !!python/object/apply:os.system ['echo pwned']\n",
        "teams: !!python/name:os.system\n",
        "teams: !custom {a: 1}\n",
    ],
)
def test_a_yaml_tag_that_would_build_an_object_is_refused(tmp_path, text):
    """The file is read by a safe loader: a tag naming a Python object (or any unknown tag) is
    a config error with its position, and nothing is built or run."""
    path = tmp_path / "infermeter.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert message.startswith(f"{path}: line 1, column 8: malformed YAML: ")
    assert "could not determine a constructor" in message


def test_unknown_key_is_rejected(tmp_path):
    """A misspelt key fails instead of being ignored."""
    data = _base()
    data["prices"]["usd_per_kwhh"] = 0.1
    assert "prices.usd_per_kwhh: unknown key" in _error(tmp_path, data)


def test_negative_price_names_key_value_and_reason(tmp_path):
    """A negative GPU price is reported with its full key path and value."""
    data = _base()
    data["prices"]["usd_per_gpu_hour"]["H100"] = -1
    assert (
        "prices.usd_per_gpu_hour.H100 = -1: Input should be greater than or equal to 0"
        in _error(tmp_path, data)
    )


@pytest.mark.parametrize(
    ("section", "field"), [("teams", "name"), ("replicas", "id"), ("models", "name")]
)
def test_duplicate_ids_are_rejected(tmp_path, section, field):
    """Two teams, replicas or models with the same id are an error naming the id."""
    data = _base()
    data[section].append(dict(data[section][0]))
    if section == "teams":
        data[section][-1]["api_key_sha256"] = []
    assert f"duplicate {data[section][0][field]!r}" in _error(tmp_path, data)


def test_replica_of_unknown_model_is_rejected(tmp_path):
    """A replica must serve a model of the registry."""
    data = _base()
    data["replicas"][0]["model"] = "nope"
    assert "replica 'large-0' names unknown model 'nope'" in _error(tmp_path, data)


def test_replica_gpu_without_price_is_rejected(tmp_path):
    """Every GPU model in use needs a price, or it could never be charged."""
    data = _base()
    data["replicas"][0]["gpu_model"] = "B200"
    assert "no price for GPU model 'B200'" in _error(tmp_path, data)


def test_serve_version_must_be_approved(tmp_path):
    """A model cannot route to a version that is not approved."""
    data = _base()
    data["models"][1]["serve_version"] = "llama-unapproved"
    assert "models[1] = " not in (message := _error(tmp_path, data))
    assert "serve_version 'llama-unapproved' is not in approved_versions" in message


def test_statement_lifetime_defaults_to_one_dashboard_refresh(tmp_path):
    """Unset, billing serves a cached statement for one dashboard refresh interval."""
    data = _base()
    data.setdefault("dashboard", {})["refresh_seconds"] = 7
    assert load_config(_write(tmp_path, data), environ={}).statement_ttl_seconds == 7


def test_statement_lifetime_longer_than_a_refresh_is_rejected(tmp_path):
    """A cached statement may not outlive a refresh: the pages would show older figures."""
    data = _base()
    data.setdefault("billing", {})["statement_ttl_seconds"] = 300
    assert "billing.statement_ttl_seconds 300 is longer than dashboard.refresh_seconds 10" in (
        _error(tmp_path, data)
    )


def test_missing_file_is_one_line(tmp_path):
    """A path that does not exist is reported as such."""
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "absent.yaml", environ={})


def test_cli_reports_config_errors_in_one_line_per_problem(tmp_path, capsys):
    """The command exits 2 with the file, key and reason, and no traceback."""
    data = _base()
    data["prices"]["pue"] = 0.5
    path = _write(tmp_path, data)
    assert main(["simulate", "--config", str(path), "--replica", "large-0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"infermeter: config error: {path}: prices.pue = 0.5: Input should be greater than or equal to 1"
    )
    assert "Traceback" not in err


def test_team_workload_is_one_of_three(tmp_path):
    """teams[].workload takes auto, interactive or batch, and names the bad value otherwise."""
    data = _base()
    assert load_config(_write(tmp_path, data), environ={}).teams[0].workload == "auto"
    data["teams"][0]["workload"] = "nightly"
    assert (
        "teams[0].workload = 'nightly': Input should be 'auto', 'interactive' or 'batch'"
        in _error(tmp_path, data)
    )


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            {"scaling": {"min_replicas": 5, "max_replicas": 1}},
            "scaling: min_replicas 5 is above max_replicas 1",
        ),
        (
            {"autoscale": {"kubernetes": {"deployments": {"chat-smal": "vllm-small"}}}},
            "autoscale.kubernetes.deployments['chat-smal']: no such model",
        ),
        (
            {"autoscale": {"local": {"groups": {"chat-small": "small-9"}}}},
            "autoscale.local.groups['chat-small'] = 'small-9': no such replica",
        ),
        (
            {"sidecar": {"budgets": {"priority_models": ["chat-larg"]}}},
            "sidecar.budgets.priority_models[0] = 'chat-larg': no such model",
        ),
        (
            {"simulator": {"engines": {"chat-smal": {}}}},
            "simulator.engines['chat-smal']: no such model",
        ),
    ],
)
def test_a_setting_naming_what_the_fleet_lacks_is_rejected(tmp_path, change, problem):
    """A name that matches nothing would be read as nothing (a hook that never scales its
    model, a budget's priority that lets nothing through): refused, naming the setting and the
    name."""
    data = _base()
    for section, value in change.items():
        merged = data.get(section, {})
        for key, inner in value.items():
            merged[key] = (
                {**merged.get(key, {}), **inner}
                if isinstance(inner, dict) and isinstance(merged.get(key), dict)
                else inner
            )
        data[section] = merged
    assert problem in _error(tmp_path, data)


def test_two_replicas_claiming_one_gpu_are_rejected(tmp_path):
    """small-1 on node-b's GPU 0, which small-0 has: the samples of that GPU, and their cost,
    would go to one of them only."""
    data = _base()
    data["replicas"][2]["gpus"] = [0]
    assert "replica 'small-1': GPU 0 of node 'node-b' is also replica 'small-0''s" in _error(
        tmp_path, data
    )


def test_an_override_adds_a_mapping_key_as_spelled_and_a_field_in_lower_case():
    """``…__USD_PER_GPU_HOUR__B200`` prices GPU model ``B200`` (a name, kept as the variable
    spells it: a replica of B200 is then priced); ``…__BILLING__STATEMENT_TTL_SECONDS`` sets the
    field ``statement_ttl_seconds``."""
    config = load_config(
        DEFAULT_CONFIG,
        environ={
            "INFERMETER__PRICES__USD_PER_GPU_HOUR__B200": "5",
            "INFERMETER__REPLICAS__SMALL_0__GPU_MODEL": "B200",
            "INFERMETER__BILLING__STATEMENT_TTL_SECONDS": "5",
        },
    )
    assert config.prices.usd_per_gpu_hour["B200"] == 5.0
    assert "b200" not in config.prices.usd_per_gpu_hour
    assert config.replica("small-0").gpu_model == "B200"
    assert config.billing.statement_ttl_seconds == 5.0
