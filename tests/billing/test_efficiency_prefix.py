"""Prefix-caching advice: shared prompt heads that the engines' prefix cache does not serve."""

from __future__ import annotations

from typing import Any

import pytest

from billing.ledger import Ledger
from tests.billing.test_efficiency import engine, fill, gpus, kinds, report, requests


def _shared(
    n: int, digest: str | None = "head-1", share: float | None = 0.5
) -> list[dict[str, Any]]:
    """``n`` requests of 1,000 prompt and 50 output tokens, their heads digested alike."""
    return [r | {"prefix_digest": digest, "prefix_share": share}
            for r in requests(n, prompt=1000, completion=50)]  # fmt: skip


def _ledger(ledger: Ledger, usage: list[dict[str, Any]], **counters: Any) -> None:
    fill(ledger, usage=usage, gpu_samples=gpus("small-0"),
         engine_samples=engine("small-0", 10, **counters))  # fmt: skip


def test_prefix_cache_fires_when_shared_heads_are_computed_every_time(ledger, config):
    """100 requests share a 500-token head and the cache served none: 99 x 500 tokens at the measured input rate."""
    _ledger(ledger, _shared(100))
    [rec] = kinds(report(ledger, config), "prefix_cache")
    assert rec.title == "chat-small: turn on prefix caching"
    assert rec.evidence["reusable_prompt_tokens"] == pytest.approx(99 * 500)
    # $1.60 over 100,000 input + 3 x 5,000 output weighted tokens; an input token weighs 1.
    assert rec.saving_usd_per_month == pytest.approx(99 * 500 * 1.60 / 115_000 * 730)


def test_prefix_cache_does_not_fire_when_the_cache_serves_the_heads(ledger, config):
    """Engines that found over half the reusable tokens in their cache already cache the heads."""
    _ledger(ledger, _shared(100), prefix_cache_queries_total=lambda i: 2000.0 * i,
            prefix_cache_hits_total=lambda i: 1000.0 * i)  # fmt: skip
    assert kinds(report(ledger, config), "prefix_cache") == []


def test_a_low_hit_rate_is_named_as_a_cache_that_misses(ledger, config):
    """A cache that is consulted but serves little gets the advice to make it hold the heads."""
    _ledger(ledger, _shared(100), prefix_cache_queries_total=lambda i: 2000.0 * i,
            prefix_cache_hits_total=lambda i: 10.0 * i)  # fmt: skip
    [rec] = kinds(report(ledger, config), "prefix_cache")
    assert rec.title == "chat-small: make the prefix cache hold its shared prompts"
    assert rec.evidence["prefix_cache_hit_rate"] == pytest.approx(0.005)
    assert rec.saving_usd_per_month == pytest.approx((99 * 500 - 590) * 1.60 / 115_000 * 730)


def test_prefix_cache_does_not_fire_when_few_requests_share_a_head(ledger, config):
    """Ten shared requests among a hundred of distinct heads are under the 20% the advice needs."""
    distinct = [r | {"prefix_digest": f"own-{i}"} for i, r in enumerate(_shared(90))]
    _ledger(ledger, _shared(10) + distinct)
    assert kinds(report(ledger, config), "prefix_cache") == []


def test_records_without_digests_give_no_prefix_advice(ledger, config):
    """A fleet whose sidecars have no prefix key says nothing about prefix caching."""
    _ledger(ledger, _shared(100, digest=None, share=None))
    assert kinds(report(ledger, config), "prefix_cache") == []
