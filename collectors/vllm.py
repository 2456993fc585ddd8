"""A vLLM engine's /metrics as an engine source.

Read: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(a ratio despite its name), ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
and the KV cache's size from the info gauge ``vllm:cache_config_info`` (its labels
``num_gpu_blocks`` x ``block_size``: the engine's real capacity, which the efficiency advisor
sizes batches against). A replica with several engines (data parallel) reports one series per
``engine`` label: counts, counters and capacities are summed, KV-cache usage is averaged.
"""

from __future__ import annotations

import math
from typing import Final

import httpx

from collectors.dcgm import fetch_text
from collectors.exposition import ExpositionError, Sample, parse_samples
from collectors.sources import EngineReading, ScrapeError
from infermeter.records import MAX_ENGINE_COUNTER, MAX_ENGINE_REQUESTS

__all__ = ["VLLM_FIELDS", "VllmSource", "engine_reading", "kv_cache_tokens"]

VLLM_FIELDS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
)


def engine_reading(text: str) -> EngineReading:
    """The engine state in one vLLM /metrics page; ExpositionError if it is not one."""
    s = parse_samples(text, VLLM_FIELDS)
    if not s["vllm:num_requests_running"]:
        raise ExpositionError("no vllm:num_requests_running in the page")
    _refuse_impossible(s)
    _refuse_repeated(s)
    kv = [v for _, v in s["vllm:kv_cache_usage_perc"]]
    return EngineReading(
        requests_running=_sum(s["vllm:num_requests_running"]),
        requests_waiting=_sum(s["vllm:num_requests_waiting"]),
        kv_cache_usage=sum(kv) / len(kv) if kv else 0.0,
        prompt_tokens_total=_sum(s["vllm:prompt_tokens_total"]),
        generation_tokens_total=_sum(s["vllm:generation_tokens_total"]),
        prefix_cache_queries_total=_sum(s["vllm:prefix_cache_queries_total"]),
        prefix_cache_hits_total=_sum(s["vllm:prefix_cache_hits_total"]),
        preemptions_total=_sum(s["vllm:num_preemptions_total"]),
        kv_cache_tokens=kv_cache_tokens(s["vllm:cache_config_info"]),
    )


def kv_cache_tokens(info: list[Sample]) -> float | None:
    """The KV cache's tokens from ``vllm:cache_config_info`` series, summed over engines.

    None when no series says both its GPU blocks and its block size as positive whole numbers
    (vLLM writes "None" for what it has not resolved): an unknown capacity is not a zero one.
    """
    total, known = 0.0, False
    for labels, _ in info:
        blocks = _whole_number(labels.get("num_gpu_blocks", ""))
        size = _whole_number(labels.get("block_size", ""))
        if blocks and size:
            total += blocks * size
            known = True
    return total if known else None


# Far above any real KV cache (10**18 blocks), and short enough that int() never refuses it:
# Python will not convert a string of more than 4,300 digits.
_MAX_DIGITS = 18


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number, or None unless it is 1 to 18 ASCII digits.

    ``str.isdigit`` alone is not enough: it is true for "²" and other Unicode digits that
    ``int`` refuses, and a label is whatever the page says.
    """
    if not (0 < len(text) <= _MAX_DIGITS and text.isascii() and text.isdigit()):
        return None
    return int(text)


# Billing's bounds (``billing.bounds``): a reading past them would be refused at ingest, its
# token counters with it, so the page is refused here, its engine marked down with the reason.
_MOST: Final = {
    "vllm:num_requests_running": float(MAX_ENGINE_REQUESTS),
    "vllm:num_requests_waiting": float(MAX_ENGINE_REQUESTS),
    "vllm:kv_cache_usage_perc": 1.0,
}


def _refuse_impossible(s: dict[str, list[Sample]]) -> None:
    """ExpositionError when a count, counter or ratio read is NaN, infinite, negative or > 2**53.

    The whole page is refused, and the engine marked down with the series named, rather than
    the one value dropped: an engine reading has no "unknown" to put in its place, and a zero
    would be a lie someone acts on (a queue of 0 hides load from the autoscaler, a counter of 0
    reads as an engine restart). NaN also reached the spool as JSON null. The info gauge's value
    means nothing (its labels are read) and is not checked.
    """
    for name, found in s.items():
        if name == "vllm:cache_config_info":
            continue
        most = _MOST.get(name, MAX_ENGINE_COUNTER)
        for _, value in found:
            if not (math.isfinite(value) and 0.0 <= value <= most):
                raise ExpositionError(f"{name} is {value!r}: a count cannot be (0 to {most:g})")


def _refuse_repeated(s: dict[str, list[Sample]]) -> None:
    """ExpositionError when a series (a name and its labels) is given twice: summed, two lines
    of 100 read as 200 (a stale series beside the live one), and which is true cannot be told."""
    for name, found in s.items():
        seen: set[tuple[tuple[str, str], ...]] = set()
        for labels, _ in found:
            key = tuple(sorted(labels.items()))
            if key in seen:
                raise ExpositionError(f"{name}{dict(key)} is given twice")
            seen.add(key)


def _sum(samples: list[Sample]) -> float:
    return sum(v for _, v in samples)


class VllmSource:
    """One engine's vLLM metrics page: ``<upstream_url>/metrics`` or its sidecar's relay.

    ``token``, when given, is sent as a bearer token: the sidecar's ``/engine/metrics`` needs
    the metrics or admin token. ``instance`` names the engine when it is one instance of the
    replica group ``replica``; without it the engine is the fixed replica itself.
    """

    kind = "vllm"

    def __init__(
        self,
        replica: str,
        url: str,
        client: httpx.AsyncClient,
        timeout_seconds: float,
        token: str | None = None,
        instance: str | None = None,
        node: str | None = None,
    ) -> None:
        self.replica = replica
        self.instance = instance
        self.node = node
        self.target = instance or replica
        self.url = url
        self.client = client
        self.timeout_seconds = timeout_seconds
        self.headers = {"authorization": f"Bearer {token}"} if token else None

    async def read(self) -> EngineReading:
        """Scrape and parse the replica's metrics now."""
        text = await fetch_text(self.client, self.url, self.timeout_seconds, self.headers)
        try:
            return engine_reading(text)
        except ExpositionError as exc:
            raise ScrapeError(f"{self.url}: not a vLLM metrics page: {exc}") from None
