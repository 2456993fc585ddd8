"""What the advisor offers: a recommendation, and the policy its knobs come from.

A recommendation is one concrete change to the fleet's configuration (engines by the hour, a
larger batch, a precision and GPUs per replica, a GPU type, a routing rule, prefix caching on,
batch work moved off-peak), proven by replaying the period's recorded requests with the change
(``billing.efficiency.plan``). It carries:

- ``change``: the configuration change itself;
- ``saving_usd_per_month``: what it takes off the plan's cost when added to the changes before
  it (``saving_usd`` over the period measured, x 730 / the hours measured);
- ``evidence``: the measured figures it rests on;
- ``replay``: per model it touches, the replay before and after it: GPU-hours, cost, and every
  team's TTFT and inter-token p95 against its targets;
- ``assumptions`` in words, a ``caveat``, and any change to the fleet's own policy it needs
  (``policy_change``: say an unapproved precision), never taken silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["KINDS", "QUALITY_CAVEAT", "Policy", "Recommendation", "ranked"]

KINDS: Final = (
    "right_size",
    "schedule",
    "batch",
    "quantize",
    "gpu_type",
    "route",
    "off_peak",
    "prefix_cache",
)

QUALITY_CAVEAT: Final[Mapping[str, str]] = {
    "fp8": "8-bit weights (FP8) usually stay close to the 16-bit model's quality, but check it "
    "on your own prompts before switching.",
    "int8": "8-bit weights (INT8) usually stay close to the 16-bit model's quality, but check it "
    "on your own prompts before switching.",
    "int4": "4-bit weights (AWQ/GPTQ) can lose quality, most on long reasoning and code; "
    "evaluate on your own traffic before switching.",
}


@dataclass(frozen=True, slots=True)
class Policy:
    """The advisor's knobs: how sure a replay must be, how much headroom, what is worth saying."""

    headroom: float = 0.25  # over an hour's peak, when sizing engines (a first guess)
    sla_margin: float = 0.10  # a replayed p95 must be this far under its target
    vouch_gpu_hours: float = 0.05  # the replay as it ran vs measured GPU-hours, per group
    vouch_ttft: float = 0.20  # ... and TTFT p95
    vouch_ttft_slack_seconds: float = 0.05  # ... or this much, for sub-second TTFTs
    max_refits: int = 4  # replays per model to find the engines it needs
    startup_seconds: float = 180.0  # an engine asked for serves this much later (scaling's)
    min_saving_usd_per_month: float = 1.0
    short_prompt_tokens: int = 512
    short_completion_tokens: int = 256
    min_short_share: float = 0.2  # short share of a team's requests that makes routing worth it
    min_shared_requests: int = 10  # requests with one prompt head for it to count as shared
    min_shared_share: float = 0.2  # share of a model's requests with a shared head
    min_batch_share: float = 0.8  # unstreamed share of a team's requests that makes it batch work
    under_batched: float = 2.0  # the KV cache holds this many times max_num_seqs, or more
    max_num_seqs_limit: int = 256  # the most max_num_seqs a batch change proposes


@dataclass(frozen=True, slots=True)
class Recommendation:
    """One change, what it saves within the plan, the figures and replays behind it."""

    kind: str
    model: str
    team: str | None
    title: str
    saving_usd_per_month: float
    evidence: Mapping[str, Any]
    assumptions: tuple[str, ...]
    caveat: str | None = None
    change: Mapping[str, Any] = field(default_factory=dict)
    replay: Mapping[str, Any] = field(default_factory=dict)
    policy_change: Mapping[str, Any] = field(default_factory=dict)
    saving_usd: float = 0.0  # over the period measured

    def to_json(self) -> dict[str, Any]:
        """The recommendation as JSON-ready values."""
        return {
            "kind": self.kind,
            "model": self.model,
            "team": self.team,
            "title": self.title,
            "saving_usd_per_month": round(self.saving_usd_per_month, 2),
            "saving_usd": self.saving_usd,
            "change": dict(self.change),
            "policy_change": dict(self.policy_change),
            "evidence": dict(self.evidence),
            "replay": dict(self.replay),
            "assumptions": list(self.assumptions),
            "caveat": self.caveat,
        }


def ranked(recs: Iterable[Recommendation]) -> list[Recommendation]:
    """``recs`` largest saving first, ties in a stable order (kind, model, team)."""
    return sorted(recs, key=lambda r: (-r.saving_usd_per_month, r.kind, r.model, r.team or ""))
