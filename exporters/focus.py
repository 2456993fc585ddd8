"""FinOps FOCUS files (1.0; 1.2 and 1.3 on request) from a statement.

One row per statement line (team, model, month charged), or, when the statement's lines are
split by instance (``billing.statement.instance_lines``: columns ``replica`` and ``instance``),
one row per line and instance; lines also split by the requests' tags (``project``, ``user``)
give a row each, tagged with them. The platform is the provider and the invoice issuer; each
team is a sub-account; the resource is the instance (the engine, a pod in Kubernetes) that
served the line, grouped by its replica group in ``x_ReplicaGroup`` and the tags; a line not
split by instance (an unpriced GPU's error line, a statement without the split) has the model
as its resource. Late records of a closed month appear as ``ChargeClass = Correction`` rows
whose charge period is that month. Custom columns (``x_`` prefix, as FOCUS requires) carry what
FOCUS has no column for: team, model, replica group, node pool, tokens (cached prompt tokens
among them), requests, energy and the cost components.

Which cost column carries which basis (``exporters.focus_lines`` prepares the rows):

- ``BilledCost`` and ``EffectiveCost``: the statement's lines, what each team is charged. On the
  ``allocation`` basis these are scaled per node pool to its imported invoice; on the ``list``
  basis they are at the price book's prices.
- ``ListCost``: the usage basis, the price book's prices (``statement.usage_lines`` on the
  allocation basis, the lines themselves on the list basis).
- ``ContractedCost``: the price the platform contracted for, which is the price book's (a
  committed pool's rate is its commitment's), so it equals ``ListCost``.

A reader can reconcile: ``BilledCost`` summed over the file is the statement's total to the
cent (fleet cost plus adjustments), plus the unused commitments the statement's lines do not
carry (``exporters.focus_lines``); ``ListCost`` summed over the same rows is the usage basis's
total; ``BilledCost - ListCost`` on a row is what matching the invoices moved.

Pricing: ``PricingCategory`` is the row's node pool's category (``on_demand`` Standard,
``committed`` Committed, ``spot`` Dynamic, ``owned`` Other; a row with none is on-demand at its
GPU model's price). A committed pool's rows carry its commitment (``CommitmentDiscountId`` and
the rest, status ``Used``) and the commitment it left unused is a row of its own on the
platform's account (status ``Unused``, no consumed quantity), so Used and Unused add up to what
the commitment cost. ``SkuId`` is the pool price entry's ``sku`` when it names one, else a
stable id from the pool (``gpu-hours/<pool>``) or the model (``gpu-inference/<model>``).

Prompt caching: FOCUS's drafts split token-priced SKUs into a row per cache status. Rows here
are priced per GPU-hour, and a cached token has no price of its own (it weighs less in the
team's share of the GPU time), so a row is not split; ``x_CachedPromptTokens`` and
``x_CacheSavingsCost`` carry the hits and what they saved the team.

Unit prices (``ListUnitPrice``, ``ContractedUnitPrice``: USD per GPU-hour of the line) are not
divided out of the line's cents, whose rounding would swing the price of a small line by
dollars per GPU-hour. Compute and energy are priced again, unrounded, from the line's measured
GPU-hours and kWh at the price book's rates (GPU-hours x the model's GPU price, kWh x price x
PUE), as allocation priced them; only the idle-capacity share, which allocation does not carry
per line, is taken in cents. A model whose replicas run on differently priced GPUs, a row of a
node pool, and a line that could not be priced, fall back to the usage basis's cents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import polars as pl

from exporters.chargeback_csv import defuse
from exporters.focus_lines import PRICING_CATEGORIES, focus_lines, pool_skus
from infermeter.config import Config
from infermeter.months import month_bounds
from infermeter.statement import Statement

__all__ = [
    "FOCUS_1_2_MANDATORY",
    "FOCUS_1_3_MANDATORY",
    "FOCUS_VERSIONS",
    "focus_frame",
    "gpu_hour_prices",
    "unit_price_usd",
]

FOCUS_VERSIONS: Final = ("1.0", "1.2", "1.3")
# The FOCUS 1.2 specification's mandatory columns.
FOCUS_1_2_MANDATORY: Final = (
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
)
# FOCUS 1.3 keeps them (ProviderName and PublisherName deprecated, still mandatory) and adds the
# two that replace them.
FOCUS_1_3_MANDATORY: Final = (*FOCUS_1_2_MANDATORY, "HostProviderName", "ServiceProviderName")
PROVIDER: Final = "infermeter"
# How allocation names a line it could not price; such a line costs nothing.
_UNPRICED: Final = "(error) "
SERVICE_NAME: Final = "LLM Inference"
SERVICE_CATEGORY: Final = "AI and Machine Learning"
GPU_HOURS: Final = "GPU-Hours"
# The JSON columns, left as they are (a JSON text cell never starts with a formula character).
_JSON_COLUMNS: Final = ("Tags", "AllocatedMethodDetails", "AllocatedTags")
# FOCUS 1.3's split cost allocation columns, in its files only.
ALLOCATION_COLUMNS: Final = (
    "AllocatedMethodId",
    "AllocatedMethodDetails",
    "AllocatedResourceId",
    "AllocatedResourceName",
    "AllocatedTags",
)


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


def _null() -> pl.Expr:
    return pl.lit(None, dtype=pl.String)


def gpu_hour_prices(config: Config) -> dict[str, float]:
    """USD per GPU-hour of each model whose replicas all run on GPUs of one price."""
    book = config.prices.usd_per_gpu_hour
    prices: dict[str, set[float]] = {}
    for replica in config.replicas:
        price = book.get(replica.gpu_model)
        prices.setdefault(replica.model, set()).add(-1.0 if price is None else price)
    return {m: p.pop() for m, p in prices.items() if len(p) == 1 and min(p) >= 0}


def unit_price_usd(prices: Mapping[str, float], usd_per_kwh: float, pue: float) -> pl.Expr:
    """USD per GPU-hour of each row of ``focus_lines``, from its unrounded cost (see above)."""
    hours = pl.col("gpu_hours")
    rate = pl.col("model").replace_strict(dict(prices), default=None, return_dtype=pl.Float64)
    repriced = (
        rate.is_not_null()
        & ~pl.col("model").str.starts_with(_UNPRICED)
        & pl.col("pool").is_null()
        & (pl.col("kind") == "usage")
    )
    exact = hours * rate + pl.col("energy_kwh") * (usd_per_kwh * pue) + pl.col("idle_cents") / 100
    cost = pl.when(repriced).then(exact).otherwise(pl.col("list_cents") / 100)
    return pl.when(hours > 0).then(cost / hours).otherwise(None)


def _tags(*pairs: tuple[str, str]) -> pl.Expr:
    """A JSON object of the ``pairs`` (key, column) whose values are not null.

    Serialised by a JSON encoder, not formatted: a model name is whatever a client sent. The
    encoder writes nulls, which are cut out after: no key of ours needs escaping and an
    encoded value cannot hold ``,"key":null`` (its quotes are escaped), so only nulls match.
    """
    names = "|".join(k for k, _ in pairs[1:])
    encoded = pl.struct(*(pl.col(c).alias(k) for k, c in pairs)).struct.json_encode()
    return encoded.str.replace_all(f',"({names})":null', "")


def _commitment_columns(version: str) -> list[pl.Expr]:
    """The commitment discount of a committed pool's rows: Used on usage, Unused on its own row."""
    committed = pl.col("pricing_category") == "committed"
    pool = pl.col("pool").fill_null("unknown")

    def of_commitment(value: pl.Expr) -> pl.Expr:
        return pl.when(committed).then(value).otherwise(_null())

    status = pl.when(pl.col("kind") == "unused").then(pl.lit("Unused")).otherwise(pl.lit("Used"))
    columns = [
        of_commitment(pl.lit("Usage")).alias("CommitmentDiscountCategory"),
        of_commitment(pl.format("{}/pools/{}/commitment", pl.lit(PROVIDER), pool)).alias(
            "CommitmentDiscountId"
        ),
        of_commitment(pl.format("{} committed GPUs", pool)).alias("CommitmentDiscountName"),
        of_commitment(status).alias("CommitmentDiscountStatus"),
        of_commitment(pl.lit("Committed GPUs")).alias("CommitmentDiscountType"),
    ]
    if version != "1.0":  # Quantity and unit came with FOCUS 1.1
        columns += [
            pl.when(committed)
            .then(_decimal(pl.col("gpu_hours")))
            .alias("CommitmentDiscountQuantity"),
            of_commitment(pl.lit(GPU_HOURS)).alias("CommitmentDiscountUnit"),
        ]
    return columns


def _allocation_columns(config: Config) -> list[pl.Expr]:
    """FOCUS 1.3's split cost allocation: a row of an instance is a share of its cost.

    The origin charge is the instance's cost in the month charged (every row of the instance:
    the teams' shares, idle capacity by its group's policy); each row is the share allocated to
    a team's use of a model (with its project and user when the lines are split by them), by
    the allocation method the configuration names. ``AllocatedRatio`` is the row's cents over
    the instance's, so the ratios of an instance add up to 1 (all 0 for an instance that cost
    nothing).
    """
    allocated = pl.col("instance").is_not_null() & (pl.col("kind") == "usage")
    instance_cents = pl.col("total_cents").sum().over("for_month", "instance")
    ratio = pl.when(instance_cents != 0).then(pl.col("total_cents") / instance_cents).otherwise(0.0)
    element = pl.struct(
        ratio.round(9).alias("AllocatedRatio"),
        pl.lit(GPU_HOURS).alias("UsageUnit"),
        pl.col("gpu_hours").round(9).alias("UsageQuantity"),
    )
    details = pl.struct(pl.concat_list(element).alias("Elements")).struct.json_encode()
    target = pl.concat_str("team", "model", "project", "user", separator="/", ignore_nulls=True)

    def when_allocated(value: pl.Expr) -> pl.Expr:
        return pl.when(allocated).then(value).otherwise(_null())

    method = f"{PROVIDER}/{config.billing.allocation}"
    return [
        when_allocated(pl.lit(method)).alias("AllocatedMethodId"),
        when_allocated(details).alias("AllocatedMethodDetails"),
        when_allocated(target).alias("AllocatedResourceId"),
        when_allocated(pl.format("{} on {}", "team", "model")).alias("AllocatedResourceName"),
        when_allocated(_tags(("team", "team"), ("project", "project"), ("user", "user"))).alias(
            "AllocatedTags"
        ),
    ]


def focus_frame(
    statement: Statement, config: Config, version: str = "1.0", team: str | None = None
) -> pl.DataFrame:
    """The statement as FOCUS ``version`` ("1.0", "1.2" or "1.3") rows; with ``team``, only
    that team's rows of the whole statement's file.

    A team's file is cut from the whole one, not made from the team's lines alone: a row's
    ``AllocatedRatio`` is its share of the instance's cost over every team that used the
    instance, which the team's own lines cannot give."""
    if version not in FOCUS_VERSIONS:
        raise ValueError(f"FOCUS version {version!r} is not supported; use 1.0, 1.2 or 1.3")
    start, end = month_bounds(statement.month)
    skus = pool_skus(config.prices.pools, statement.month)
    rows = focus_lines(statement, config.billing.platform_account, skus)
    usage = pl.col("kind") == "usage"
    by_instance = pl.col("instance").is_not_null()
    pool_resource = pl.format("pool/{}", "pool")
    resource = pl.when(usage).then(pl.coalesce("instance", "model")).otherwise(pool_resource)
    periods = {m: tuple(_utc(t) for t in month_bounds(m)) for m in set(rows["for_month"].to_list())}
    billed = _usd("total_cents")
    listed = _usd("list_cents")
    correction = pl.col("for_month") != pl.lit(statement.month)
    prices = config.prices
    unit_price = _decimal(unit_price_usd(gpu_hour_prices(config), prices.usd_per_kwh, prices.pue))
    sku = pl.coalesce(
        "sku",
        pl.format("gpu-hours/{}", "pool"),
        pl.format("gpu-inference/{}", "model"),
    )
    sku_price = pl.coalesce(
        pl.format("{}/{}/{}", sku, "pricing_category", "for_month"),
        pl.format("{}/{}", sku, "for_month"),
    )
    category = pl.col("pricing_category").fill_null("on_demand")
    description = (
        pl.when(usage)
        .then(pl.format("GPU inference on {} for team {} ({})", "model", "team", "for_month"))
        .otherwise(pl.format("Unused commitment of node pool {} ({})", "pool", "for_month"))
    )
    frame = rows.select(
        billed.alias("BilledCost"),
        pl.lit(PROVIDER).alias("BillingAccountId"),
        pl.lit("infermeter GPU inference fleet").alias("BillingAccountName"),
        pl.lit(config.prices.currency).alias("BillingCurrency"),
        pl.lit(_utc(end)).alias("BillingPeriodEnd"),
        pl.lit(_utc(start)).alias("BillingPeriodStart"),
        pl.lit("Usage").alias("ChargeCategory"),
        pl.when(correction).then(pl.lit("Correction")).otherwise(_null()).alias("ChargeClass"),
        description.alias("ChargeDescription"),
        pl.lit("Usage-Based").alias("ChargeFrequency"),
        pl.col("for_month")
        .replace_strict({m: p[1] for m, p in periods.items()}, return_dtype=pl.String)
        .alias("ChargePeriodEnd"),
        pl.col("for_month")
        .replace_strict({m: p[0] for m, p in periods.items()}, return_dtype=pl.String)
        .alias("ChargePeriodStart"),
        listed.alias("ContractedCost"),
        billed.alias("EffectiveCost"),
        pl.lit(PROVIDER).alias("InvoiceIssuerName"),
        listed.alias("ListCost"),
        _decimal(pl.col("gpu_hours")).alias("PricingQuantity"),
        pl.lit(GPU_HOURS).alias("PricingUnit"),
        pl.lit(PROVIDER).alias("ProviderName"),
        pl.lit(PROVIDER).alias("PublisherName"),
        resource.alias("ResourceId"),
        resource.alias("ResourceName"),
        pl.when(~usage)
        .then(pl.lit("Node Pool Commitment"))
        .when(by_instance)
        .then(pl.lit("LLM Inference Instance"))
        .otherwise(pl.lit("LLM Model"))
        .alias("ResourceType"),
        pl.lit(SERVICE_CATEGORY).alias("ServiceCategory"),
        pl.lit(SERVICE_NAME).alias("ServiceName"),
        pl.col("team").alias("SubAccountId"),
        pl.col("team").alias("SubAccountName"),
        # FOCUS: no consumed quantity on an unused commitment's row.
        pl.when(usage).then(_decimal(pl.col("gpu_hours"))).alias("ConsumedQuantity"),
        pl.when(usage).then(pl.lit(GPU_HOURS)).otherwise(_null()).alias("ConsumedUnit"),
        _null().alias("AvailabilityZone"),
        *_commitment_columns(version),
        unit_price.alias("ContractedUnitPrice"),
        unit_price.alias("ListUnitPrice"),
        category.replace_strict(PRICING_CATEGORIES, default="Other", return_dtype=pl.String).alias(
            "PricingCategory"
        ),
        _null().alias("RegionId"),
        _null().alias("RegionName"),
        sku.alias("SkuId"),
        sku_price.alias("SkuPriceId"),
        _tags(
            ("team", "team"),
            ("model", "model"),
            ("replica_group", "replica"),
            ("project", "project"),
            ("user", "user"),
        ).alias("Tags"),
        pl.col("team").alias("x_Team"),
        pl.col("model").alias("x_Model"),
        pl.col("replica").alias("x_ReplicaGroup"),
        pl.col("pool").alias("x_NodePool"),
        pl.col("for_month").alias("x_UsageMonth"),
        pl.col("requests").alias("x_Requests"),
        pl.col("prompt_tokens").alias("x_PromptTokens"),
        pl.col("cached_prompt_tokens").alias("x_CachedPromptTokens"),
        pl.col("completion_tokens").alias("x_CompletionTokens"),
        _decimal(pl.col("energy_kwh")).alias("x_EnergyKWh"),
        _usd("compute_cents").alias("x_ComputeCost"),
        _usd("energy_cents").alias("x_EnergyCost"),
        _usd("idle_cents").alias("x_IdleCost"),
        _usd("cache_savings_cents").alias("x_CacheSavingsCost"),
        *_allocation_columns(config),
    )
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
    if version == "1.3":
        # The platform both provides the service and hosts it (its invoices' clouds are not
        # named per row); no contract commitment is modelled beyond the commitment discounts.
        frame = frame.with_columns(
            pl.lit(PROVIDER).alias("ServiceProviderName"),
            pl.lit(PROVIDER).alias("HostProviderName"),
            _null().alias("ContractApplied"),
        )
    else:
        frame = frame.drop(ALLOCATION_COLUMNS)
    if team is not None:
        frame = frame.filter(pl.col("x_Team") == team)
    text_columns = [
        c
        for c, t in frame.schema.items()
        if t == pl.String and c != "ChargeClass" and c not in _JSON_COLUMNS
    ]
    return frame.with_columns(defuse(c) for c in text_columns)
