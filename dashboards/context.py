"""What every page needs, made once per app: the configuration and the billing client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dashboards.client import BillingClient
from infermeter.config import Config

__all__ = ["Context", "signed_in"]


@dataclass(frozen=True, slots=True)
class Context:
    """The configuration the app was started with and its client for billing."""

    config: Config
    client: BillingClient


def signed_in(auth: Any) -> bool:
    """True when the session store holds a credential that billing accepted."""
    return isinstance(auth, dict) and isinstance(auth.get("token"), str)
