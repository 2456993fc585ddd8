"""The configured credentials billing accepts: every team's key and the roles' tokens.

Who may do what is ``infermeter.auth``'s (shared with the sidecar); billing only builds its key
ring from the configuration.
"""

from __future__ import annotations

from infermeter.auth import ADMIN, FEDERATION, INGEST, METRICS, SPEND_READER, KeyRing
from infermeter.config import Config

__all__ = ["keyring"]


def keyring(config: Config) -> KeyRing:
    """Every credential billing accepts, with the role or team it stands for."""
    entries = [(t.name, t.api_key_sha256) for t in config.teams]
    entries += [
        (ADMIN, config.admin_token_sha256),
        (METRICS, config.metrics_token_sha256),
        (SPEND_READER, config.spend_token_sha256),
        (FEDERATION, config.federation_token_sha256),
        (INGEST, config.billing.ingest_token_sha256),
    ]
    return KeyRing(entries)
