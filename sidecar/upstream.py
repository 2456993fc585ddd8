"""What a failed exchange with the replica raises, and the OpenAI-style error the client gets.

Every exchange with the replica (generation requests, the GETs of ``sidecar.fetch``, the engine
listener) goes through the pool on asyncio protocols (``sidecar.pool``), so its errors are the
pool's ``UpstreamError`` classes and ``TimeoutError`` (a deadline of the caller's own, or the
pool's ``ReadTimeout``). A read timeout is a 504; anything else (refused, reset, a connect
timeout, a certificate that does not verify) is a 502.
"""

from __future__ import annotations

import asyncio

from infermeter.errors import error_body
from sidecar.pool import UpstreamError

__all__ = ["UPSTREAM_ERRORS", "upstream_failure"]

# What a failed exchange with the replica raises (for ``except``).
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (asyncio.TimeoutError, UpstreamError)


def upstream_failure(exc: BaseException) -> tuple[int, bytes]:
    """The status and OpenAI error body for a failed exchange: 504 on a read timeout, else 502."""
    if isinstance(exc, asyncio.TimeoutError):
        return 504, error_body(
            504, "The upstream model server timed out.", "upstream_error", "upstream_timeout"
        )
    return 502, error_body(
        502,
        f"The upstream model server is unreachable ({type(exc).__name__}).",
        "upstream_error",
        "upstream_unreachable",
    )
