"""One Redis script, called by many coroutines, sent as one pipeline per event-loop tick.

On a busy sidecar, admissions arrive in bursts: every coroutine woken in one turn of the event
loop asks Redis at once. Each ``EVALSHA`` sent alone costs a ``send`` system call, a pool
checkout and a read of its own, and on loopback the system call is most of the time an admission
takes. Batching the calls of one tick into one pipeline (no ``MULTI``: each script is atomic by
itself, and a pipeline keeps each call its own command) pays those once per burst while keeping
one command per call.

A call waits at most one loop turn for its companions; a batch of one is sent as a plain command,
since redis-py's pipeline costs several times one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

__all__ = ["ScriptBatcher"]

_Call = tuple[Sequence[str], Sequence[int | str], "asyncio.Future[Any]"]


class ScriptBatcher:
    """Runs ``script`` for every ``call`` of one loop tick in one round trip to Redis."""

    def __init__(self, redis: aioredis.Redis, script: str) -> None:
        self.redis = redis
        self.script = script
        self.sha = redis.register_script(script).sha
        self._queue: list[_Call] = []

    async def call(self, keys: Sequence[str], args: Sequence[int | str]) -> Any:
        """The script's result for these keys and arguments, or the error Redis gave."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self._queue:
            # A task starts on the next loop turn: every caller woken in this one joins first.
            asyncio.get_running_loop().create_task(self._send())
        self._queue.append((keys, args, future))
        return await future

    async def _send(self) -> None:
        batch, self._queue = self._queue, []
        try:
            results = await self._run(batch)
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                # Redis restarted and forgot the script: load it once, run the missing calls again.
                await self.redis.script_load(self.script)
                again = await self._run([batch[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except BaseException as exc:  # handed to every caller, who decides what it means
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller was cancelled (a timeout, a client gone)
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _run(self, batch: list[_Call]) -> list[Any]:
        """Each call's result or error, in order; the batch's error when the connection fails."""
        if len(batch) == 1:
            keys, args, _ = batch[0]
            try:
                sent = self.redis.evalsha(self.sha, len(keys), *keys, *map(str, args))
                return [await sent]  # type: ignore[misc]
            except NoScriptError as exc:
                return [exc]
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys, args, _ in batch:
                pipe.evalsha(self.sha, len(keys), *keys, *map(str, args))
            return list(await pipe.execute(raise_on_error=False))
