"""`infermeter chargeback` for a month with no data: a warning on stderr, so a typo is noticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from launcher.cli import main
from tests.billing.conftest import NOV, batch, gpu_samples, usage
from tests.servers import serving


def _november(path: Path, config: Config) -> Ledger:
    ledger = Ledger.open(path, [t.name for t in config.teams], {})
    ledger.ingest(batch("gpu_samples", gpu_samples(start=NOV + 3600)), now=NOV + 86400)
    ledger.ingest(batch("usage", [usage("search", NOV + 3700)]), now=NOV + 86400)
    return ledger


def test_a_month_without_data_is_a_warning_naming_the_months_with_data(tmp_path, config, capsys):
    """2062-11 (a year typo) writes the all-zero file, exits 0 and says so on stderr."""
    _november(tmp_path / "ledger.duckdb", config).close()
    assert (
        main(["chargeback", "--month", "2062-11", "--database", str(tmp_path / "ledger.duckdb")])
        == 0
    )
    out, err = capsys.readouterr()
    assert out.count("\n") == 2  # the header and the total row
    assert "warning: 2062-11 has no usage or GPU time in the ledger" in err
    assert "months with data: 2026-11" in err


def test_a_month_with_data_has_no_warning(tmp_path, config, capsys):
    """The month the ledger holds is written without a word on stderr but the progress."""
    _november(tmp_path / "ledger.duckdb", config).close()
    assert (
        main(["chargeback", "--month", "2026-11", "--database", str(tmp_path / "ledger.duckdb")])
        == 0
    )
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["csv", "focus"])
async def test_the_service_path_warns_too(tmp_path, config, capsys, monkeypatch, fmt):
    """Through the billing service (the admin token), an empty month warns in either format."""
    ledger = _november(tmp_path / "ledger.duckdb", config)
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", "im-demo-admin")
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            args = ["chargeback", "--month", "2062-11", "--format", fmt, "--billing-url", url]
            code = await _in_thread(args)
    finally:
        ledger.close()
    assert code == 0
    err = capsys.readouterr().err
    assert "warning: 2062-11 has no usage or GPU time" in err
    assert "months with data: 2026-11" in err


async def _in_thread(args: list[str]) -> int:
    """The command in a thread: it calls the service this event loop serves."""
    import asyncio

    return await asyncio.to_thread(main, args)
