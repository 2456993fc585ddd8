"""GETs to the replica's own endpoints (``/health``, ``/v1/models``, ``/metrics``) on the pool.

The generation requests' connection pool (``sidecar.pool``) serves these too, over plain HTTP
beside a vLLM pod or TLS to an https upstream: no second HTTP client (httpx, loaded for three
small GETs, was several MB of every sidecar's memory, ``docs/benchmarks.md``).

Failures raise what ``sidecar.upstream.UPSTREAM_ERRORS`` lists: ``UpstreamError`` from the pool,
``TimeoutError`` past ``timeout_seconds``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sidecar.direct import Pools, WholeSink

__all__ = ["Fetched", "fetch"]


@dataclass(frozen=True, slots=True)
class Fetched:
    """A whole response: its status, its content type (b"" when none) and its body."""

    status: int
    content_type: bytes
    body: bytes


async def fetch(
    pools: Pools, base: str, path: str, headers: dict[str, str], timeout_seconds: float
) -> Fetched:
    """GET ``base + path`` with ``headers``, read whole within ``timeout_seconds``."""
    target = pools.get(base)
    pool = target.pool
    sink = WholeSink(asyncio.get_running_loop(), None)
    async with asyncio.timeout(timeout_seconds):
        conn = await pool.connection()
        conn.send(target.head(b"GET", path.encode(), headers, 0), sink, timeout_seconds)
        try:
            failed = await sink.finished
        except BaseException:
            conn.close()  # timed out or cancelled: the connection's state is unknown
            raise
    if failed is not None:
        raise failed
    kind = next((v for k, v in sink.raw_headers if k.lower() == b"content-type"), b"")
    return Fetched(sink.status, kind, b"".join(sink.parts))
