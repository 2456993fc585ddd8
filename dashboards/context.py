"""What every page needs, made once per app: the configuration, the billing client, the gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import request

from dashboards.client import BillingClient
from dashboards.sessions import Gate, Session
from infermeter.config import Config

__all__ = ["Context"]


@dataclass(frozen=True, slots=True)
class Context:
    """The configuration the app was started with, its client for billing, and the gate every
    callback passes (``dashboards.sessions``)."""

    config: Config
    client: BillingClient
    gate: Gate

    def session(self, auth: Any) -> Session | None:
        """The signed-in session the browser's ``auth`` store names, for this request's address.

        None when signed out, when the session is unknown or over, or while the address is locked
        out of sign-in: a callback then shows nothing and asks billing nothing.
        """
        return self.gate.session(auth, request.remote_addr or "unknown")
