"""A stream's client writer over plain ASGI (``sidecar.send_writer``), against fake send/receive."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from sidecar.send_writer import HIGH_WATER, SendWriter


class Listener:
    """What the writer told the relay, in order."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def writer_paused(self) -> None:
        self.told.append("paused")

    def writer_resumed(self) -> None:
        self.told.append("resumed")

    def writer_lost(self) -> None:
        self.told.append("lost")


class Client:
    """An ASGI server's side: ``send`` waits while ``gate`` is shut; ``receive`` waits for
    ``leave``."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.leave = asyncio.Event()

    async def send(self, message: MutableMapping[str, Any]) -> None:
        assert message["type"] == "http.response.body"
        assert message["more_body"]
        await self.gate.wait()
        self.sent.append(message["body"])

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_blocks_written_during_a_send_go_out_together_and_close_sends_the_rest() -> None:
    client = Client()
    writer = SendWriter(client.send, client.receive)
    client.gate.clear()
    writer.write(b"a")
    await _settle()  # the first send is waiting on the client
    writer.write(b"b")
    writer.write(b"c")
    client.gate.set()
    await _settle()
    writer.write(b"d")
    await writer.close()
    assert client.sent == [b"a", b"bc", b"d"]


async def test_past_the_high_water_mark_the_upstream_pauses_until_a_send_takes_it() -> None:
    client, listener = Client(), Listener()
    writer = SendWriter(client.send, client.receive)
    writer.listener = listener
    client.gate.clear()
    writer.write(b"x")
    await _settle()
    writer.write(b"y" * HIGH_WATER)
    assert (writer.paused, listener.told) == (True, ["paused"])
    client.gate.set()
    await _settle()
    assert (writer.paused, listener.told) == (False, ["paused", "resumed"])
    await writer.close()


async def test_the_disconnect_message_ends_it_and_nothing_more_is_sent() -> None:
    client, listener = Client(), Listener()
    writer = SendWriter(client.send, client.receive)
    writer.listener = listener
    client.leave.set()
    await _settle()
    assert writer.lost.done()
    assert listener.told == ["lost"]
    writer.write(b"late")
    await writer.close()
    assert client.sent == []


async def test_abort_does_not_wait_for_a_send_the_client_never_takes() -> None:
    client = Client()
    writer = SendWriter(client.send, client.receive)
    client.gate.clear()
    writer.write(b"stuck")
    await _settle()
    writer.abort()
    await asyncio.wait_for(writer.close(), 1)  # (close alone would wait on the send for ever)
    assert client.sent == []
