"""Cloud invoices (FinOps FOCUS, CSV and Parquet) read, matched to node pools and kept in the ledger.

The files are small and written here by hand; every expected cent is worked out in a comment.
The pools, in the configuration's order: ``h100-reserved`` claims two resource ids,
``l40s-spot`` the items tagged infermeter-pool=l40s and env=prod, ``l40s-any`` the items tagged
infermeter-pool=l40s (so an item with both tags is ``l40s-spot``'s: the first pool wins).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from billing import closing, invoice_store
from billing.invoices import Invoice, InvoiceError, PoolMonth, parse_invoice, split_by_month
from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, Config, NodePool, load_config
from tests.billing.conftest import bearer
from tests.dashboards.stack import billing_thread

ADMIN, SEARCH = "im-demo-admin", "im-demo-search"
# Billing's URL, a token per caller, and its ledger.
Service = tuple[str, dict[str, str], Ledger]
REPO = Path(__file__).resolve().parents[2]

POOLS_YAML = """
  pools:
    - name: h100-reserved
      nodes: [node-a]
      prices: [{from: "2026-01-01", category: committed, usd_per_gpu_hour: 2.5, committed_gpus: 2}]
      resource_ids: [i-0h100a, i-0h100b]
    - name: l40s-spot
      nodes: [node-b]
      prices: [{from: "2026-01-01", category: spot, usd_per_gpu_hour: 0.9}]
      invoice_tags: {infermeter-pool: l40s, env: prod}
    - name: l40s-any
      node_pattern: "node-*"
      prices: [{from: "2026-01-01", usd_per_gpu_hour: 1.6}]
      invoice_tags: {infermeter-pool: l40s}
"""

# FOCUS 1.0 column names. Row numbers (the header not counted) as errors name them.
FOCUS_1_0_CSV = b"""\
BillingAccountId,BillingCurrency,BillingPeriodStart,BillingPeriodEnd,ChargePeriodStart,ChargePeriodEnd,ChargeCategory,ChargeClass,ChargeDescription,BilledCost,EffectiveCost,ProviderName,PublisherName,InvoiceIssuerName,ResourceId,ServiceCategory,ServiceName,SkuId,Tags
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-01T00:00:00Z,2026-10-02T00:00:00Z,Usage,,H100 hours,123.4567,0,Cloud,Cloud,Cloud,i-0h100a,Compute,VMs,sku-h100,
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-02T00:00:00Z,2026-10-03T00:00:00Z,Usage,,H100 hours,76.5433,0,Cloud,Cloud,Cloud,i-0h100b,Compute,VMs,sku-h100,"{""team"": ""ml""}"
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,Purchase,,H100 commitment,1000.00,1000.00,Cloud,Cloud,Cloud,i-0h100a,Compute,VMs,sku-commit,
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-10T00:00:00Z,2026-10-11T00:00:00Z,Credit,,SLA credit,-50.005,-50.005,Cloud,Cloud,Cloud,i-0h100a,Compute,VMs,,
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,Tax,,Sales tax,80.00,80.00,Cloud,Cloud,Cloud,i-0h100a,Compute,VMs,,
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-31T00:00:00Z,2026-11-01T12:00:00Z,Usage,,L40S spot,0.10,0.10,Cloud,Cloud,Cloud,i-0l40s1,Compute,VMs,sku-l40s,"{""infermeter-pool"": ""l40s"", ""env"": ""prod""}"
acct-1,USD,2026-11-01T00:00:00Z,2026-12-01T00:00:00Z,2026-11-05T00:00:00Z,2026-11-06T00:00:00Z,Usage,,L40S spot,2.50,2.50,Cloud,Cloud,Cloud,i-0l40s2,Compute,VMs,sku-l40s,"{""env"": ""prod"", ""infermeter-pool"": ""l40s"", ""owner"": ""x""}"
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-07T00:00:00Z,2026-10-08T00:00:00Z,Usage,,L40S dev,4.00,4.00,Cloud,Cloud,Cloud,i-0l40s3,Compute,VMs,sku-l40s,"{""infermeter-pool"": ""l40s"", ""env"": ""dev""}"
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-01T00:00:00Z,2026-10-02T00:00:00Z,Usage,,Volume,12.34,12.34,Cloud,Cloud,Cloud,vol-123,Storage,Disks,sku-disk,
acct-1,USD,2026-10-01T00:00:00Z,2026-11-01T00:00:00Z,2026-10-01T00:00:00Z,2026-10-02T00:00:00Z,Usage,,Egress,0.66,0.66,Cloud,Cloud,Cloud,,Networking,Egress,sku-net,
"""

# h100-reserved, 2026-10: rows 1 + 2 + 3 + 4 = 123.4567 + 76.5433 + 1000.00 - 50.005 = 1149.995
#   USD = 114999.5 cents, half to even: 115000 (the tax of row 5 is not counted).
# l40s-spot: row 6, 0.10 USD over 36 hours, 24 in October and 12 in November: 10 cents x 24/36
#   = 6.67 and x 12/36 = 3.33, floors 6 + 3, the cent left to the larger remainder: 7 and 3;
#   2026-11 adds row 7 (both tags, a third one besides): 3 + 250 = 253 cents, from 2 items.
# l40s-any, 2026-10: row 8 (env=dev, so not l40s-spot's): 400 cents.
# Unclaimed: rows 9 (Storage, 12.34) and 10 (Networking, no ResourceId, 0.66): 2 items, 1300 cents.
EXPECTED = (
    PoolMonth("2026-10", "h100-reserved", 115000, 4),
    PoolMonth("2026-10", "l40s-any", 400, 1),
    PoolMonth("2026-10", "l40s-spot", 7, 1),
    PoolMonth("2026-11", "l40s-spot", 253, 2),
)


def _rows() -> list[dict[str, Any]]:
    """The 1.0 CSV's rows, as text."""
    import polars as pl

    return pl.read_csv(io.BytesIO(FOCUS_1_0_CSV), infer_schema=False).to_dicts()


def _csv(rows: list[dict[str, Any]]) -> bytes:
    import polars as pl

    return pl.DataFrame(rows).write_csv().encode()


def focus_1_2_csv() -> bytes:
    """The same items with FOCUS 1.2's columns added (InvoiceId, BillingAccountType, ...)."""
    rows = [
        r
        | {
            "InvoiceId": "inv-2026-10",
            "BillingAccountType": "Billing Account",
            "PricingCurrency": "USD",
            "SkuMeter": "GPU Hours",
        }
        for r in _rows()
    ]
    return _csv(rows)


def focus_0_5_csv() -> bytes:
    """The same items under the names before FOCUS 1.0 (BilledCurrency, ChargeType)."""
    renames = {"BillingCurrency": "BilledCurrency", "ChargeCategory": "ChargeType"}
    return _csv([{renames.get(k, k): v for k, v in r.items()} for r in _rows()])


def _time(text: str) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(text)


def focus_1_3_parquet() -> bytes:
    """FOCUS 1.3 as a provider writes Parquet: decimal cost, UTC timestamps, Tags a map, the
    provider in ServiceProviderName/HostProviderName (ProviderName deprecated, left out)."""
    rows = _rows()
    tags = [list(_tags(r["Tags"]).items()) for r in rows]
    table = pa.table(
        {
            "BillingCurrency": pa.array([r["BillingCurrency"] for r in rows]),
            "BilledCost": pa.array([Decimal(r["BilledCost"]) for r in rows], pa.decimal128(18, 6)),
            "ChargePeriodStart": pa.array(
                [_time(r["ChargePeriodStart"]) for r in rows], pa.timestamp("us", "UTC")
            ),
            "ChargePeriodEnd": pa.array(
                [_time(r["ChargePeriodEnd"]) for r in rows], pa.timestamp("us", "UTC")
            ),
            "ChargeCategory": pa.array([r["ChargeCategory"] for r in rows]),
            "ResourceId": pa.array([r["ResourceId"] for r in rows]),
            "ServiceCategory": pa.array([r["ServiceCategory"] for r in rows]),
            "ServiceProviderName": pa.array(["Cloud"] * len(rows)),
            "HostProviderName": pa.array(["Cloud"] * len(rows)),
            "AllocatedResourceId": pa.array([None] * len(rows), pa.string()),
            "Tags": pa.array(tags, pa.map_(pa.string(), pa.string())),
        }
    )
    return _parquet(table)


def focus_1_0_parquet_struct() -> bytes:
    """FOCUS 1.0 in Parquet the other way: float cost, ISO text times, Tags a struct."""
    rows = _rows()
    keys = ("infermeter-pool", "env", "team", "owner")
    table = pa.table(
        {
            "BillingCurrency": [r["BillingCurrency"] for r in rows],
            "BilledCost": pa.array([float(r["BilledCost"]) for r in rows], pa.float64()),
            "ChargePeriodStart": [r["ChargePeriodStart"] for r in rows],
            "ChargePeriodEnd": [r["ChargePeriodEnd"] for r in rows],
            "ChargeCategory": [r["ChargeCategory"] for r in rows],
            "ResourceId": [r["ResourceId"] for r in rows],
            "Tags": pa.array(
                [{k: _tags(r["Tags"]).get(k) for k in keys} for r in rows],
                pa.struct([(k, pa.string()) for k in keys]),
            ),
        }
    )
    return _parquet(table)


def _tags(text: str | None) -> dict[str, str]:
    import orjson

    found: dict[str, str] = orjson.loads(text) if text else {}
    return found


def _parquet(table: pa.Table) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo configuration with the three pools, as a file (the CLI reads it too)."""
    text = DEFAULT_CONFIG.read_text()
    assert "\n  pue: 1.35\n" in text
    path = tmp_path_factory.mktemp("invoices") / "infermeter.yaml"
    path.write_text(text.replace("\n  pue: 1.35\n", "\n  pue: 1.35\n" + POOLS_YAML, 1))
    return path


@pytest.fixture(scope="module")
def pool_config(config_file: Path) -> Config:
    """The configuration with the pools."""
    return load_config(config_file, environ={})


@pytest.fixture(scope="module")
def pools(pool_config: Config) -> list[NodePool]:
    """The three pools, in order."""
    return pool_config.prices.pools


FILES: dict[str, tuple[Callable[[], bytes], str]] = {
    "focus-1.0-csv": (lambda: FOCUS_1_0_CSV, "csv"),
    "focus-1.2-csv": (focus_1_2_csv, "csv"),
    "focus-0.5-names-csv": (focus_0_5_csv, "csv"),
    "focus-1.3-parquet-map-tags": (focus_1_3_parquet, "parquet"),
    "focus-1.0-parquet-struct-tags": (focus_1_0_parquet_struct, "parquet"),
}


@pytest.mark.parametrize("name", list(FILES))
def test_each_focus_version_and_format_sums_to_the_same_cents(
    name: str, pools: list[NodePool]
) -> None:
    """Every column set and format of the same items: the same totals per month and pool."""
    make, fmt = FILES[name]
    invoice = parse_invoice(make(), name, pools, fmt)  # type: ignore[arg-type]
    assert invoice.totals == EXPECTED
    assert (invoice.unmatched.line_items, invoice.unmatched.billed_cents) == (2, 1300)
    # The struct-tagged file has no ServiceCategory (an optional column): one group, "".
    by_service = (
        (("", 2, 1300),) if "struct" in name else (("Storage", 1, 1234), ("Networking", 1, 66))
    )
    assert invoice.unmatched.by_service == by_service
    assert (invoice.excluded.line_items, invoice.excluded.billed_cents) == (1, 8000)
    assert invoice.rows == 10


def test_tax_counts_only_when_asked(pools: list[NodePool]) -> None:
    """With tax: h100 October is 1149.995 + 80.00 = 1229.995 USD, 122999.5 cents, half to even 123000."""
    invoice = parse_invoice(FOCUS_1_0_CSV, "t.csv", pools, "csv", include_tax=True)
    assert invoice.totals[0] == PoolMonth("2026-10", "h100-reserved", 123000, 5)
    assert invoice.excluded.line_items == 0


def test_a_resource_id_claims_an_item_whatever_its_tags(pools: list[NodePool]) -> None:
    """An item whose id is h100-reserved's goes there even with l40s-spot's tags."""
    text = FOCUS_1_0_CSV.replace(b",i-0l40s2,", b",i-0h100b,")
    totals = {
        (t.month, t.pool): t.billed_cents for t in parse_invoice(text, "t.csv", pools, "csv").totals
    }
    # November: 2.50 USD moves from l40s-spot (left with 3 cents of row 6) to h100-reserved.
    assert totals[("2026-11", "h100-reserved")] == 250
    assert totals[("2026-11", "l40s-spot")] == 3


@pytest.mark.parametrize(
    ("cost", "start", "end", "parts"),
    [
        # 36 hours, 24 in October: 10 cents x 2/3 = 6.67, x 1/3 = 3.33: 7 and 3.
        (
            "0.10",
            "2026-10-31T00:00:00Z",
            "2026-11-01T12:00:00Z",
            [("2026-10", "0.07"), ("2026-11", "0.03")],
        ),
        # A credit splits the same way, negative.
        (
            "-0.10",
            "2026-10-31T00:00:00Z",
            "2026-11-01T12:00:00Z",
            [("2026-10", "-0.07"), ("2026-11", "-0.03")],
        ),
        # Sub-cent amounts split in their own last place: 0.0001 units, 1000 x 1/2 each.
        (
            "0.1000",
            "2026-10-31T12:00:00Z",
            "2026-11-01T12:00:00Z",
            [("2026-10", "0.0500"), ("2026-11", "0.0500")],
        ),
        # Three months: Nov 30 d, plus a day each side (32 days): 100 cents x 1/32, 30/32, 1/32
        # = 3.125, 93.75, 3.125: floors 3 + 93 + 3 = 99, the cent to December's .75.
        (
            "1.00",
            "2026-10-31T00:00:00Z",
            "2026-12-02T00:00:00Z",
            [("2026-10", "0.03"), ("2026-11", "0.94"), ("2026-12", "0.03")],
        ),
        # Equal remainders: the earlier month takes the cent (3 cents, 12 h each side).
        (
            "0.03",
            "2026-10-31T12:00:00Z",
            "2026-11-01T12:00:00Z",
            [("2026-10", "0.02"), ("2026-11", "0.01")],
        ),
    ],
)
def test_an_item_spanning_months_is_split_by_its_seconds_exactly(
    cost: str, start: str, end: str, parts: list[tuple[str, str]]
) -> None:
    """The parts are in proportion to the seconds in each month and add up to the item."""
    us = [int(_time(t).timestamp()) * 1_000_000 for t in (start, end)]
    found = split_by_month(Decimal(cost), us[0], us[1])
    assert found == [(m, Decimal(p)) for m, p in parts]
    assert sum(p for _, p in found) == Decimal(cost)


def _bad(text: bytes, pools: list[NodePool], fmt: str = "csv", **kw: Any) -> str:
    with pytest.raises(InvoiceError) as caught:
        parse_invoice(text, "invoice.csv", pools, fmt, **kw)  # type: ignore[arg-type]
    return caught.value.message


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            b"2026-10-03T00:00:00Z,Usage,,H100 hours",
            b"yesterday,Usage,,H100 hours",
            "invoice.csv: row 2, column ChargePeriodEnd: 'yesterday' is not an ISO 8601 date-time",
        ),
        (
            b",Purchase,,H100 commitment,1000.00,",
            b",Purchase,,H100 commitment,1,000.00,",
            "invoice.csv: row 3: 20 fields, the header 19",
        ),
        (
            b",Credit,,SLA credit,-50.005,",
            b",Credit,,SLA credit,abc,",
            "invoice.csv: row 4, column BilledCost: 'abc' is not a decimal number",
        ),
        (
            b",Credit,,SLA credit,",
            b",Refund,,SLA credit,",
            "invoice.csv: row 4, column ChargeCategory: 'Refund' is not a FOCUS charge category",
        ),
        (
            b'"{""team"": ""ml""}"',
            b'"[1, 2]"',
            "invoice.csv: row 2, column Tags: '[1, 2]' is not a JSON object",
        ),
        (
            b"2026-10-31T00:00:00Z,2026-11-01T12:00:00Z",
            b"2026-10-31T00:00:00Z,2026-10-30T12:00:00Z",
            "invoice.csv: row 6, column ChargePeriodEnd: '2026-10-30T12:00:00Z' is before ChargePeriodStart",
        ),
    ],
)
def test_a_malformed_file_is_refused_naming_row_and_column(
    old: bytes, new: bytes, message: str, pools: list[NodePool]
) -> None:
    """The first bad value is named by file, row and column; nothing is returned."""
    assert old in FOCUS_1_0_CSV
    assert _bad(FOCUS_1_0_CSV.replace(old, new, 1), pools).startswith(message)


def test_a_currency_other_than_usd_is_refused(pools: list[NodePool]) -> None:
    """One EUR item refuses the whole file, naming it."""
    text = FOCUS_1_0_CSV.replace(b"acct-1,USD,2026-11-01", b"acct-1,EUR,2026-11-01")
    assert _bad(text, pools) == (
        "invoice.csv: row 7, column BillingCurrency: 'EUR'; only USD invoices can be compared "
        "with the price book, which is in USD"
    )


def test_a_file_without_a_required_column_is_refused(pools: list[NodePool]) -> None:
    """No BilledCost: refused by name, not read as zero."""
    text = FOCUS_1_0_CSV.replace(b",BilledCost,", b",Cost,", 1)
    assert _bad(text, pools).startswith("invoice.csv: no column BilledCost")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_file_over_the_bounds_is_refused_before_it_is_summed(
    fmt: str, pools: list[NodePool]
) -> None:
    """Over the byte or row limit: refused naming the file and the limit."""
    data = FOCUS_1_0_CSV if fmt == "csv" else focus_1_3_parquet()
    assert _bad(data, pools, fmt, max_rows=9) == "invoice.csv: 10 line items, over the limit of 9"
    assert _bad(data, pools, fmt, max_bytes=100) == (
        f"invoice.csv: {len(data)} bytes, over the limit of 100"
    )


def test_the_unclaimed_summary_lists_at_most_30_service_categories(pools: list[NodePool]) -> None:
    """40 categories of unclaimed items: the 30 costliest are listed, the totals count all 40."""
    header = b"BilledCost,BillingCurrency,ChargePeriodStart,ChargePeriodEnd,ChargeCategory,ServiceCategory"
    rows = [b"%d.00,USD,2026-10-01,2026-10-02,Usage,cat-%02d" % (n, n) for n in range(1, 41)]
    invoice = parse_invoice(b"\n".join([header, *rows]), "many.csv", pools, "csv")
    # 1 + 2 + ... + 40 = 820 USD; listed: cat-40 (4000 cents) down to cat-11.
    assert (invoice.unmatched.line_items, invoice.unmatched.billed_cents) == (40, 82000)
    assert len(invoice.unmatched.by_service) == 30
    assert invoice.unmatched.by_service[0] == ("cat-40", 1, 4000)
    assert invoice.unmatched.by_service[-1] == ("cat-11", 1, 1100)


# -- the ledger ---------------------------------------------------------------------------


def _invoice(pools: list[NodePool], text: bytes = FOCUS_1_0_CSV, name: str = "oct.csv") -> Invoice:
    return parse_invoice(text, name, pools, "csv")


def test_importing_the_same_file_again_changes_nothing(
    ledger: Ledger, pools: list[NodePool]
) -> None:
    """The second import writes no row and keeps the first import's time."""
    first = invoice_store.import_invoice(ledger, _invoice(pools), now=100.0)
    again = invoice_store.import_invoice(ledger, _invoice(pools), now=200.0)
    assert len(first.changed) == 4
    assert (again.changed, again.dirty_months) == ((), ())
    assert invoice_store.invoices(ledger, "2026-10") == {
        "h100-reserved": 115000,
        "l40s-any": 400,
        "l40s-spot": 7,
    }
    assert invoice_store.invoices(ledger, "2026-11") == {"l40s-spot": 253}
    assert invoice_store.invoices(ledger, "2026-12") == {}
    assert {r["imported_at"] for r in invoice_store.invoice_rows(ledger)} == {100.0}


def test_a_reissued_invoice_replaces_its_pools_and_marks_a_closed_month_dirty(
    ledger: Ledger, pools: list[NodePool]
) -> None:
    """A newer file for October replaces the pools it covers, keeps the others, and October,
    already closed, has late changes; November, open, is not marked."""
    invoice_store.import_invoice(ledger, _invoice(pools), now=100.0)
    closing.freeze(ledger, "2026-10", closing.issued_lines(ledger), [], now=150.0)
    assert closing.month_state(ledger, "2026-10") == (True, False)
    # Re-issued: the egress row billed to h100 (its ResourceId), l40s items left out.
    reissued = b"\n".join(
        line for line in FOCUS_1_0_CSV.splitlines() if b"i-0l40s" not in line
    ).replace(
        b"2026-10-02T00:00:00Z,Usage,,Egress,0.66,0.66,Cloud,Cloud,Cloud,,",
        b"2026-10-02T00:00:00Z,Usage,,Egress,0.66,0.66,Cloud,Cloud,Cloud,i-0h100a,",
    )
    stored = invoice_store.import_invoice(
        ledger, _invoice(pools, reissued, "oct-v2.csv"), now=300.0
    )
    # 1149.995 + 0.66 = 1150.655 USD: 115065.5 cents, half to even 115066.
    assert invoice_store.invoices(ledger, "2026-10") == {
        "h100-reserved": 115066,
        "l40s-any": 400,
        "l40s-spot": 7,
    }
    assert stored.changed == (("2026-10", "h100-reserved"),)
    assert stored.dirty_months == ("2026-10",)
    assert closing.month_state(ledger, "2026-10") == (True, True)
    assert [(i["source"], i["months"]) for i in invoice_store.invoice_imports(ledger)] == [
        ("oct-v2.csv", ["2026-10"]),
        ("oct.csv", ["2026-10", "2026-11"]),
    ]


def test_a_closed_month_the_same_file_leaves_alone_stays_clean(
    ledger: Ledger, pools: list[NodePool]
) -> None:
    """Importing a file already kept after closing its month does not mark the month."""
    invoice_store.import_invoice(ledger, _invoice(pools), now=100.0)
    closing.freeze(ledger, "2026-10", closing.issued_lines(ledger), [], now=150.0)
    invoice_store.import_invoice(ledger, _invoice(pools), now=200.0)
    assert closing.month_state(ledger, "2026-10") == (True, False)


# -- the route and the command, over real HTTP -----------------------------------------------


@pytest.fixture(scope="module")
def service(pool_config: Config) -> Iterator[Service]:
    """Billing with the pools over an in-memory ledger, in a thread, and a token per caller."""
    ledger = Ledger.open(":memory:", [t.name for t in pool_config.teams], {})
    with billing_thread(pool_config, ledger) as url:
        tokens = {"admin": ADMIN, "member": SEARCH}
        with httpx.Client(base_url=url) as client:
            for role in ("finance", "viewer"):
                made = client.post("/v1/keys", json={"role": role}, headers=bearer(ADMIN))
                assert made.status_code == 201, made.text
                tokens[role] = made.json()["key"]
        yield url, tokens, ledger
    ledger.close()


def test_finance_imports_over_http_and_readers_list_it(service: Service) -> None:
    """Finance posts the CSV: the totals and the unclaimed items come back, the import is on
    the audit trail, and GET /v1/invoices?month= lists the month's rows."""
    url, tokens, _ = service
    with httpx.Client(base_url=url) as client:
        answer = client.post(
            "/v1/invoices",
            content=FOCUS_1_0_CSV,
            params={"source": "oct.csv"},
            headers=bearer(tokens["finance"]) | {"content-type": "text/csv"},
        )
        listed = client.get(
            "/v1/invoices", params={"month": "2026-11"}, headers=bearer(tokens["viewer"])
        )
        trail = client.get(
            "/v1/audit", params={"action": "invoice.imported"}, headers=bearer(ADMIN)
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [(t["month"], t["pool"], t["billed_cents"]) for t in body["totals"]] == [
        (t.month, t.pool, t.billed_cents) for t in EXPECTED
    ]
    assert body["unmatched"]["line_items"] == 2
    assert body["unmatched"]["billed_cents"] == 1300
    assert listed.status_code == 200
    assert [(r["pool"], r["billed_cents"], r["source"]) for r in listed.json()["invoices"]] == [
        ("l40s-spot", 253, "oct.csv")
    ]
    events = [e for e in trail.json()["events"] if e["action"] == "invoice.imported"]
    assert events[-1]["actor_role"] == "finance"
    assert events[-1]["target"] == f"invoice:{body['sha256']}"


@pytest.mark.parametrize(
    ("caller", "method", "status"),
    [
        ("viewer", "POST", 403),
        ("member", "POST", 403),
        ("member", "GET", 403),
        ("admin", "POST", 200),
    ],
)
def test_only_the_admin_and_finance_import(
    service: Service, caller: str, method: str, status: int
) -> None:
    """A viewer lists but may not import; a team may do neither; the admin may import (Parquet)."""
    url, tokens, _ = service
    with httpx.Client(base_url=url) as client:
        answer = client.request(
            method,
            "/v1/invoices",
            content=focus_1_3_parquet() if method == "POST" else None,
            params={"format": "parquet"} if method == "POST" else None,
            headers=bearer(tokens[caller]),
        )
    assert answer.status_code == status, answer.text


def test_a_malformed_upload_is_a_400_naming_the_row_and_keeps_nothing(service: Service) -> None:
    """A bad cost in row 4: 400 with the row and column; the ledger holds nothing of the file."""
    url, _, ledger = service
    bad = FOCUS_1_0_CSV.replace(b"-50.005", b"lots")
    with httpx.Client(base_url=url) as client:
        answer = client.post(
            "/v1/invoices",
            content=bad,
            params={"source": "bad.csv"},
            headers=bearer(ADMIN) | {"content-type": "text/csv"},
        )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "bad.csv: row 4, column BilledCost: 'lots' is not a decimal number"
    )
    assert all(r["source"] != "bad.csv" for r in invoice_store.invoice_rows(ledger))


def test_the_command_imports_through_the_service_and_into_a_file(
    service: Service, config_file: Path, tmp_path: Path
) -> None:
    """``infermeter invoices import``: through billing with a token, and into a stopped ledger
    file with --database; both print the totals and what no pool claimed."""
    url, _, _ = service
    invoice = tmp_path / "nov.csv"
    invoice.write_bytes(FOCUS_1_0_CSV)
    env = os.environ | {"INFERMETER_ADMIN_TOKEN": ADMIN}
    command = [
        sys.executable,
        "-m",
        "launcher",
        "invoices",
        "import",
        str(invoice),
        "--config",
        str(config_file),
    ]
    online = subprocess.run(
        [*command, "--billing-url", url],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    offline = subprocess.run(
        [*command, "--database", str(tmp_path / "ledger.duckdb")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    for done in (online, offline):
        assert done.returncode == 0, done.stderr
        assert "2026-10  h100-reserved                  1,150.00        4\n" in done.stdout
        assert "claimed by no pool: 2 items, 13.00 USD" in done.stdout


def test_a_file_neither_reader_can_read_is_refused_not_a_server_error(
    pools: list[NodePool],
) -> None:
    """A quoted field left open past the standard reader's field limit (128 KiB), which polars
    refuses too: an InvoiceError naming the file and the line, so the route answers 400."""
    text = b'a,b\n"' + b"q" * 200_000 + b"\n1,2,3\n"
    message = _bad(text, pools)
    assert message.startswith("invoice.csv: line ")
    assert "field larger than field limit" in message


def test_a_pool_s_month_billed_below_zero_is_refused(pools: list[NodePool]) -> None:
    """A credit-only file: imported, it would stand for the pool's month (a file replaces its
    pools' months whole) and scale every team's cost below zero. Refused, naming the pool."""
    header, *rows = FOCUS_1_0_CSV.decode().splitlines()
    credit = [r for r in rows if ",Credit," in r]
    message = _bad(("\n".join([header, *credit]) + "\n").encode(), pools)
    assert message.startswith("invoice.csv: node pool h100-reserved's total for 2026-10 is -50.00")
    assert "below zero" in message
