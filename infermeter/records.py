"""Records that cross stages: born in the sidecar or a collector, kept by billing.

They are frozen dataclasses so a stage can hand one on without fearing that the next one edits
it; JSON is their wire and spool format (``to_json``/``from_json``), with times as Unix seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

__all__ = ["EngineSample", "GpuSample", "RequestStatus", "UsageRecord"]


class RequestStatus(StrEnum):
    """How a request ended, as far as the team that sent it is concerned."""

    OK = "ok"
    CLIENT_ABORTED = "client_aborted"
    UPSTREAM_ERROR = "upstream_error"
    BAD_REQUEST = "bad_request"
    REJECTED = "rejected"
    RATE_LIMITED = "rate_limited"
    UNAUTHORIZED = "unauthorized"


class _Record:
    def to_json(self) -> dict[str, Any]:
        """A plain dict for JSON: the spool and wire format."""
        return dataclasses.asdict(self)  # type: ignore[call-overload,no-any-return]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        """Rebuild a record from ``to_json``'s output; unknown keys are an error."""
        return cls(**data)


@dataclass(frozen=True, slots=True)
class UsageRecord(_Record):
    """What one request used, written once by the sidecar that served it.

    ``request_id`` is the idempotency key of the whole pipeline: billing keeps the first record
    with a given id and ignores resends.
    """

    request_id: str
    team: str
    model: str
    served_version: str
    replica: str
    received_at: float
    first_token_at: float | None
    finished_at: float
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    status: str
    http_status: int
    stream: bool
    endpoint: str = "/v1/chat/completions"
    finish_reason: str | None = None
    usage_exact: bool = True


@dataclass(frozen=True, slots=True)
class GpuSample(_Record):
    """One reading of one GPU (or MIG slice), joined to the replica that runs on it."""

    sample_id: str
    node: str
    gpu: str
    uuid: str
    gpu_model: str
    replica: str | None
    model: str | None
    timestamp: float
    interval_seconds: float
    utilization: float
    power_watts: float
    energy_joules: float | None
    memory_used_mib: float
    memory_free_mib: float
    xid_errors: int = 0
    mig_profile: str | None = None
    gap: bool = False


@dataclass(frozen=True, slots=True)
class EngineSample(_Record):
    """One reading of a vLLM engine's own state and counters."""

    sample_id: str
    replica: str
    model: str
    timestamp: float
    requests_running: float
    requests_waiting: float
    kv_cache_usage: float
    prompt_tokens_total: float
    generation_tokens_total: float
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0
    preemptions_total: float = 0.0
