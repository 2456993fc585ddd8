"""FOCUS 1.2 and 1.3 checks taken from the specification, for the versions focus-validator lacks.

The reference validator (``tests/focus_validator.py``, focus-validator 1.0.0) knows FOCUS 1.0
only. These checks are transcribed from the specification's column pages and requirements model
(FOCUS_Spec, ``specification/datasets/cost_and_usage/columns``): which columns exist in each
version, which are mandatory, the allowed values, and the requirements between columns that
the files here can break. They are not the whole specification: a check the validator would
make that is not listed here is not made.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Final

# FOCUS 1.2's columns (57), and its mandatory ones (feature level Mandatory).
FOCUS_1_2_COLUMNS: Final = frozenset(
    {
        "AvailabilityZone",
        "BilledCost",
        "BillingAccountId",
        "BillingAccountName",
        "BillingAccountType",
        "BillingCurrency",
        "BillingPeriodEnd",
        "BillingPeriodStart",
        "CapacityReservationId",
        "CapacityReservationStatus",
        "ChargeCategory",
        "ChargeClass",
        "ChargeDescription",
        "ChargeFrequency",
        "ChargePeriodEnd",
        "ChargePeriodStart",
        "CommitmentDiscountCategory",
        "CommitmentDiscountId",
        "CommitmentDiscountName",
        "CommitmentDiscountQuantity",
        "CommitmentDiscountStatus",
        "CommitmentDiscountType",
        "CommitmentDiscountUnit",
        "ConsumedQuantity",
        "ConsumedUnit",
        "ContractedCost",
        "ContractedUnitPrice",
        "EffectiveCost",
        "InvoiceId",
        "InvoiceIssuerName",
        "ListCost",
        "ListUnitPrice",
        "PricingCategory",
        "PricingCurrency",
        "PricingCurrencyContractedUnitPrice",
        "PricingCurrencyEffectiveCost",
        "PricingCurrencyListUnitPrice",
        "PricingQuantity",
        "PricingUnit",
        "ProviderName",
        "PublisherName",
        "RegionId",
        "RegionName",
        "ResourceId",
        "ResourceName",
        "ResourceType",
        "ServiceCategory",
        "ServiceName",
        "ServiceSubcategory",
        "SkuId",
        "SkuMeter",
        "SkuPriceDetails",
        "SkuPriceId",
        "SubAccountId",
        "SubAccountName",
        "SubAccountType",
        "Tags",
    }
)
FOCUS_1_2_MANDATORY: Final = frozenset(
    {
        "BilledCost",
        "BillingAccountId",
        "BillingAccountName",
        "BillingCurrency",
        "BillingPeriodEnd",
        "BillingPeriodStart",
        "ChargeCategory",
        "ChargeClass",
        "ChargeDescription",
        "ChargePeriodEnd",
        "ChargePeriodStart",
        "ContractedCost",
        "EffectiveCost",
        "InvoiceIssuerName",
        "ListCost",
        "PricingQuantity",
        "PricingUnit",
        "ProviderName",
        "PublisherName",
        "ServiceCategory",
        "ServiceName",
    }
)
# FOCUS 1.3 adds eight columns (ProviderName and PublisherName stay, deprecated); the two that
# name the providers are mandatory.
FOCUS_1_3_COLUMNS: Final = FOCUS_1_2_COLUMNS | {
    "AllocatedMethodDetails",
    "AllocatedMethodId",
    "AllocatedResourceId",
    "AllocatedResourceName",
    "AllocatedTags",
    "ContractApplied",
    "HostProviderName",
    "ServiceProviderName",
}
FOCUS_1_3_MANDATORY: Final = FOCUS_1_2_MANDATORY | {"HostProviderName", "ServiceProviderName"}
COLUMNS: Final = {"1.2": FOCUS_1_2_COLUMNS, "1.3": FOCUS_1_3_COLUMNS}
MANDATORY: Final = {"1.2": FOCUS_1_2_MANDATORY, "1.3": FOCUS_1_3_MANDATORY}

_ALLOWED: Final = {
    "ChargeCategory": {"Usage", "Purchase", "Tax", "Credit", "Adjustment"},
    "ChargeClass": {"", "Correction"},
    "ChargeFrequency": {"One-Time", "Recurring", "Usage-Based"},
    "PricingCategory": {"", "Standard", "Dynamic", "Committed", "Other"},
    "CommitmentDiscountStatus": {"", "Used", "Unused"},
    "CommitmentDiscountCategory": {"", "Spend", "Usage"},
}
_DATES: Final = ("BillingPeriodStart", "BillingPeriodEnd", "ChargePeriodStart", "ChargePeriodEnd")
_UTC_Z: Final = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
_DECIMALS: Final = (
    "BilledCost",
    "EffectiveCost",
    "ListCost",
    "ContractedCost",
    "PricingQuantity",
    "ConsumedQuantity",
    "ListUnitPrice",
    "ContractedUnitPrice",
    "CommitmentDiscountQuantity",
)
_COMMITMENT: Final = (
    "CommitmentDiscountCategory",
    "CommitmentDiscountName",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
)


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _json_object(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def spec_failures(rows: Sequence[Mapping[str, str]], version: str) -> list[str]:
    """Each way the FOCUS ``version`` ("1.2" or "1.3") file's ``rows`` (as csv.DictReader reads
    them: a null is "") break the checks above; empty when none does."""
    if not rows:
        return ["the file has no row"]
    header = set(rows[0])
    failures = [f"missing mandatory column {c}" for c in sorted(MANDATORY[version] - header)]
    failures += [
        f"{c} is not a FOCUS {version} column (custom columns start with x_)"
        for c in sorted(header - COLUMNS[version])
        if not c.startswith("x_")
    ]
    for i, row in enumerate(rows):
        failures += [f"row {i}: {m}" for m in _row_failures(row, version)]
    if version == "1.3":
        failures += _allocation_failures(rows)
    return failures


def _row_failures(row: Mapping[str, str], version: str) -> list[str]:
    out = [f"{c} is null" for c in sorted(MANDATORY[version] - {"ChargeClass"}) if row.get(c) == ""]
    out += [
        f"{c} {row[c]!r} is not allowed"
        for c, ok in _ALLOWED.items()
        if c in row and row[c] not in ok
    ]
    out += [f"{c} {row[c]!r} is not UTC with Z" for c in _DATES if not _UTC_Z.match(row[c])]
    for c in _DECIMALS:
        value = row.get(c, "")
        if value != "" and ("." not in value or _decimal(value) is None):
            out.append(f"{c} {value!r} is not a decimal")
    committed = row.get("CommitmentDiscountId", "") != ""
    out += [
        f"{c} is set without a CommitmentDiscountId"
        for c in _COMMITMENT
        if not committed and row.get(c, "") != ""
    ]
    if committed and row["ChargeCategory"] == "Usage" and row["CommitmentDiscountStatus"] == "":
        out.append("a usage row of a commitment has no CommitmentDiscountStatus")
    if row.get("PricingCategory") == "Committed" and not committed:
        out.append("PricingCategory Committed without a CommitmentDiscountId")
    if version != "1.0" and committed:
        out += [
            f"{c} is null on a row of a commitment"
            for c in ("CommitmentDiscountQuantity", "CommitmentDiscountUnit")
            if row.get(c, "") == ""
        ]
    unused = row.get("CommitmentDiscountStatus") == "Unused"
    if unused and (row["ConsumedQuantity"] != "" or row["ConsumedUnit"] != ""):
        out.append("an Unused commitment row has a consumed quantity or unit")
    if not unused and row["ChargeClass"] == "" and row["ConsumedQuantity"] == "":
        out.append("a usage row has no ConsumedQuantity")
    if row["SkuPriceId"] != "" and row["SkuId"] == "":
        out.append("SkuPriceId without SkuId")
    if row.get("PricingCategory", "") == "" and row["ChargeClass"] == "":
        out.append("a usage row has no PricingCategory")
    tags = _json_object(row["Tags"]) if row.get("Tags") else {}
    if tags is None or any(not isinstance(v, str) for v in tags.values()):
        out.append(f"Tags {row['Tags']!r} is not a JSON object of strings")
    for cost, price in (("ListCost", "ListUnitPrice"), ("ContractedCost", "ContractedUnitPrice")):
        unit = _decimal(row[price]) if row[price] else None
        quantity = _decimal(row["PricingQuantity"])
        if (
            unit is not None
            and quantity is not None
            and row["ChargeClass"] == ""
            and abs(unit * quantity - Decimal(row[cost])) > Decimal("0.01")
        ):
            out.append(f"{price} x PricingQuantity is not {cost}")
    if version == "1.3":
        out += [f"{c} is null" for c in ("ServiceProviderName", "HostProviderName") if row[c] == ""]
        if (row["AllocatedMethodId"] == "") != (row["AllocatedResourceId"] == ""):
            out.append("AllocatedMethodId and AllocatedResourceId are not null together")
        for c in ("AllocatedMethodDetails", "AllocatedTags", "ContractApplied"):
            if row[c] != "" and _json_object(row[c]) is None:
                out.append(f"{c} is not a JSON object")
    return out


def _allocation_failures(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """The AllocatedRatio of an origin charge's allocated rows add up to 1 (or all are 0)."""
    ratios: dict[tuple[str, str], float] = defaultdict(float)
    for row in rows:
        details = (
            _json_object(row["AllocatedMethodDetails"]) if row["AllocatedMethodDetails"] else None
        )
        if details is None:
            continue
        elements = details.get("Elements")
        if not isinstance(elements, list) or not elements:
            return [f"AllocatedMethodDetails {row['AllocatedMethodDetails']!r} has no Elements"]
        key = (row["ResourceId"], row["ChargePeriodStart"])
        ratios[key] += sum(float(e["AllocatedRatio"]) for e in elements)
    return [
        f"AllocatedRatio of {key} adds up to {total}"
        for key, total in ratios.items()
        if abs(total - 1) > 1e-6 and abs(total) > 1e-12
    ]
