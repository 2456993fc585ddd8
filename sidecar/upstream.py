"""The sidecar's aiohttp connections to its vLLM replica, when ``sidecar.protocol_relay`` is off.

(With it on, the default, generation requests go through ``sidecar.pool`` instead.)

Every token of every user is read here, so this path uses aiohttp rather than httpx: its
keep-alive pool hands out an idle connection in O(1) (httpx's pool checks every pooled connection
on every request), and ``readany()`` returns everything that has arrived in one ``bytes``, so
events that arrive together are metered and sent on together instead of one HTTP chunk at a time.
The sidecar's other calls to the replica (health, model list, metrics) take the protocol pool
too (``sidecar.fetch``); httpx is loaded only for an https upstream or for shipping.

aiohttp is imported only when this relay is first used (7.6 MB of an idle sidecar's memory
otherwise): the default relay never loads it, and no aiohttp error can be raised before it is
loaded, which is what ``upstream_errors`` relies on.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING

from infermeter.errors import error_body
from sidecar.pool import UpstreamError

if TYPE_CHECKING:
    import aiohttp

__all__ = ["StallWatch", "Upstream", "upstream_errors", "upstream_failure"]

# What a failed exchange with the replica raises from the protocol pool.
_ERRORS: tuple[type[BaseException], ...] = (asyncio.TimeoutError, UpstreamError)
# uvicorn, which serves vLLM's API, closes idle connections after 5 s; dropping them first avoids
# sending a request on a connection the server is closing.
_KEEPALIVE_SECONDS = 4.0


class Upstream:
    """A keep-alive pool of connections to one replica, opened on first use."""

    def __init__(self, connect_timeout_seconds: float, read_timeout_seconds: float) -> None:
        self.connect_timeout_seconds = connect_timeout_seconds
        self.read_timeout_seconds = read_timeout_seconds
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # A session belongs to the event loop it was made on, so it is made inside the server.
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.connect_timeout_seconds,
            sock_read=self.read_timeout_seconds,
        )
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_SECONDS
        )
        # No cookie jar: a proxy must not carry one client's cookies into another's requests.
        return aiohttp.ClientSession(
            connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
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


class StallWatch:
    """The read timeout of a streamed body, checked lazily instead of re-armed on every chunk.

    aiohttp re-arms ``sock_read`` on every chunk received: a timer handle made and another
    cancelled, measured at 14% of the sidecar's CPU with 500 streams at 20 tokens/s. Once the
    response head is in, this watch takes over: its timer fires at most once per ``seconds`` and
    fails the body's reads only if one has by then been waiting that long. The reader sets
    ``waiting_since`` (``time.perf_counter()``) before each read and clears it after.
    """

    def __init__(self, response: aiohttp.ClientResponse, seconds: float) -> None:
        self.waiting_since: float | None = None
        self._response = response
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        connection = response.connection
        if connection is not None and connection.protocol is not None:
            # The timer aiohttp armed for the head is dropped when the next chunk arrives.
            connection.protocol.read_timeout = None
        self._handle = self._loop.call_later(seconds, self._check)

    def _check(self) -> None:
        since = self.waiting_since
        waited = 0.0 if since is None else time.perf_counter() - since
        if waited >= self._seconds:
            import aiohttp  # loaded: this watches an aiohttp response

            exc = aiohttp.SocketTimeoutError("Timeout on reading data from socket")
            self._response.content.set_exception(exc)
            return
        self._handle = self._loop.call_later(self._seconds - waited, self._check)

    def cancel(self) -> None:
        """Stop watching (the body was read, or the exchange is over)."""
        self._handle.cancel()


def upstream_errors() -> tuple[type[BaseException], ...]:
    """What a failed exchange with the replica raises, from any of the clients in use.

    aiohttp's errors are among them once the ASGI relay has loaded aiohttp; before that, none
    can be raised. (httpx's, on an https upstream's GETs, are converted in ``sidecar.fetch``.)
    """
    loaded = sys.modules.get("aiohttp")
    return _ERRORS if loaded is None else (*_ERRORS, loaded.ClientError)


def upstream_failure(exc: BaseException) -> tuple[int, bytes]:
    """The status and OpenAI error body for a failed exchange: 504 on a read timeout, else 502."""
    loaded = sys.modules.get("aiohttp")
    connect = loaded is not None and isinstance(exc, loaded.ConnectionTimeoutError)
    if isinstance(exc, asyncio.TimeoutError) and not connect:
        return 504, error_body(
            504, "The upstream model server timed out.", "upstream_error", "upstream_timeout"
        )
    return 502, error_body(
        502,
        f"The upstream model server is unreachable ({type(exc).__name__}).",
        "upstream_error",
        "upstream_unreachable",
    )
