"""Cost at the point of use: each model's measured cost per weighted token, for the sidecars.

A sidecar puts a cost estimate on every response (``sidecar.rates``) from the answer's tokens
and a rate it read from billing beforehand (``GET /v1/rates``), so no request waits on billing.
The rate of a model is what its replica groups' GPUs cost in the last complete hour (GPU time
at the price book's prices (``billing.pricebook``: a node pool's rate in effect, else
``prices.usd_per_gpu_hour``) plus energy at its USD per kWh x PUE, idle
time included: the whole cost the model's users pay for between them) over the tokens its
records carry in that hour, weighted as the ``tokens`` split weighs them
(``billing.token_weights``: prompt, cached prompt, completion). Without both in that hour, the
month so far; without either, unknown (null), never 0.

Read from the rollups (``gpu_slots``; ``alloc_hours`` and ``alloc_keys``), a few rows per hour,
and kept for a minute (``RateCache``): a fleet's sidecars all ask. ``rates_sql`` is pure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from billing.charges import Policy
from billing.ledger import Ledger
from billing.pricebook import compute_usd_sql, energy_usd_sql, priced_sql
from billing.schema import HOUR_SECONDS, SLOT_SECONDS
from infermeter.months import month_bounds, month_of

__all__ = ["TTL_SECONDS", "RateCache", "Window", "rates", "rates_sql", "read_rates", "weights"]

# How long an answer of ``GET /v1/rates`` is served before the ledger is read again.
TTL_SECONDS: Final = 60.0


@dataclass(frozen=True, slots=True)
class Window:
    """The span a rate was measured over: ``hour`` (the last complete one) or ``month`` so far."""

    basis: str
    start: float
    end: float


def _values(rows: Mapping[str, Any], names: tuple[str, str], kind: str) -> str:
    """A relation of ``rows`` as (names...), with the right types when empty."""

    def lit(v: Any) -> str:
        return "'" + v.replace("'", "''") + "'" if isinstance(v, str) else repr(float(v))

    if not rows:
        return f"(SELECT NULL::VARCHAR AS {names[0]}, NULL::{kind} AS {names[1]} WHERE false)"
    body = ", ".join(f"({lit(k)}, {lit(v)})" for k, v in sorted(rows.items()))
    return f"(SELECT * FROM (VALUES {body}) AS t({names[0]}, {names[1]}))"


def rates_sql(policy: Policy) -> str:
    """SQL of each model's cost (USD), weighted tokens and whether every GPU had a price.

    Parameters: the first and after-last slot, the first and after-last hour. A model's cost is
    its replica groups' (``Policy.replica_model``) GPU rows' (a row naming only its instance
    counts for the group that instance served in); a GPU model without a price makes its cost
    unknown rather than low.
    """
    w = weights(policy)
    wp, wc, wo = w["prompt"], w["cached_prompt"], w["completion"]
    groups = _values(policy.replica_model, ("replica", "model"), "VARCHAR")
    # Priced as statements price them: by node pool and minute (``billing.pricebook``).
    gpus = priced_sql(policy.prices, "(SELECT * FROM gpu_slots WHERE slot >= $1 AND slot < $2)")
    return f"""
WITH cost AS (
    SELECT g.model, sum({compute_usd_sql("s.gpu_seconds", "coalesce(s.usd, 0.0)")})
            + sum({energy_usd_sql("s.energy_joules", "s.kwh_usd")}) AS usd,
        bool_and(s.usd IS NOT NULL) AS priced
    FROM {gpus} s
    -- A sample that names its instance but not its group: the group the instance served in.
    LEFT JOIN (SELECT instance, min(replica) AS served FROM alloc_units GROUP BY instance) u
        ON s.replica = '' AND s.instance = u.instance
    JOIN {groups} g ON g.replica = coalesce(nullif(s.replica, ''), u.served)
    GROUP BY g.model
), work AS (
    SELECT k.model, sum((h.prompt_tokens - h.cached_prompt_tokens) * {wp!r}
            + h.cached_prompt_tokens * {wc!r} + h.completion_tokens * {wo!r}) AS weighted
    FROM alloc_hours h JOIN alloc_keys k USING ("key")
    WHERE h.hour >= $3 AND h.hour < $4
    GROUP BY k.model
)
SELECT model, c.usd, c.priced, w.weighted FROM cost c JOIN work w USING (model) ORDER BY model"""


def _params(window: Window) -> list[int]:
    lo = int(window.start) // SLOT_SECONDS
    hi = -(-int(window.end) // SLOT_SECONDS)
    per_hour = HOUR_SECONDS // SLOT_SECONDS
    return [lo, hi, lo // per_hour, -(-hi // per_hour)]


def read_rates(ledger: Ledger, policy: Policy, window: Window) -> dict[str, float]:
    """USD per weighted token of each model with a known, positive cost and work in ``window``."""
    with ledger.reader() as cur:
        rows = cur.execute(rates_sql(policy), _params(window)).fetchall()
    return {
        str(model): float(usd) / float(weighted)
        for model, usd, priced, weighted in rows
        if priced and usd is not None and weighted and usd > 0 and weighted > 0
    }


def rates(ledger: Ledger, policy: Policy, models: list[str], now: float) -> dict[str, Any]:
    """The body of ``GET /v1/rates`` at ``now``: the weights, and per model its rate or null.

    Each model's rate is of the last complete hour, else of the month so far (``basis``).
    """
    hour_start = (int(now) // HOUR_SECONDS - 1) * HOUR_SECONDS
    hour = Window("hour", hour_start, hour_start + HOUR_SECONDS)
    month = Window("month", month_bounds(month_of(now))[0], now)
    by_hour = read_rates(ledger, policy, hour)
    missing = [m for m in models if m not in by_hour]
    by_month = read_rates(ledger, policy, month) if missing else {}
    out: dict[str, Any] = {}
    for model in sorted({*models, *by_hour}):
        window = hour if model in by_hour else month if model in by_month else None
        rate = by_hour.get(model, by_month.get(model))
        out[model] = {
            "usd_per_weighted_token": rate,
            "basis": None if window is None else window.basis,
            "from": None if window is None else window.start,
            "until": None if window is None else window.end,
        }
    return {"as_of": now, "weights": weights(policy), "models": out}


def weights(policy: Policy) -> dict[str, float]:
    """The ``tokens`` split's weights, as a sidecar weighs an answer's tokens by them."""
    wp = float(policy.prompt_weight)
    wc = wp if policy.cached_prompt_weight is None else float(policy.cached_prompt_weight)
    return {"prompt": wp, "cached_prompt": wc, "completion": float(policy.completion_weight)}


class RateCache:
    """The last ``rates`` answer, served for ``ttl_seconds`` (and while the policy is the same).

    Asks that arrive while it is computed wait for that computation rather than start another.
    """

    def __init__(
        self, ttl_seconds: float = TTL_SECONDS, clock: Callable[[], float] = time.time
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._kept: tuple[float, Policy, dict[str, Any]] | None = None

    def get(self, ledger: Ledger, policy: Policy, models: list[str]) -> dict[str, Any]:
        """The rates, read again once the kept answer is ``ttl_seconds`` old (a blocking call)."""
        with self._lock:
            now = self.clock()
            kept = self._kept
            if kept is not None and kept[1] is policy and now - kept[0] < self.ttl_seconds:
                return kept[2]
            body = rates(ledger, policy, models, now)
            self._kept = (now, policy, body)
            return body
