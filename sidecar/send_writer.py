"""A stream's client writer over plain ASGI, for a server that gives no raw writer.

The relay on protocols (``sidecar.direct``) writes each metered block to the client from inside
the upstream connection's ``data_received`` and is told when the client stops taking them and
when it leaves (``infermeter.http_guard.RawWriter``). The sidecar's own server gives it that
writer; any other ASGI server (plain uvicorn, hypercorn) gives only ``send`` and ``receive``.
This writer offers the same to the relay over those, so one upstream transport serves both:

- ``write`` keeps the block and wakes one task that sends what was kept, joined, as one
  ``http.response.body`` message (blocks that arrive during a send go out together after it);
- past ``HIGH_WATER`` bytes kept, the listener is told to pause (the upstream connection stops
  reading, so vLLM's bytes wait in the kernel), and told to resume once a send took them: ASGI's
  ``send`` waits while the client's socket buffer is full, which is the server's flow control;
- ``lost`` resolves, and the listener is told, when ``receive`` gives ``http.disconnect`` or a
  send fails with ``OSError`` (what ASGI says a server raises on a closed connection).

``close`` sends what is still kept and stops both tasks, before the relay sends the last event;
``abort`` stops them at once, for a relay that was cancelled.
"""

from __future__ import annotations

import asyncio

from infermeter.asgi import Receive, Send
from infermeter.http_guard import WriterListener

__all__ = ["HIGH_WATER", "SendWriter"]

# Kept bytes past which the upstream pauses: about 70 events of a typical chunk.
HIGH_WATER = 64 << 10


class SendWriter:
    """``RawWriter``'s part the relay uses (``write``, ``lost``, ``paused``, ``listener``) on
    ASGI messages; the response must have been started with ``send``."""

    __slots__ = (
        "_kept",
        "_pump",
        "_send",
        "_size",
        "_stopping",
        "_wake",
        "_watch",
        "listener",
        "lost",
        "paused",
    )

    def __init__(self, send: Send, receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.paused = False
        self.listener: WriterListener | None = None
        self._send = send
        self._kept: list[bytes] = []
        self._size = 0
        self._stopping = False
        self._wake = asyncio.Event()
        self._pump = loop.create_task(self._run())
        self._watch = loop.create_task(self._wait_disconnect(receive))

    def write(self, data: bytes) -> None:
        """Keep ``data`` for the next send (nothing once the client has gone)."""
        if not data or self.lost.done():
            return
        self._kept.append(data)
        self._size += len(data)
        self._wake.set()
        if self._size >= HIGH_WATER and not self.paused:
            self.paused = True
            if self.listener is not None:
                self.listener.writer_paused()

    def abort(self) -> None:
        """Stop at once, sending nothing more (the relay was cancelled: a send in progress could
        keep it waiting on a client that reads nothing)."""
        self._pump.cancel()
        self._watch.cancel()

    async def close(self) -> None:
        """Send what is kept (unless the client has gone), then stop."""
        self._stopping = True
        self._wake.set()
        self._watch.cancel()
        # (``wait``: the caller's own cancellation still reaches it; an aborted pump's does not.)
        await asyncio.wait([self._pump])

    async def _run(self) -> None:
        while not self.lost.done():
            if not self._kept:
                if self._stopping:
                    return
                await self._wake.wait()
                self._wake.clear()
                continue
            data = b"".join(self._kept)
            self._kept.clear()
            self._size = 0
            try:
                await self._send({"type": "http.response.body", "body": data, "more_body": True})
            except OSError:
                self._gone()
                return
            if self.paused and self._size < HIGH_WATER:
                self.paused = False
                if self.listener is not None:
                    self.listener.writer_resumed()

    async def _wait_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._gone()

    def _gone(self) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self._kept.clear()
        self._wake.set()
        if self.listener is not None:
            self.listener.writer_lost()
