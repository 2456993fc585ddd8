"""The scenario's clients: the official OpenAI SDK, each request's outcome in the truth log.

What a client saw is half of what really happened: which team sent a request (the sidecar
rewrites the credential, so no engine knows), whether its answer arrived whole, and how many
tokens reached it before it hung up or its connection broke.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import openai

from simulator.truth import TruthWriter

__all__ = ["Ask", "Client"]


@dataclass(frozen=True)
class Ask:
    """One request to send: what to ask, and when the client gives up on purpose."""

    team: str
    model: str
    stream: bool
    n: int = 1
    max_tokens: int = 24
    words: int = 20
    completions: bool = False  # /v1/completions instead of chat
    hang_up_after_tokens: int | None = None  # stream: leave after this many token chunks
    give_up_after_seconds: float | None = None  # whole answer: leave after this long


class Client:
    """Sends ``Ask``s through a sidecar with the team's key; logs each outcome."""

    def __init__(self, keys: dict[str, str], truth: TruthWriter) -> None:
        self.keys = keys
        self.truth = truth
        self._clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}

    def _sdk(self, base_url: str, team: str) -> openai.AsyncOpenAI:
        key = (base_url, team)
        if key not in self._clients:
            self._clients[key] = openai.AsyncOpenAI(
                base_url=f"{base_url}/v1", api_key=self.keys[team], max_retries=0, timeout=120.0
            )
        return self._clients[key]

    async def close(self) -> None:
        """Close every SDK client."""
        for sdk in self._clients.values():
            await sdk.close()

    async def send(self, base_url: str, ask: Ask) -> dict[str, Any]:
        """Send ``ask`` to the sidecar at ``base_url``; return (and log) what the client saw."""
        rid = f"ft-{uuid.uuid4().hex[:20]}"
        outcome: dict[str, Any] = {
            "request_id": rid,
            "team": ask.team,
            "model": ask.model,
            "target": base_url,
            "stream": ask.stream,
            "n": ask.n,
            "sent": time.time(),
            "status": None,
            "complete": False,
            "received_tokens": 0,
            "usage": None,
            "hung_up": False,
            "error": None,
            "response_id": None,
        }
        sdk = self._sdk(base_url, ask.team)
        try:
            if ask.stream:
                await self._stream(sdk, ask, rid, outcome)
            else:
                await self._whole(sdk, ask, rid, outcome)
        except openai.APIStatusError as exc:
            outcome["status"] = exc.status_code
            outcome["error"] = type(exc).__name__
            outcome["code"] = exc.code
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            outcome["error"] = type(exc).__name__
        outcome["ended"] = time.time()
        self.truth.write("client", outcome)
        return outcome

    def _args(self, ask: Ask, rid: str) -> dict[str, Any]:
        text = " ".join(["measure the fleet"] * max(1, ask.words // 3))
        args: dict[str, Any] = {
            "model": ask.model,
            "max_tokens": ask.max_tokens,
            "n": ask.n,
            "extra_headers": {"x-request-id": rid},
            "extra_body": {"ignore_eos": True},
        }
        if ask.completions:
            args["prompt"] = text
        else:
            args["messages"] = [{"role": "user", "content": text}]
        return args

    async def _stream(
        self, sdk: openai.AsyncOpenAI, ask: Ask, rid: str, out: dict[str, Any]
    ) -> None:
        api = sdk.completions if ask.completions else sdk.chat.completions
        stream = await api.create(
            **self._args(ask, rid), stream=True, stream_options={"include_usage": True}
        )
        out["status"] = 200
        try:
            async for chunk in stream:
                out["response_id"] = chunk.id
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.model_dump()
                for choice in chunk.choices:
                    role = getattr(getattr(choice, "delta", None), "role", None)
                    if role is None:
                        out["received_tokens"] += 1
                if (
                    ask.hang_up_after_tokens is not None
                    and out["received_tokens"] >= ask.hang_up_after_tokens
                ):
                    out["hung_up"] = True
                    return
            out["complete"] = True
        finally:
            await stream.close()

    async def _whole(
        self, sdk: openai.AsyncOpenAI, ask: Ask, rid: str, out: dict[str, Any]
    ) -> None:
        api = sdk.completions if ask.completions else sdk.chat.completions
        call = api.create(**self._args(ask, rid))
        try:
            reply = await asyncio.wait_for(call, ask.give_up_after_seconds)
        except TimeoutError:
            out["hung_up"] = True
            return
        out["status"] = 200
        out["complete"] = True
        out["response_id"] = reply.id
        out["usage"] = reply.usage.model_dump() if reply.usage else None
        out["received_tokens"] = reply.usage.completion_tokens if reply.usage else 0
