"""A vLLM upstream for proxy benchmarks: vLLM 0.32's bytes, at a fixed engine step, for little CPU.

The simulated replica (``infermeter simulate``) spends 30-40 µs of CPU per chunk on its engine
model and its server, on the same two cores as the proxy measured. This one spends a few: it
validates a request as the simulator does (``simulator.protocol``, which ``tests/conformance``
holds to real vLLM), renders its whole answer once with the simulator's formatters, and then
only writes it out, one engine step at a time. What it honours, as vLLM does:

- ``stream``, ``stream_options.include_usage`` and ``continuous_usage_stats``: the role chunk,
  one chunk per token and choice, usage on every chunk or on none, the final usage chunk,
  ``system_fingerprint`` on the last JSON chunk, ``[DONE]``;
- ``n`` and a batch of prompts (``/v1/completions``): every choice advances one token a step,
  a chunk's running usage counting its own choice;
- ``max_tokens`` (every choice runs to it: ``finish_reason`` ``length``); a non-streamed request
  gets vLLM's whole body once its last step has run;
- a client that closes its connection aborts its request at once;
- ``connection: close`` on a request (uvicorn's keep-alive rule): the connection is closed once
  its answer is written, which is how a client reading an answer in batches sees its end.

Every running request advances one token each ``--step-ms`` (one timer for all, as one engine
step gives every sequence of its batch a token); ``--step-ms 0`` writes each answer at once.
``tests/sidecar/test_vllm_upstream.py`` checks its bytes against the captures of real vLLM in
``tests/fixtures``.

    .venv/bin/python -m bench.vllm_upstream --port 8000 --model tiny --step-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson

from simulator.protocol import (
    ApiError,
    ChatFormatter,
    CompletionFormatter,
    Generation,
    parse_chat,
    parse_completion,
    parse_json,
)
from simulator.replica import next_text

__all__ = ["Answer", "Upstream", "render", "serve"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FINGERPRINT = "vllm-0.32.0-bench"
MAX_MODEL_LEN = 1 << 20
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; "
    b"charset=utf-8\r\ntransfer-encoding: chunked\r\n"
)


@dataclass
class Answer:
    """One request's answer, rendered whole: per engine step the bytes it writes, in order."""

    steps: list[bytes]
    stream: bool
    status: int = 200


def render(endpoint: str, body: bytes, model: str, request_id: str, seed: int = 0) -> Answer:
    """The answer vLLM 0.32 gives ``body`` on ``endpoint``, cut into its engine steps.

    A stream's steps hold the chunks each step writes (the role chunks go with the first
    token, as vLLM sends them once the first token is out); a whole answer has one step, its
    body, written after ``max_tokens`` steps. A request vLLM refuses is its error body.
    """
    chat = endpoint == CHAT
    try:
        gen = (parse_chat if chat else parse_completion)(parse_json(body), model, MAX_MODEL_LEN)
    except ApiError as err:
        return Answer([err.body()], False, err.status)
    fmt = (ChatFormatter if chat else CompletionFormatter)(
        request_id, int(time.time()), model, FINGERPRINT
    )
    rng = random.Random(seed)
    choices = len(gen.prompts) * gen.n
    prompts = [len(gen.prompts[i // gen.n]) for i in range(choices)]
    tokens = gen.max_tokens
    texts = [[next_text(rng) for _ in range(tokens)] for _ in range(choices)]
    if not gen.stream:
        full = fmt.full(
            ["".join(t) for t in texts], ["length"] * choices, gen.prompt_tokens, tokens * choices
        )
        return Answer([b""] * (tokens - 1) + [full], False)
    return Answer(_stream_steps(gen, fmt, prompts, texts), True)


def _stream_steps(
    gen: Generation,
    fmt: ChatFormatter | CompletionFormatter,
    prompts: list[int],
    texts: list[list[str]],
) -> list[bytes]:
    """The bytes of each step of a stream, as ``simulator.replica`` writes them."""
    steps = []
    tokens = len(texts[0])
    for k in range(tokens):
        parts: list[bytes] = []
        if k == 0 and isinstance(fmt, ChatFormatter):
            parts += [
                fmt.role_chunk(i, (p, 0) if gen.continuous_usage else None)
                for i, p in enumerate(prompts)
            ]
        last = k == tokens - 1
        for i, p in enumerate(prompts):
            usage = (p, k + 1) if gen.continuous_usage else None
            final = last and i == len(prompts) - 1 and not gen.include_usage
            parts.append(fmt.token_chunk(i, texts[i][k], "length" if last else None, usage, final))
        if last:
            if gen.include_usage:
                parts.append(fmt.usage_chunk(gen.prompt_tokens, tokens * len(prompts)))
            parts.append(fmt.done())
        steps.append(b"".join(parts))
    return steps


@dataclass(eq=False)
class _Running:
    """A request being answered: its connection and the steps still to write."""

    conn: _Connection
    answer: Answer
    step: int = 0


class _Connection(asyncio.Protocol):
    """One client connection: requests one at a time (keep-alive)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.running: _Running | None = None
        # False when the request being answered asked for ``connection: close``.
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        # vLLM aborts a request whose client closed the connection.
        if self.running is not None:
            self.upstream.running.discard(self.running)
            self.running = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = httptools.parse_url(self.url).path.decode()
        body = b"".join(self.body)
        self.url, self.body = b"", []
        self.keep_alive = self.parser.should_keep_alive()
        self.upstream.answer(self, method, path, body)

    def write(self, data: bytes, last: bool = True) -> None:
        """Write ``data``; after the ``last`` bytes of an answer, close as uvicorn does when the
        request asked for it."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            if last and not self.keep_alive:
                self.transport.close()


@dataclass
class Upstream:
    """The server: one engine step timer for every running request."""

    model: str
    step_seconds: float
    running: set[_Running] = field(default_factory=set)
    _ids: random.Random = field(default_factory=lambda: random.Random(7))
    _timer: asyncio.TimerHandle | None = None
    _cache: dict[tuple[str, bytes], Answer] = field(default_factory=dict)

    def answer(self, conn: _Connection, method: bytes, path: str, body: bytes) -> None:
        """Answer one request: at once for the small routes, by steps for a generation."""
        if path in (CHAT, COMPLETIONS) and method == b"POST":
            self._generate(conn, path, body)
        elif path in ("/health", "/ping"):
            conn.write(_whole(200, b"", b"application/json"))
        elif path == "/v1/models":
            models = {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model}
                ],
            }
            conn.write(_whole(200, orjson.dumps(models), b"application/json"))
        elif path == "/metrics":
            conn.write(_whole(200, b"", b"text/plain; version=0.0.4; charset=utf-8"))
        else:
            conn.write(_whole(404, b'{"detail":"Not Found"}', b"application/json"))

    def _generate(self, conn: _Connection, path: str, body: bytes) -> None:
        prefix = "chatcmpl" if path == CHAT else "cmpl"
        request_id = f"{prefix}-{self._ids.getrandbits(64):016x}"
        # Rendered once per distinct request (the id aside): a benchmark repeats a few.
        template = self._cache.get((path, body))
        if template is None:
            template = render(path, body, self.model, f"{prefix}-{0:016x}")
            self._cache[(path, body)] = template
        placeholder = f"{prefix}-{0:016x}".encode()
        answer = Answer(
            [s.replace(placeholder, request_id.encode()) for s in template.steps],
            template.stream,
            template.status,
        )
        if answer.status != 200:
            conn.write(_whole(answer.status, answer.steps[0], b"application/json"))
            return
        if answer.stream:
            conn.write(_SSE_HEAD + _date() + b"\r\n", last=False)
        running = _Running(conn, answer)
        conn.running = running
        if self.step_seconds <= 0:
            while conn.running is running:
                self._advance(running)
            return
        self.running.add(running)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.step_seconds, self._step)

    def _step(self) -> None:
        """One engine step: every running request writes its next step."""
        for running in list(self.running):
            self._advance(running)
        self._timer = None
        if self.running:
            self._timer = asyncio.get_running_loop().call_later(self.step_seconds, self._step)

    def _advance(self, running: _Running) -> None:
        answer, conn = running.answer, running.conn
        data = answer.steps[running.step]
        running.step += 1
        done = running.step == len(answer.steps)
        if answer.stream:
            conn.write(
                b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
                if done
                else b"%x\r\n%b\r\n" % (len(data), data),
                last=done,
            )
        elif done:
            conn.write(_whole(200, data, b"application/json"))
        if done:
            self.running.discard(running)
            conn.running = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _date() -> bytes:
    return b"date: %s\r\n" % time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()).encode()


def _whole(status: int, body: bytes, kind: bytes) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"Error")
    return (
        b"HTTP/1.1 %d %s\r\nserver: uvicorn\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
        % (status, reason, kind, len(body), _date(), body)
    )


async def serve(
    host: str,
    port: int,
    model: str,
    step_seconds: float,
    ready: Callable[[Upstream], Any] | None = None,
) -> None:
    """Serve until cancelled (or SIGTERM / SIGINT); ``ready`` gets the server once it listens."""
    loop = asyncio.get_running_loop()
    upstream = Upstream(model, step_seconds)
    server = await loop.create_server(lambda: _Connection(upstream), host, port, backlog=4096)
    stop: asyncio.Future[None] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _resolve, stop)
    if ready is not None:
        ready(upstream)
    try:
        await stop
    finally:
        server.close()


def main() -> None:
    """Run the upstream on uvloop."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--step-ms", type=float, default=1.0, help="engine step (0: no pacing)")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port, args.model, args.step_ms / 1000))


if __name__ == "__main__":
    main()
