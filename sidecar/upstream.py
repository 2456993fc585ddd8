"""The sidecar's connections to its vLLM replica for generation requests: aiohttp's client.

Every token of every user is read here, so this path uses aiohttp rather than httpx: its
keep-alive pool hands out an idle connection in O(1) (httpx's pool checks every pooled connection
on every request), and ``readany()`` returns everything that has arrived in one ``bytes``, so
events that arrive together are metered and sent on together instead of one HTTP chunk at a time.
The sidecar's other upstream calls (health, model list, shipping) stay on httpx.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

from sidecar.errors import error_body

__all__ = ["UPSTREAM_ERRORS", "Upstream", "upstream_failure"]

# What a failed exchange with the replica raises, from either client.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, httpx.HTTPError)
# uvicorn, which serves vLLM's API, closes idle connections after 5 s; dropping them first avoids
# sending a request on a connection the server is closing.
_KEEPALIVE_SECONDS = 4.0


class Upstream:
    """A keep-alive pool of connections to one replica, opened on first use."""

    def __init__(self, connect_timeout_seconds: float, read_timeout_seconds: float) -> None:
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_seconds, sock_read=read_timeout_seconds
        )
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # A session belongs to the event loop it was made on, so it is made inside the server.
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_SECONDS
        )
        # No cookie jar: a proxy must not carry one client's cookies into another's requests.
        return aiohttp.ClientSession(
            connector=connector, timeout=self.timeout, cookie_jar=aiohttp.DummyCookieJar()
        )

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send a POST and return once the response head has arrived; the body is not read.

        The caller ends the response with ``release()`` once its body is read to the end (the
        connection goes back to the pool) or ``close()`` otherwise (the connection is closed,
        which is how vLLM learns that a request was abandoned).
        """
        if self._session is None or self._session.closed:
            self._session = self._open()
        return await self._session.post(url, data=body, headers=headers, allow_redirects=False)

    async def close(self) -> None:
        """Close every pooled connection."""
        if self._session is not None:
            await self._session.close()


def upstream_failure(exc: BaseException) -> tuple[int, bytes]:
    """The status and OpenAI error body for a failed exchange: 504 on a read timeout, else 502."""
    connect = isinstance(exc, httpx.ConnectTimeout | aiohttp.ConnectionTimeoutError)
    if isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError) and not connect:
        return 504, error_body(
            504, "The upstream model server timed out.", "upstream_error", "upstream_timeout"
        )
    return 502, error_body(502, f"The upstream model server is unreachable ({type(exc).__name__}).",
                           "upstream_error", "upstream_unreachable")  # fmt: skip
