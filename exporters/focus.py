"""FinOps FOCUS files (1.0, and 1.2 on request) from a statement.

One row per statement line (team, model, month charged), or, when the statement's lines are
split by instance (``billing.statement.instance_lines``: columns ``replica`` and ``instance``),
one row per line and instance. The platform is the provider and the invoice issuer; each team is
a sub-account; the resource is the instance (the engine, a pod in Kubernetes) that served the
line, grouped by its replica group in ``x_ReplicaGroup`` and the tags; a line not split by
instance (an unpriced GPU's error line, a statement without the split) has the model as its
resource. Costs carry no discounts
here, so list, contracted, effective and billed cost are the same number. Late records of a
closed month appear as ``ChargeClass = Correction`` rows whose charge period is that month.
Custom columns (``x_`` prefix, as FOCUS requires) carry what FOCUS has no column for: team,
model, replica group, tokens, requests, energy and the cost components.

Unit prices (``ListUnitPrice``, ``ContractedUnitPrice``: USD per GPU-hour of the line) are not
divided out of the line's cents, whose rounding would swing the price of a small line by
dollars per GPU-hour. Compute and energy are priced again, unrounded, from the line's measured
GPU-hours and kWh at the price book's rates (GPU-hours x the model's GPU price, kWh x price x
PUE), as allocation priced them; only the idle-capacity share, which allocation does not carry
per line, is taken in cents. A model whose replicas run on differently priced GPUs, and a line
that could not be priced, fall back to the cents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import polars as pl

from exporters.chargeback_csv import defuse
from infermeter.config import Config
from infermeter.months import month_bounds
from infermeter.statement import Statement

__all__ = ["FOCUS_1_2_MANDATORY", "focus_frame", "gpu_hour_prices", "unit_price_usd"]

# The FOCUS 1.2 specification's mandatory columns.
FOCUS_1_2_MANDATORY: Final = (
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargePeriodEnd",
    "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceIssuerName", "ListCost",
    "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName", "ServiceCategory",
    "ServiceName",
)  # fmt: skip
PROVIDER: Final = "infermeter"
# How allocation names a line it could not price; such a line costs nothing.
_UNPRICED: Final = "(error) "
SERVICE_NAME: Final = "LLM Inference"
SERVICE_CATEGORY: Final = "AI and Machine Learning"


def _utc(t: float) -> str:
    return pl.from_epoch(pl.Series([int(t)]), time_unit="s").dt.strftime("%Y-%m-%dT%H:%M:%SZ")[0]  # type: ignore[no-any-return]


def _usd(cents: str) -> pl.Expr:
    """Whole cents as USD, an exact Decimal with two places."""
    return pl.col(cents).cast(pl.Decimal(38, 2)) / 100


def _decimal(value: pl.Expr) -> pl.Expr:
    """``value`` as a Decimal with six places: written with its decimal point even when whole.

    FOCUS types these columns Decimal, and readers (focus-validator's pandas among them) take a
    column of ``0`` or ``1`` for integers, so a float column whose values are all whole fails.
    """
    return value.round(6).cast(pl.Decimal(38, 6))


def gpu_hour_prices(config: Config) -> dict[str, float]:
    """USD per GPU-hour of each model whose replicas all run on GPUs of one price."""
    book = config.prices.usd_per_gpu_hour
    prices: dict[str, set[float]] = {}
    for replica in config.replicas:
        price = book.get(replica.gpu_model)
        prices.setdefault(replica.model, set()).add(-1.0 if price is None else price)
    return {m: p.pop() for m, p in prices.items() if len(p) == 1 and min(p) >= 0}


def unit_price_usd(prices: Mapping[str, float], usd_per_kwh: float, pue: float) -> pl.Expr:
    """USD per GPU-hour of each line, from its unrounded compute and energy cost (see above)."""
    hours = pl.col("gpu_hours")
    rate = pl.col("model").replace_strict(dict(prices), default=None, return_dtype=pl.Float64)
    repriced = rate.is_not_null() & ~pl.col("model").str.starts_with(_UNPRICED)
    exact = hours * rate + pl.col("energy_kwh") * (usd_per_kwh * pue) + pl.col("idle_cents") / 100
    cost = pl.when(repriced).then(exact).otherwise(pl.col("total_cents") / 100)
    return pl.when(hours > 0).then(cost / hours).otherwise(None)


def focus_frame(statement: Statement, config: Config, version: str = "1.0") -> pl.DataFrame:
    """The statement as FOCUS ``version`` ("1.0" or "1.2") rows."""
    if version not in ("1.0", "1.2"):
        raise ValueError(f"FOCUS version {version!r} is not supported; use 1.0 or 1.2")
    start, end = month_bounds(statement.month)
    lines = statement.lines
    if "instance" not in lines.columns:
        lines = lines.with_columns(
            pl.lit(None, dtype=pl.String).alias("replica"),
            pl.lit(None, dtype=pl.String).alias("instance"),
        )
    by_instance = pl.col("instance").is_not_null()
    resource = pl.coalesce("instance", "model")
    periods = {
        m: tuple(_utc(t) for t in month_bounds(m)) for m in set(lines["for_month"].to_list())
    }
    total = _usd("total_cents")
    correction = pl.col("for_month") != pl.lit(statement.month)
    prices = config.prices
    unit_price = _decimal(unit_price_usd(gpu_hour_prices(config), prices.usd_per_kwh, prices.pue))
    frame = lines.select(
        total.alias("BilledCost"),
        pl.lit(PROVIDER).alias("BillingAccountId"),
        pl.lit("infermeter GPU inference fleet").alias("BillingAccountName"),
        pl.lit(config.prices.currency).alias("BillingCurrency"),
        pl.lit(_utc(end)).alias("BillingPeriodEnd"),
        pl.lit(_utc(start)).alias("BillingPeriodStart"),
        pl.lit("Usage").alias("ChargeCategory"),
        pl.when(correction).then(pl.lit("Correction")).otherwise(pl.lit(None, dtype=pl.String)).alias("ChargeClass"),
        pl.format("GPU inference on {} for team {} ({})", "model", "team", "for_month").alias("ChargeDescription"),
        pl.lit("Usage-Based").alias("ChargeFrequency"),
        pl.col("for_month").replace_strict({m: p[1] for m, p in periods.items()}, return_dtype=pl.String).alias("ChargePeriodEnd"),
        pl.col("for_month").replace_strict({m: p[0] for m, p in periods.items()}, return_dtype=pl.String).alias("ChargePeriodStart"),
        total.alias("ContractedCost"),
        total.alias("EffectiveCost"),
        pl.lit(PROVIDER).alias("InvoiceIssuerName"),
        total.alias("ListCost"),
        _decimal(pl.col("gpu_hours")).alias("PricingQuantity"),
        pl.lit("GPU-Hours").alias("PricingUnit"),
        pl.lit(PROVIDER).alias("ProviderName"),
        pl.lit(PROVIDER).alias("PublisherName"),
        resource.alias("ResourceId"),
        resource.alias("ResourceName"),
        pl.when(by_instance).then(pl.lit("LLM Inference Instance")).otherwise(pl.lit("LLM Model")).alias("ResourceType"),
        pl.lit(SERVICE_CATEGORY).alias("ServiceCategory"),
        pl.lit(SERVICE_NAME).alias("ServiceName"),
        pl.col("team").alias("SubAccountId"),
        pl.col("team").alias("SubAccountName"),
        _decimal(pl.col("gpu_hours")).alias("ConsumedQuantity"),
        pl.lit("GPU-Hours").alias("ConsumedUnit"),
        pl.lit(None, dtype=pl.String).alias("AvailabilityZone"),
        pl.lit(None, dtype=pl.String).alias("CommitmentDiscountCategory"),
        pl.lit(None, dtype=pl.String).alias("CommitmentDiscountId"),
        pl.lit(None, dtype=pl.String).alias("CommitmentDiscountName"),
        pl.lit(None, dtype=pl.String).alias("CommitmentDiscountStatus"),
        pl.lit(None, dtype=pl.String).alias("CommitmentDiscountType"),
        unit_price.alias("ContractedUnitPrice"),
        unit_price.alias("ListUnitPrice"),
        pl.lit("Standard").alias("PricingCategory"),
        pl.lit(None, dtype=pl.String).alias("RegionId"),
        pl.lit(None, dtype=pl.String).alias("RegionName"),
        pl.format("gpu-inference/{}", "model").alias("SkuId"),
        pl.format("gpu-inference/{}/{}", "model", "for_month").alias("SkuPriceId"),
        # Serialised as JSON, not formatted: a model name is whatever a client sent. The replica
        # group is a tag only on rows of an instance.
        pl.when(by_instance)
        .then(pl.struct("team", "model", pl.col("replica").alias("replica_group")).struct.json_encode())
        .otherwise(pl.struct("team", "model").struct.json_encode())
        .alias("Tags"),
        pl.col("team").alias("x_Team"),
        pl.col("model").alias("x_Model"),
        pl.col("replica").alias("x_ReplicaGroup"),
        pl.col("for_month").alias("x_UsageMonth"),
        pl.col("requests").alias("x_Requests"),
        pl.col("prompt_tokens").alias("x_PromptTokens"),
        pl.col("completion_tokens").alias("x_CompletionTokens"),
        _decimal(pl.col("energy_kwh")).alias("x_EnergyKWh"),
        _usd("compute_cents").alias("x_ComputeCost"),
        _usd("energy_cents").alias("x_EnergyCost"),
        _usd("idle_cents").alias("x_IdleCost"),
    )  # fmt: skip
    if version == "1.0":
        # focus-validator 1.0.0, the reference validator, still checks these pre-1.0 names.
        frame = frame.with_columns(
            pl.lit("Usage").alias("ChargeType"),
            pl.lit(PROVIDER).alias("InvoiceIssuer"),
            pl.lit(PROVIDER).alias("Provider"),
            pl.lit(PROVIDER).alias("Publisher"),
            pl.col("ResourceId").alias("ResourceID"),
        )
    else:
        frame = frame.with_columns(
            pl.lit("Generative AI").alias("ServiceSubcategory"),
            pl.lit(f"infermeter-{statement.month}").alias("InvoiceId"),
            pl.lit("Internal chargeback").alias("BillingAccountType"),
            pl.lit("Team").alias("SubAccountType"),
        )
    text_columns = [
        c for c, t in frame.schema.items() if t == pl.String and c not in ("ChargeClass", "Tags")
    ]
    return frame.with_columns(defuse(c) for c in text_columns)
