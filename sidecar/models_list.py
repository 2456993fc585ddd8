"""The sidecar's ``/v1/models``: vLLM's list with the names clients must use added to it.

vLLM lists the version it serves (``--served-model-name``); clients of the fleet ask for the
model registry's alias (``chat-small``) and may name any approved version, so those entries
are added, in OpenAI's shape, each pointing at the served version through ``root``.
"""

from __future__ import annotations

from typing import Any

import orjson

from sidecar.state import View

__all__ = ["with_aliases"]


def with_aliases(upstream_body: bytes, view: View) -> bytes:
    """vLLM's model list plus an entry per name ``view`` routes and vLLM does not list.

    A body that is not OpenAI's list shape is given back as it came: the sidecar relays what
    it cannot read rather than guess.
    """
    try:
        listing = orjson.loads(upstream_body)
    except orjson.JSONDecodeError:
        return upstream_body
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return upstream_body
    entries: list[Any] = listing["data"]
    listed = {e.get("id") for e in entries if isinstance(e, dict)}
    served = next(
        (e for e in entries if isinstance(e, dict) and e.get("id") == view.served_version), {}
    )
    added = [
        _entry(name, view.served_version, served) for name in view.available if name not in listed
    ]
    return orjson.dumps({**listing, "data": added + entries})


def _entry(name: str, served_version: str, served: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI model object for ``name``, served by ``served_version``."""
    return {
        "id": name,
        "object": "model",
        "created": served.get("created", 0),
        "owned_by": served.get("owned_by", "infermeter"),
        "root": served_version,
        "parent": None,
        "max_model_len": served.get("max_model_len"),
    }
