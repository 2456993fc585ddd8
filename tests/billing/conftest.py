"""Records with known contents, for the billing tests (the configuration and an empty ledger
for it are the shared ones of tests/conftest.py)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from infermeter.ids import sample_id
from infermeter.records import InstanceEvent, RequestStatus, ScalingDecision, UsageRecord

# 2026-10-01 00:00:00 UTC: a month that has ended, so it can be closed.
OCT = 1790812800.0
NOV = 1793491200.0
_ids = itertools.count()


def usage(
    team: str = "search", start: float = OCT + 3600, seconds: float = 10.0, **kw: Any
) -> dict[str, Any]:
    """A completed streamed request of ``team`` on replica small-0, ``seconds`` long.

    Every field is present, fields with defaults included, as the sidecar writes records: the
    sidecar's own ``UsageRecord.to_json``.
    """
    record = UsageRecord(
        request_id=f"req-{next(_ids)}",
        team=team,
        model="chat-small",
        served_version="llama-3.1-8b-instruct",
        replica="small-0",
        received_at=start,
        first_token_at=start + 0.1,
        finished_at=start + seconds,
        prompt_tokens=100,
        cached_prompt_tokens=0,
        completion_tokens=50,
        status=RequestStatus.OK.value,
        http_status=200,
        stream=True,
        finish_reason="stop",
    ).to_json()
    record.update(kw)
    return record


def gpu_samples(
    replica: str = "small-0",
    start: float = OCT,
    seconds: float = 3600.0,
    every: float = 10.0,
    gpu_model: str = "L40S",
    watts: float = 200.0,
    node: str = "node-b",
    gpu: str = "0",
) -> list[dict[str, Any]]:
    """A GPU of ``replica`` seen every ``every`` seconds from ``start`` for ``seconds``."""
    out = []
    t = start + every
    while t <= start + seconds + 1e-9:
        out.append(
            {
                "sample_id": f"gpu-{next(_ids)}",
                "node": node,
                "gpu": gpu,
                "uuid": f"GPU-{node}-{gpu}",
                "gpu_model": gpu_model,
                "replica": replica or None,
                "model": "chat-small",
                "timestamp": t,
                "interval_seconds": every,
                "utilization": 0.5,
                "power_watts": watts,
                "energy_joules": watts * every,
                "memory_used_mib": 1000.0,
                "memory_free_mib": 1000.0,
            }
        )
        t += every
    return out


def instance_event(
    instance: str,
    kind: str,
    t: float,
    started_at: float,
    *,
    event_id: str | None = None,
    replica: str = "small-0",
    model: str = "chat-small",
    node: str = "node-b",
    **fields: Any,
) -> dict[str, Any]:
    """An event ``kind`` at ``t`` of ``instance`` (one L40S, started at ``started_at``), as its
    sidecar writes it: the sidecar's own ``InstanceEvent.to_json``.

    ``fields`` are the event's optional fields (``gpus``, ``engine_metrics_url``, ...); the id
    is ``ev-N`` unless ``event_id`` says otherwise.
    """
    return InstanceEvent(
        event_id=event_id or f"ev-{next(_ids)}",
        instance=instance,
        replica=replica,
        model=model,
        event=kind,
        timestamp=t,
        started_at=started_at,
        node=node,
        gpu_model="L40S",
        gpu_count=1,
        **fields,
    ).to_json()


def scaling_decision(
    at: float, previous: int, desired: int, reasons: str, model: str = "chat-small"
) -> dict[str, Any]:
    """The autoscaler's change of ``model`` from ``previous`` replicas to ``desired`` at ``at``,
    as it spools it: its own ``ScalingDecision.to_json``."""
    return ScalingDecision(
        decision_id=sample_id(at, "scale", model),
        model=model,
        decided_at=at,
        previous=previous,
        current=previous,
        desired=desired,
        reasons=reasons,
    ).to_json()


def bearer(key: str) -> dict[str, str]:
    """The header that presents ``key`` (an API key or token) to a service."""
    return {"authorization": f"Bearer {key}"}


def batch(kind: str, records: list[Any]) -> bytes:
    """A batch as one JSON object, for ``POST /v1/ingest``."""
    return orjson.dumps({kind: records})


def ndjson(records: list[Any]) -> bytes:
    """Records one per line, as in a spool segment."""
    return b"".join(orjson.dumps(r) + b"\n" for r in records)
