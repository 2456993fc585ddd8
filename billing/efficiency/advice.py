"""Recommendations: pure functions over measured figures, each priced in USD per month.

Every recommendation carries the figures it rests on (``evidence``), what it takes for granted
(``assumptions``) and a saving computed from those figures: the measured cost of the period,
scaled from the hours measured to a month (``HOURS_PER_MONTH``). No saving is a constant, and
none is offered below ``Policy.min_saving_usd_per_month``, so a fleet with nothing worth
changing gets an empty list.

- **right_size**: a model served by more replicas than its busiest minute needs. Needed =
  ``ceil(peak running x (1 + headroom) / max_num_seqs)``, at least ``min_replicas``; never
  when requests queued at the peak or the TTFT target was already missed. Saving: the removed
  replicas' share of the measured GPU-hour cost. Energy follows the tokens, which stay, so it
  is not counted as saved.
- **quantize**: the planner (``infermeter.planner``) sizes the served model at 8 and 4 bits on
  the GPU it runs on, with the KV cache of the measured peak; a precision that needs fewer GPUs
  per replica saves those GPUs' measured GPU-hour cost.
- **gpu_type**: a model the fleet serves on two GPU types, cheaper per token on one of them
  (which holds the TTFT target and fits the model by the planner): the other type's tokens
  priced at the difference of the two measured costs per weighted token.
- **route**: a team's short requests (prompt and output under thresholds) to a model that a
  cheaper, smaller model in the fleet could serve; priced at both models' measured cost per
  weighted token.

``schedule`` (scaling by the hour of the day), ``off_peak`` (a batch team's work moved out of the
peak hours) and ``prefix_cache`` (requests that share a prompt prefix the engine does not reuse)
live in their own modules and return the same ``Recommendation``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from billing.efficiency.figures import HOURS_PER_MONTH
from infermeter.planner import BYTES_PER_PARAM, GPUS_GB, PRESETS, ModelShape, plan

__all__ = [
    "KINDS",
    "ModelFigures",
    "Policy",
    "Recommendation",
    "ShortRequests",
    "advise",
    "gpu_type",
    "quantize",
    "ranked",
    "right_size",
    "route",
    "shape_of",
]

KINDS: Final = (
    "right_size",
    "quantize",
    "gpu_type",
    "route",
    "schedule",
    "off_peak",
    "prefix_cache",
)

QUALITY_CAVEAT: Final[Mapping[str, str]] = {
    "fp8": "8-bit weights (FP8) usually stay close to the 16-bit model's quality, but check it "
    "on your own prompts before switching.",
    "int4": "4-bit weights (AWQ/GPTQ) can lose quality, most on long reasoning and code; "
    "evaluate on your own traffic before switching.",
}


@dataclass(frozen=True, slots=True)
class Policy:
    """The advisor's knobs: headroom over the peak, the short-request thresholds, the floor."""

    headroom: float = 0.25
    min_replicas: int = 1
    sla_share: float = 0.95  # share of requests within the TTFT target the SLA asks for
    short_prompt_tokens: int = 512
    short_completion_tokens: int = 256
    min_short_share: float = 0.2
    min_saving_usd_per_month: float = 1.0
    startup_seconds: float = 180.0  # an engine asked for serves this much later (scaling's)
    min_shared_requests: int = 10  # requests with one prompt head for it to count as shared
    min_shared_share: float = 0.2  # share of a model's requests with a shared head
    working_cache_share: float = 0.5  # hits over this share of what is reusable: cache works
    min_batch_share: float = 0.8  # unstreamed share of a team's requests that makes it batch work


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's measured period (a row of ``model_summary_sql``) and how it is served."""

    model: str
    served_version: str
    gpu_model: str
    replicas: int
    gpus_per_engine: float  # GPUs one engine holds: its GPU-seconds per measured second
    hours: int
    gpu_hours: float
    gpu_usd: float
    cost_usd: float
    requests: int
    prompt_tokens: int
    completion_tokens: int
    ttft_within_sla_share: float | None
    max_num_seqs: int | None
    peak_running: float | None
    peak_waiting: float | None
    max_model_len: int = 8192
    engines: int | None = None  # most engine instances seen in one minute

    @property
    def units(self) -> int:
        """Engines that serve the model: its replicas, or more when a group runs several."""
        return max(self.replicas, self.engines or 0)

    def per_month(self, usd: float) -> float:
        """``usd`` measured over the period, as USD per month."""
        return usd * HOURS_PER_MONTH / self.hours if self.hours else 0.0

    def usd_per_weighted_token(
        self, prompt_weight: float, completion_weight: float
    ) -> float | None:
        """Measured cost per weighted token (prompt and output at the token weights)."""
        weighted = prompt_weight * self.prompt_tokens + completion_weight * self.completion_tokens
        return self.cost_usd / weighted if weighted > 0 else None


@dataclass(frozen=True, slots=True)
class ShortRequests:
    """A team's requests to a model, and the short ones (a row of ``short_requests_sql``)."""

    model: str
    team: str
    requests: int
    short_requests: int
    short_prompt_tokens: int
    short_completion_tokens: int


@dataclass(frozen=True, slots=True)
class Recommendation:
    """One change, what it saves per month, the measured figures behind it, and its caveats."""

    kind: str
    model: str
    team: str | None
    title: str
    saving_usd_per_month: float
    evidence: Mapping[str, Any]
    assumptions: tuple[str, ...]
    caveat: str | None = None
    action: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The recommendation as JSON-ready values."""
        return {
            "kind": self.kind,
            "model": self.model,
            "team": self.team,
            "title": self.title,
            "saving_usd_per_month": round(self.saving_usd_per_month, 2),
            "evidence": dict(self.evidence),
            "assumptions": list(self.assumptions),
            "caveat": self.caveat,
            "action": dict(self.action),
        }


_SIZE = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)b(?![a-z])")
_PRECISIONS: Final = (("int4", ("int4", "awq", "gptq", "w4a16")), ("fp8", ("fp8", "w8a8")),
                      ("int8", ("int8",)))  # fmt: skip


def shape_of(served_version: str, context_tokens: int, concurrency: int) -> ModelShape | None:
    """The planner's shape for a served version named like ``llama-3.1-70b-instruct-fp8``.

    The size (``70b``) picks a planner preset; the precision is read from the name (``fp8``,
    ``int8``, ``int4``/``awq``/``gptq``), else bf16. None when no preset has that size.
    """
    name = served_version.lower()
    found = _SIZE.search(name)
    if found is None:
        return None
    size = float(found.group(1))
    preset = next((p for p in PRESETS.values() if p.params_billions == size), None)
    if preset is None:
        return None
    precision = next((p for p, tags in _PRECISIONS if any(t in name for t in tags)), "bf16")
    return ModelShape(preset.params_billions, precision, max(1, context_tokens),
                      max(1, concurrency), preset.layers, preset.kv_heads, preset.head_dim)  # fmt: skip


_AUTOSCALED: Final = "the autoscaler sets the instance count: lower the group's replica limits."


def right_size(m: ModelFigures, policy: Policy) -> Recommendation | None:
    """Fewer engines for a model whose busiest minute, with headroom, needs fewer."""
    units = m.units
    if m.max_num_seqs is None or m.peak_running is None or units <= policy.min_replicas:
        return None
    if (m.peak_waiting or 0) > 0:
        return None  # requests queued at some minute: every engine was needed then
    if m.ttft_within_sla_share is not None and m.ttft_within_sla_share < policy.sla_share:
        return None
    needed = max(
        policy.min_replicas,
        math.ceil(m.peak_running * (1 + policy.headroom) / m.max_num_seqs - 1e-9),
    )
    if needed >= units:
        return None
    saving = m.per_month(m.gpu_usd * (units - needed) / units)
    if saving < policy.min_saving_usd_per_month:
        return None
    noun = "replica" if units == m.replicas else "instance"
    return Recommendation(
        kind="right_size",
        model=m.model,
        team=None,
        title=f"{m.model}: run {needed} {noun}{'s' * (needed != 1)} instead of {units}",
        saving_usd_per_month=saving,
        evidence={
            f"{noun}s": units,
            "gpu_model": m.gpu_model,
            "peak_running": m.peak_running,
            "peak_waiting": m.peak_waiting or 0,
            "max_num_seqs": m.max_num_seqs,
            "ttft_within_sla_share": m.ttft_within_sla_share,
            "gpu_usd_measured": m.gpu_usd,
            "hours_measured": m.hours,
        },
        assumptions=(
            f"the busiest minute measured, plus {policy.headroom:.0%} headroom, is the peak to hold",
            f"load spreads evenly over the {noun}s that remain",
            "energy follows the tokens, which stay: only GPU-hours are saved",
            f"the {m.hours} hours measured are representative of a month",
        ),
        caveat=None if noun == "replica" else _AUTOSCALED,
        action={f"{noun}s": needed},
    )


def quantize(m: ModelFigures, usd_per_gpu_hour: Mapping[str, float],
             policy: Policy) -> Recommendation | None:  # fmt: skip
    """A lower precision that the planner fits on fewer GPUs per replica than the model uses."""
    context = _mean_context(m)
    shape = shape_of(m.served_version, context, math.ceil(m.peak_running or 1))
    gpus_now = round(m.gpus_per_engine)
    if shape is None or m.gpu_model not in GPUS_GB or gpus_now < 2:
        return None
    best: tuple[str, int] | None = None
    for precision in ("fp8", "int4"):
        if BYTES_PER_PARAM[precision] >= BYTES_PER_PARAM[shape.precision]:
            continue
        smaller = ModelShape(shape.params_billions, precision, shape.context_tokens,
                             shape.concurrency, shape.layers, shape.kv_heads, shape.head_dim)  # fmt: skip
        fit = plan(smaller, usd_per_gpu_hour, {m.gpu_model: GPUS_GB[m.gpu_model]}).fits[0]
        if fit.tensor_parallel is not None and fit.tensor_parallel < gpus_now:
            best = (precision, fit.tensor_parallel)
            break  # the highest precision that saves: the smallest quality risk
    if best is None:
        return None
    precision, tp = best
    saving = m.per_month(m.gpu_usd * (gpus_now - tp) / gpus_now)  # every engine sheds as many
    if saving < policy.min_saving_usd_per_month:
        return None
    return Recommendation(
        kind="quantize",
        model=m.model,
        team=None,
        title=f"{m.model}: serve {precision} on {tp} {m.gpu_model} per replica instead of {gpus_now}",
        saving_usd_per_month=saving,
        evidence={
            "served_version": m.served_version,
            "precision_now": shape.precision,
            "gpus_per_replica": gpus_now,
            "gpus_per_replica_after": tp,
            "replicas": m.units,
            "peak_running": m.peak_running,
            "mean_tokens_per_request": context,
            "gpu_usd_measured": m.gpu_usd,
            "hours_measured": m.hours,
        },
        assumptions=(
            f"the KV cache holds the measured peak of {shape.concurrency} sequences of "
            f"{context} tokens (the mean request)",
            "the capacity planner's memory model (weights, 16-bit KV cache, 10% overhead)",
            "throughput per replica holds on fewer GPUs (lower precision speeds decoding)",
            f"the {m.hours} hours measured are representative of a month",
        ),
        caveat=QUALITY_CAVEAT[precision],
        action={"precision": precision, "tensor_parallel": tp},
    )


def _mean_context(m: ModelFigures) -> int:
    if not m.requests:
        return m.max_model_len
    return max(1, round((m.prompt_tokens + m.completion_tokens) / m.requests))


def _params(m: ModelFigures) -> float | None:
    shape = shape_of(m.served_version, 1, 1)
    return shape.params_billions if shape else None


def route(shorts: Sequence[ShortRequests], models: Mapping[str, ModelFigures],
          weights: tuple[float, float], policy: Policy) -> list[Recommendation]:  # fmt: skip
    """Short requests of a team that the cheapest smaller model in the fleet could serve."""
    wp, wc = weights
    found = []
    for s in shorts:
        big = models.get(s.model)
        if big is None or s.requests == 0 or s.short_requests / s.requests < policy.min_short_share:
            continue
        target = _cheaper_smaller(big, models.values(), weights)
        if target is None:
            continue
        small, small_rate, big_rate = target
        weighted = wp * s.short_prompt_tokens + wc * s.short_completion_tokens
        saving = big.per_month(weighted * (big_rate - small_rate))
        if saving < policy.min_saving_usd_per_month:
            continue
        share = s.short_requests / s.requests
        found.append(Recommendation(
            kind="route", model=s.model, team=s.team,
            title=f"{s.team}: send short requests for {s.model} to {small.model}",
            saving_usd_per_month=saving,
            evidence={
                "requests": s.requests, "short_requests": s.short_requests, "short_share": share,
                "short_prompt_tokens": s.short_prompt_tokens,
                "short_completion_tokens": s.short_completion_tokens,
                "usd_per_1m_weighted_tokens_now": big_rate * 1e6,
                "usd_per_1m_weighted_tokens_after": small_rate * 1e6,
                "hours_measured": big.hours,
            },
            assumptions=(
                f"short: at most {policy.short_prompt_tokens} prompt and "
                f"{policy.short_completion_tokens} output tokens",
                f"{small.model} serves them at its measured cost per token (it has the capacity, "
                "or grows in proportion)",
                f"tokens weighted prompt {wp:g} : output {wc:g}, as the tokens allocation weighs them",
                f"the {big.hours} hours measured are representative of a month",
            ),
            caveat=f"check that {small.model} answers this team's short requests well enough.",
            action={"route_to": small.model, "max_prompt_tokens": policy.short_prompt_tokens,
                    "max_completion_tokens": policy.short_completion_tokens},
        ))  # fmt: skip
    return found


def _cheaper_smaller(big: ModelFigures, models: Iterable[ModelFigures],
                     weights: tuple[float, float]) -> tuple[ModelFigures, float, float] | None:  # fmt: skip
    big_rate = big.usd_per_weighted_token(*weights)
    big_params = _params(big)
    if big_rate is None or big_params is None:
        return None
    best: tuple[ModelFigures, float, float] | None = None
    for other in models:
        rate = other.usd_per_weighted_token(*weights)
        params = _params(other)
        if other.model == big.model or rate is None or params is None or params >= big_params:
            continue
        if rate < big_rate and (best is None or rate < best[1]):
            best = (other, rate, big_rate)
    return best


def gpu_type(per_gpu: Sequence[ModelFigures], weights: tuple[float, float],
             policy: Policy) -> list[Recommendation]:  # fmt: skip
    """Move a model's replicas to the GPU type it was measured cheaper per token on."""
    wp, wc = weights
    found = []
    for now in per_gpu:
        rate_now = now.usd_per_weighted_token(wp, wc)
        best = _cheapest_type(now, per_gpu, weights, policy)
        if rate_now is None or best is None:
            continue
        other, rate = best
        weighted = wp * now.prompt_tokens + wc * now.completion_tokens
        saving = now.per_month(weighted * (rate_now - rate))
        if saving < policy.min_saving_usd_per_month:
            continue
        found.append(Recommendation(
            kind="gpu_type", model=now.model, team=None,
            title=f"{now.model}: serve on {other.gpu_model} instead of {now.gpu_model}",
            saving_usd_per_month=saving,
            evidence={
                "gpu_model_now": now.gpu_model, "gpu_model_after": other.gpu_model,
                "replicas_now": now.replicas,
                "usd_per_1m_weighted_tokens_now": rate_now * 1e6,
                "usd_per_1m_weighted_tokens_after": rate * 1e6,
                "ttft_within_sla_share_after": other.ttft_within_sla_share,
                "weighted_tokens_now": weighted, "hours_measured": now.hours,
            },
            assumptions=(
                f"{other.gpu_model} keeps its measured cost per token with this load added "
                "(its replicas are as busy as they were measured)",
                f"the capacity planner fits the model on {other.gpu_model}",
                f"the {now.hours} hours measured are representative of a month",
            ),
            caveat=f"{other.gpu_model} must be available: check the cloud's or the cluster's capacity.",
            action={"gpu_model": other.gpu_model},
        ))  # fmt: skip
    return found


def _cheapest_type(now: ModelFigures, per_gpu: Sequence[ModelFigures], weights: tuple[float, float],
                   policy: Policy) -> tuple[ModelFigures, float] | None:  # fmt: skip
    rate_now = now.usd_per_weighted_token(*weights)
    best: tuple[ModelFigures, float] | None = None
    for other in per_gpu:
        rate = other.usd_per_weighted_token(*weights)
        if other.model != now.model or other.gpu_model == now.gpu_model or rate is None:
            continue
        share = other.ttft_within_sla_share
        if share is None or share < policy.sla_share or rate_now is None or rate >= rate_now:
            continue
        shape = shape_of(now.served_version, _mean_context(now), 1)
        if shape is not None and other.gpu_model in GPUS_GB:
            fit = plan(shape, {}, {other.gpu_model: GPUS_GB[other.gpu_model]}).fits[0]
            if not fit.fits:
                continue
        if best is None or rate < best[1]:
            best = (other, rate)
    return best


def advise(models: Sequence[ModelFigures], shorts: Sequence[ShortRequests],
           usd_per_gpu_hour: Mapping[str, float], weights: tuple[float, float],
           policy: Policy | None = None,
           per_gpu: Sequence[ModelFigures] = ()) -> list[Recommendation]:  # fmt: skip
    """Every recommendation for the fleet, largest saving first.

    ``models``: one summary per model; ``per_gpu``: one per model and GPU type it runs on.
    """
    policy = Policy() if policy is None else policy
    found: list[Recommendation] = []
    for m in models:
        for rec in (right_size(m, policy), quantize(m, usd_per_gpu_hour, policy)):
            if rec is not None and rec.saving_usd_per_month >= policy.min_saving_usd_per_month:
                found.append(rec)
    found.extend(gpu_type(per_gpu, weights, policy))
    found.extend(route(shorts, {m.model: m for m in models}, weights, policy))
    return ranked(found)


def ranked(recs: Iterable[Recommendation]) -> list[Recommendation]:
    """``recs`` largest saving first, ties in a stable order (kind, model, team)."""
    return sorted(recs, key=lambda r: (-r.saving_usd_per_month, r.kind, r.model, r.team or ""))
