"""The ids a response is known by besides the sidecar's own: vLLM's and the caller's.

A user holds vLLM's response id (``chatcmpl-...``, ``cmpl-...``, ``embd-...``) or the
``x-request-id`` it sent itself, not the sidecar's ``request_id``; the usage record keeps all
three so that billing can find it by any. The caller's id is stored and echoed, so it is held to
a short, plain form: anything else is ignored, never an error, since a bad tracing header must
not fail an inference request.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["MAX_CLIENT_ID_CHARS", "client_request_id", "response_id"]

MAX_CLIENT_ID_CHARS: Final = 128
_CLIENT_ID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_CLIENT_ID_CHARS}}}", re.ASCII)
# vLLM writes the id first in every body and chunk; its ids are plain ASCII.
_RESPONSE_ID = re.compile(rb'\{"id":"([A-Za-z0-9._:/+=@-]{1,256})"')


def client_request_id(value: str | None) -> str | None:
    """The caller's ``x-request-id`` when it is 1-128 characters of ``[A-Za-z0-9._:/+=@-]``."""
    if value is None or _CLIENT_ID.fullmatch(value) is None:
        return None
    return value


def response_id(content: bytes) -> str | None:
    """The id of the first response object in ``content`` (a body, or a stream's first events)."""
    found = _RESPONSE_ID.search(content, 0, 512)
    return None if found is None else found[1].decode("ascii")
