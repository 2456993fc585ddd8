"""What every page needs, made once per app: the configuration, the billing client, the gate."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from flask import request

from dashboards.client import BillingClient, BillingError
from dashboards.data import Window, window
from dashboards.oidc import sso_session_id
from dashboards.sessions import Gate, Session
from infermeter.config import Config

__all__ = ["SPAN_SECONDS", "Context", "Spans"]

# How long the data's span is reused before billing is asked again.
SPAN_SECONDS: Final = 30.0


class Spans:
    """The span of the data each key may see, asked of billing at most every ``SPAN_SECONDS``."""

    def __init__(self, client: BillingClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._known: dict[str, tuple[float, tuple[float, float] | None]] = {}

    def of(self, token: str) -> tuple[float, float] | None:
        """The first and the end of ``token``'s data (None: none, or billing did not say)."""
        now = time.monotonic()
        with self._lock:
            kept = self._known.get(token)
        if kept is not None and now - kept[0] < SPAN_SECONDS:
            return kept[1]
        try:
            span = self._client.span(token)
        except BillingError:
            return None  # the page says billing's error itself; the range falls back
        with self._lock:
            if len(self._known) > 10_000:
                self._known.clear()
            self._known[token] = (now, span)
        return span


@dataclass(frozen=True, slots=True)
class Context:
    """The configuration the app was started with, its client for billing, and the gate every
    callback passes (``dashboards.sessions``)."""

    config: Config
    client: BillingClient
    gate: Gate
    spans: Spans = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", Spans(self.client))

    def session(self, auth: Any) -> Session | None:
        """The signed-in session the browser's ``auth`` store (else its single sign-on cookie)
        names, for this request's address.

        None when signed out, when the session is unknown or over, or while the address is locked
        out of sign-in: a callback then shows nothing and asks billing nothing.
        """
        names_one = isinstance(auth, dict) and isinstance(auth.get("session"), str)
        if not names_one and (sid := sso_session_id()) is not None:
            auth = {"session": sid}  # signed in with single sign-on: the cookie names it
        return self.gate.session(auth, request.remote_addr or "unknown")

    def window(self, session: Session, choice: str | None) -> Window:
        """The range ``choice`` picks for ``session``: "fit" fits it to the data it may see."""
        span = self.spans.of(session.token) if (choice or "fit") == "fit" else None
        return window(choice, span)
