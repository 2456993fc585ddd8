"""Cost at the point of use: each response's cost estimate, from a rate read beforehand.

Billing answers ``GET /v1/rates`` with each model's measured USD per weighted token and the
weights (``billing.rates``). A ``RatePoller`` reads it the way the budget gate reads the spend
(``sidecar.budgets``): with the gate's client, every ``sidecar.budgets.refresh_seconds``, into a
frozen snapshot replaced whole, keeping the last one when billing cannot be read. A response
then costs one dictionary lookup and, at its end, a few multiplications: no request waits on
billing.

The estimate goes where the answer's usage is: a non-streamed answer gets the header
``X-Infermeter-Cost-Estimate-USD`` and ``"cost": {"usd": ..., "estimate": true}`` in its usage
object; a stream's final usage chunk (sent when the client asked for usage) gets the same
``cost``. A stream's headers leave before any token exists, so it carries no header. With no
rate for the model, neither is added (an unknown cost is never 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Gauge

from infermeter.config import BudgetSettings
from sidecar.stream import UsageCounts, object_end, parse_usage

if TYPE_CHECKING:
    import httpx

__all__ = ["COST_HEADER", "Rate", "RatePoller", "parse_rates", "usd_text", "with_cost"]

log = logging.getLogger("infermeter.sidecar")

COST_HEADER: Final = b"x-infermeter-cost-estimate-usd"
_USAGE_KEY = b'"usage":{'
_FINAL_USAGE = b'"choices":[],"usage":{'
# Twelve decimals: a millionth of a cent is still shown, in plain decimal notation (no exponent).
_DECIMALS = 12


@dataclass(frozen=True, slots=True)
class Rate:
    """A model's USD per weighted token and the weights of its tokens, as billing gave them."""

    usd_per_weighted_token: float
    prompt: float
    cached_prompt: float
    completion: float

    def usd(self, usage: UsageCounts) -> float:
        """What ``usage`` costs at this rate: its tokens weighted as billing weighs them."""
        cached = min(max(usage.cached, 0), usage.prompt)
        weighted = (
            (usage.prompt - cached) * self.prompt
            + cached * self.cached_prompt
            + usage.completion * self.completion
        )
        return weighted * self.usd_per_weighted_token

    def text(self, usage: UsageCounts | None) -> bytes | None:
        """The estimate for ``usage`` as a decimal string, None without usage or when it is 0."""
        return None if usage is None else usd_text(self.usd(usage))

    def final_chunk(self, block: bytes) -> bytes:
        """``block`` with the estimate in its final usage chunk's usage (the counts it holds)."""
        at = block.find(_FINAL_USAGE)
        if at < 0:
            return block
        brace = at + len(_FINAL_USAGE) - 1
        stop = object_end(block, brace)
        text = self.text(parse_usage(block[brace:stop])) if stop > 0 else None
        return block if text is None else _insert(block, brace, stop, text)


def usd_text(usd: float) -> bytes | None:
    """``usd`` as a plain decimal string (``b"0.000123"``); None when it shows as 0."""
    text = f"{usd:.{_DECIMALS}f}".rstrip("0")
    if usd <= 0 or text == "0.":
        return None
    return (text + "0" if text.endswith(".") else text).encode()


def with_cost(body: bytes, text: bytes) -> bytes:
    """A whole answer's ``body`` with ``"cost"`` in its usage object (as it was without one)."""
    at = body.rfind(_USAGE_KEY)
    if at < 0:
        return body
    brace = at + len(_USAGE_KEY) - 1
    stop = object_end(body, brace)
    return body if stop < 0 else _insert(body, brace, stop, text)


def _insert(data: bytes, brace: int, stop: int, text: bytes) -> bytes:
    """``"cost"`` added last to the object ``data[brace:stop]``."""
    comma = b"" if stop - brace == 2 else b","
    cost = comma + b'"cost":{"usd":' + text + b',"estimate":true}'
    return data[: stop - 1] + cost + data[stop - 1 :]


def parse_rates(body: Any) -> dict[str, Rate]:
    """The known rates of a ``GET /v1/rates`` answer; ValueError when it is not one.

    A model whose rate is null (billing does not know it yet) has none.
    """
    if not isinstance(body, dict):
        raise ValueError("rates answer is not an object")
    weights, models = body.get("weights"), body.get("models")
    if not isinstance(weights, dict) or not isinstance(models, dict):
        raise ValueError("rates answer without weights and models")
    try:
        w = [float(weights[k]) for k in ("prompt", "cached_prompt", "completion")]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"rates answer with weights of another shape: {weights!r}") from None
    out: dict[str, Rate] = {}
    for model, row in models.items():
        rate = row.get("usd_per_weighted_token") if isinstance(row, dict) else None
        if isinstance(rate, int | float) and not isinstance(rate, bool) and rate > 0:
            out[str(model)] = Rate(float(rate), *w)
    return out


class RatePoller:
    """Billing's rates, read in the background; ``current`` is looked up per response."""

    def __init__(
        self,
        settings: BudgetSettings,
        token: str | None,
        client: Callable[[], httpx.AsyncClient | None],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.token = token
        # The budget gate's client (``BudgetGate.client``): one connection pool to billing.
        self.client = client
        self.current: Mapping[str, Rate] = MappingProxyType({})
        self.read_at: float | None = None
        if registry is not None:
            age = Gauge(
                "infermeter_cost_rates_age_seconds",
                "Seconds since billing's cost rates were last read (-1: never).",
                registry=registry,
            )
            age.set_function(
                lambda: -1.0 if self.read_at is None else time.monotonic() - self.read_at
            )

    def rate(self, model: str) -> Rate | None:
        """The latest rate of ``model``, None when billing has given none."""
        return self.current.get(model)

    async def refresh(self) -> None:
        """Read billing's rates; keep the last ones on failure."""
        client = self.client()
        if self.settings.spend_url is None or client is None:
            return
        import httpx  # loaded with the client

        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = await client.get(self.settings.spend_url.rstrip("/") + "/v1/rates", headers=headers)
            r.raise_for_status()
            rates = parse_rates(r.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("cost rates unreadable, keeping the last ones: %s", exc)
            return
        self.current, self.read_at = MappingProxyType(rates), time.monotonic()

    async def run(self) -> None:
        """Refresh until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.settings.refresh_seconds)
