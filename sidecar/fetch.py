"""GETs to the replica's own endpoints (``/health``, ``/v1/models``, ``/metrics``) on the pool.

The generation requests' connection pool (``sidecar.pool``) serves these too when the upstream
is plain HTTP, as it is beside a vLLM pod. An https upstream, which the pool does not speak,
takes httpx, imported then: httpx loads its command-line tool with ``rich`` and ``pygments``
when they are installed and builds an SSL context per client, which is several MB of every
sidecar's memory for three small GETs (``docs/benchmarks.md``).

Failures raise what ``sidecar.upstream.upstream_errors`` lists: ``UpstreamError`` from the pool
(httpx's errors on the https path are turned into the same), ``TimeoutError`` past
``timeout_seconds``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sidecar.direct import Pools, WholeSink
from sidecar.pool import ConnectTimeout, ReadTimeout, UpstreamClosed, request_head

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
    found = pools.get(base)
    if found is None:
        return await _fetch_https(base + path, headers, timeout_seconds)
    pool, host, prefix = found
    sink = WholeSink(asyncio.get_running_loop(), None)
    async with asyncio.timeout(timeout_seconds):
        conn = await pool.connection()
        conn.send(
            request_head(b"GET", prefix + path.encode(), host, headers, 0), sink, timeout_seconds
        )
        try:
            failed = await sink.finished
        except BaseException:
            conn.close()  # timed out or cancelled: the connection's state is unknown
            raise
    if failed is not None:
        raise failed
    kind = next((v for k, v in sink.raw_headers if k.lower() == b"content-type"), b"")
    return Fetched(sink.status, kind, b"".join(sink.parts))


async def _fetch_https(url: str, headers: dict[str, str], timeout_seconds: float) -> Fetched:
    """The same GET with httpx, its errors turned into the pool's (the callers know only those)."""
    import httpx  # only for an upstream the pool does not speak

    try:
        async with httpx.AsyncClient(timeout=timeout_seconds) as client:
            r = await client.get(url, headers=headers)
    except httpx.ConnectTimeout as exc:
        raise ConnectTimeout("connect timeout") from exc
    except httpx.TimeoutException as exc:
        raise ReadTimeout("Timeout on reading data from the replica") from exc
    except httpx.HTTPError as exc:
        raise UpstreamClosed(f"{type(exc).__name__}: {exc}") from exc
    kind = r.headers.get("content-type", "")
    return Fetched(r.status_code, kind.encode("latin-1"), r.content)
