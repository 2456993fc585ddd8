"""Prefix-caching advice: requests that share a prompt head the engines compute again each time.

The sidecar digests each prompt's head (``sidecar.prefix``: a keyed hash, never the text), so
billing can count the requests of a model that begin alike: a shared system prompt. Each request
after the first on each engine could read that head from vLLM's prefix cache instead of
computing it: the reusable tokens are, per shared head, its tokens in every request less one
request's worth per engine. The engines' own counters say how many prompt tokens the cache did
serve (hits). When hits fall short of ``Policy.working_cache_share`` of the reusable tokens (or
the cache was never consulted: prefix caching is off), the tokens still computed are priced at
the model's measured cost per input token.
"""

from __future__ import annotations

from dataclasses import dataclass

from billing.efficiency.advice import ModelFigures, Policy, Recommendation

__all__ = ["PrefixFigures", "prefix_cache"]


@dataclass(frozen=True, slots=True)
class PrefixFigures:
    """One model's prompt heads and prefix-cache counters (a row of ``prefix_sql``)."""

    model: str
    requests: int
    prompt_tokens: int
    shared_requests: int
    shared_prefixes: int
    shared_head_tokens: float
    mean_head_tokens_sum: float
    largest_share: int
    cache_queries: float
    cache_hits: float

    def reusable_tokens(self, engines: int) -> float:
        """Head tokens a working cache serves: all but one request's worth per head and engine."""
        return max(0.0, self.shared_head_tokens - max(1, engines) * self.mean_head_tokens_sum)


def prefix_cache(m: ModelFigures, p: PrefixFigures, weights: tuple[float, float],
                 policy: Policy) -> Recommendation | None:  # fmt: skip
    """Turn on (or make work) prefix caching for a model whose requests share prompt heads."""
    if p.requests == 0 or p.shared_requests / p.requests < policy.min_shared_share:
        return None
    reusable = p.reusable_tokens(m.units)
    if reusable <= 0 or p.cache_hits >= policy.working_cache_share * reusable:
        return None
    rate = m.usd_per_weighted_token(*weights)
    if rate is None:
        return None
    usd_per_input_token = rate * weights[0]
    missed = reusable - p.cache_hits
    saving = m.per_month(missed * usd_per_input_token)
    if saving < policy.min_saving_usd_per_month:
        return None
    off = p.cache_queries == 0 or p.cache_hits == 0
    hit_rate = p.cache_hits / p.cache_queries if p.cache_queries else None
    title = f"{m.model}: turn on prefix caching"
    if not off:
        title = f"{m.model}: make the prefix cache hold its shared prompts"
    return Recommendation(
        kind="prefix_cache",
        model=m.model,
        team=None,
        title=title,
        saving_usd_per_month=saving,
        evidence={
            "requests": p.requests,
            "shared_requests": p.shared_requests,
            "shared_share": p.shared_requests / p.requests,
            "shared_prefixes": p.shared_prefixes,
            "largest_share": p.largest_share,
            "reusable_prompt_tokens": reusable,
            "prefix_cache_hits": p.cache_hits,
            "prefix_cache_hit_rate": hit_rate,
            "usd_per_1m_input_tokens": usd_per_input_token * 1e6,
            "hours_measured": m.hours,
        },
        assumptions=(
            f"a prompt head is shared when {policy.min_shared_requests} or more requests begin "
            "with it (the sidecar's keyed digest of the first message)",
            "a head's tokens are its share of the prompt's characters times vLLM's prompt tokens",
            f"each of the {m.units} engines computes each shared head once, then reads it from "
            "the cache",
            "a token read from the cache saves what an input token costs, measured: "
            "prefill is the part of the GPU time that input tokens take",
            f"the {m.hours} hours measured are representative of a month",
        ),
        caveat=(
            "start vLLM with --enable-prefix-caching (the default in vLLM's V1 engine); when it "
            "is on already, route requests with one system prompt to the same engines and give "
            "the cache room (gpu_memory_utilization)."
        ),
        action={"enable_prefix_caching": True},
    )
