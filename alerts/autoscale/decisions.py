"""The autoscaler's decisions as records for billing: what a change is, and how it leaves.

A change is a decision whose desired count differs from the one the policy measured it against
(``changed_from``). Its record (``decision_record``, pure) is appended to the autoscaler's own
spool before any hook hears of the change, and a shipper moves the spool to billing's ingest as
kind ``scaling_decisions`` (``DecisionShipping``), with the durability every spool has: a
record is on disk when the append returns, and a segment is deleted only once billing has it. A
record still unshipped when the autoscaler stops is shipped by the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Final

import httpx
from prometheus_client import CollectorRegistry

from alerts.autoscale.policy import Decision, ModelState
from infermeter.ids import sample_id
from infermeter.records import MAX_DECISION_REASONS, SCALING_DECISIONS, ScalingDecision
from infermeter.shipper import Shipper, ShipperMetrics, last_shipment
from infermeter.spool import Spool
from infermeter.writers import Credential, Sealer

__all__ = [
    "DECISIONS_MAX_BYTES",
    "LAST_SHIPMENT_SECONDS",
    "DecisionShipping",
    "changed_from",
    "decision_record",
]

log = logging.getLogger("infermeter.autoscale")

# Unshipped decisions kept at most (a few hundred bytes each, a few an hour): past it a change is
# logged only, with the spool's error.
DECISIONS_MAX_BYTES: Final = 16 << 20
# On the way out, the spool is shipped once more for at most this long; what is left stays on
# disk for the next start.
LAST_SHIPMENT_SECONDS: Final = 3.0


def changed_from(decision: Decision, state: ModelState | None) -> int | None:
    """The count ``decision`` changes from, or None when it asks for the same one.

    That is the count last asked for, or on the first tick the replicas seen serving: the same
    count the policy measures a change against.
    """
    last = state.last_desired if state is not None else None
    previous = decision.current if last is None else last
    return None if decision.desired == previous else previous


def decision_record(decision: Decision, previous: int) -> ScalingDecision:
    """The record of a change, as billing keeps it.

    The id is the time and the model, so a record spooled twice is kept once. The reasons are
    joined as the log line has them and cut to ``MAX_DECISION_REASONS`` characters (ending in
    an ellipsis when cut): billing refuses a longer record.
    """
    reasons = "; ".join(decision.reasons)
    if len(reasons) > MAX_DECISION_REASONS:
        reasons = reasons[: MAX_DECISION_REASONS - 1] + "\u2026"
    return ScalingDecision(
        decision_id=sample_id(decision.time, "scale", decision.model),
        model=decision.model,
        decided_at=decision.time,
        previous=previous,
        current=decision.current,
        desired=decision.desired,
        reasons=reasons,
    )


class DecisionShipping:
    """The decisions' spool and the shipper that empties it into billing's ingest."""

    def __init__(
        self,
        directory: Path,
        ingest_url: str,
        token: str | None,
        client: httpx.AsyncClient,
        registry: CollectorRegistry | None = None,
        credential: Credential | None = None,
    ) -> None:
        """``credential``: the autoscaler's writer credential (it seals and ships the decisions)."""
        sealer = Sealer(credential) if credential is not None else None
        self.spool = Spool(directory, max_bytes=DECISIONS_MAX_BYTES, sealer=sealer)
        self.shipper = Shipper(
            self.spool,
            ingest_url,
            token,
            SCALING_DECISIONS.key,
            client,
            metrics=ShipperMetrics(registry),
            credential=credential,
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the spool (adopting what an earlier run left) and start shipping."""
        self.spool.open()
        self._task = asyncio.create_task(self.shipper.run(), name="ship-scaling-decisions")

    async def stop(self, last_shipment_seconds: float = LAST_SHIPMENT_SECONDS) -> None:
        """Stop shipping, close the spool, and ship what it holds once more, briefly."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.spool.close()
        await last_shipment([self.shipper], last_shipment_seconds)
        if self.spool.backlog:
            log.warning(
                "autoscale: %d decision(s) not shipped yet; kept in %s for the next start",
                self.spool.backlog,
                self.spool.directory,
            )
