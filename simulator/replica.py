"""One simulated vLLM replica: the engine loop plus its OpenAI-compatible HTTP face.

The HTTP layer is plain ASGI rather than a framework because a replica must stream thousands of
chunks a second on one core and never be the bottleneck of a benchmark of what sits in front of
it. One asyncio task runs the engine loop (``simulator.engine.Scheduler``); request handlers only
wait for their sequences' tokens and write them out, so a slow client never slows the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import generate_latest

from infermeter.asgi import Receive, Scope, Send, header, read_body, respond as _send_whole
from infermeter.config import Config, EngineProfile, GpuProfile
from simulator.engine import Scheduler, Sequence
from simulator.gpu import GpuMeter
from simulator.protocol import (
    ApiError,
    ChatFormatter,
    CompletionFormatter,
    Generation,
    StopHit,
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    find_stop,
    parse_chat,
    parse_completion,
    parse_json,
    prompt_logprobs,
    token_id,
)
from simulator.text import VOCAB, prefix_block_hashes, request_rng
from simulator.truth import TruthWriter
from simulator.vllm_metrics import VllmMetrics

__all__ = ["ReplicaSim", "ReplicaSpec", "replica_spec"]


VLLM_VERSION = "0.32.0"
MAX_BODY_BYTES = 32 * 1024 * 1024
_VARY = (b"vary", b"Origin")
_JSON = [(b"content-type", b"application/json"), _VARY]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), _VARY]
_METRICS = [(b"content-type", b"text/plain; version=1.0.0; charset=utf-8"), _VARY]
EMPTY_TEXT_SHARE = 0.02


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """Send a whole response with its ``content-length``, as vLLM's (uvicorn's) do.

    Without it uvicorn sends the body chunked, and a client's or the sidecar's handling of a
    sized body (a length checked before reading, a connection reused after it) would only ever
    meet real vLLM.
    """
    # Where Starlette's responses put it: after ``allow``, before the type and ``vary``.
    at = next((i for i, (name, _) in enumerate(headers) if name != b"allow"), len(headers))
    sized = [*headers[:at], (b"content-length", b"%d" % len(body)), *headers[at:]]
    await _send_whole(send, status, body, sized)


def next_text(rng: random.Random) -> str:
    """The text of the next sampled token.

    A byte-level BPE token can end inside a UTF-8 character, and vLLM then streams a chunk with
    empty text; a small share of empty tokens keeps clients from counting tokens by chunks.
    """
    if rng.random() < EMPTY_TEXT_SHARE:
        return ""
    return VOCAB[rng.randrange(len(VOCAB))]


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything one simulated replica needs to know, cut out of the configuration."""

    replica_id: str
    served_model: str
    max_model_len: int
    engine: EngineProfile
    gpu: GpuProfile
    gpu_count: int
    seed: int
    instance_id: str = ""  # an instance of the replica group; "" is the fixed replica itself

    @property
    def instance(self) -> str:
        """The instance id this process serves as."""
        return self.instance_id or self.replica_id


def replica_spec(config: Config, replica_id: str, instance: str | None = None) -> ReplicaSpec:
    """Build the spec of ``replica_id`` (or of its ``instance``) from the fleet configuration.

    An instance draws its own random stream, so instances of a group do not answer alike.
    """
    replica = config.replica(replica_id)
    model = config.model(replica.model)
    gpu = config.simulator.gpus.get(replica.gpu_model) or GpuProfile(
        idle_watts=60, max_watts=400, memory_mib=81920, product_name=f"NVIDIA {replica.gpu_model}"
    )
    return ReplicaSpec(
        replica_id=replica.id,
        served_model=replica.served_version or model.current_version,
        max_model_len=model.max_model_len,
        engine=_engine(config, replica.model, replica.max_num_seqs),
        gpu=gpu,
        gpu_count=replica.gpu_count,
        seed=config.simulator.seed + sum(map(ord, instance or replica.id)),
        instance_id=instance or "",
    )


def _engine(config: Config, model: str, max_num_seqs: int | None) -> EngineProfile:
    profile = config.simulator.engine_for(model)
    if max_num_seqs is not None:
        profile = profile.model_copy(update={"max_num_seqs": max_num_seqs})
    return profile


def _f32(value: float) -> float:
    """``value`` as the engine computes it, in float32: vLLM's log-probabilities reach JSON as
    float32 widened to double (-7.666160583496094, not -7.666)."""
    widened: float = struct.unpack("f", struct.pack("f", value))[0]
    return widened


def draw_logprob(rng: random.Random, token: str, others: int) -> TokenLogprob:
    """A token's log-probability and ``others`` alternatives (distinct tokens of the vocabulary,
    likeliest first), drawn from ``rng``, a generator of the log-probabilities alone: asking for
    them changes no text."""
    logprob = _f32(-0.002 - rng.expovariate(0.5))
    alternatives: list[str] = []
    while len(alternatives) < others:
        candidate = VOCAB[rng.randrange(len(VOCAB))]
        if candidate != token and candidate not in alternatives:
            alternatives.append(candidate)
    values = sorted((_f32(-0.002 - rng.expovariate(0.8)) for _ in alternatives), reverse=True)
    return TokenLogprob(token, logprob, ((token, logprob), *zip(alternatives, values, strict=True)))


def _alternatives(gen: Generation, chat: bool) -> int:
    """Alternatives to draw per token: chat's ``top_logprobs`` lists the token itself first and
    counts it, the completions' ``logprobs`` does not."""
    if gen.logprobs is None:
        return 0
    return max(gen.logprobs - 1, 0) if chat else gen.logprobs


@dataclass(eq=False)
class _Planned:
    """A sequence of a request with stop strings: its token texts are drawn when it arrives, so
    the engine can end it at the token that completes a stop string."""

    texts: list[str]
    hit: StopHit | None
    text: str = ""  # the text of the tokens emitted so far
    sent: int = 0  # how much of it has been streamed

    def token(self, token: int) -> str:
        """The ``token``-th token's own text ("" for the end of sequence after the last)."""
        return self.texts[token - 1] if token <= len(self.texts) else ""

    @property
    def final_text(self) -> str:
        """The choice's whole text: cut at the stop string when one was met."""
        return self.hit.text if self.hit is not None else "".join(self.texts)

    def delta(self, token: int, last: bool, held_back: int) -> str:
        """The text streamed with the ``token``-th token: as vLLM, the last ``held_back``
        characters wait until no stop string can begin in them, and the end is cut at it."""
        if token <= len(self.texts):
            self.text += self.texts[token - 1]
        shown = self.final_text if last else self.text[: max(0, len(self.text) - held_back)]
        delta = shown[self.sent :]
        self.sent = max(self.sent, len(shown))
        return delta


@dataclass(eq=False)
class _Request:
    gen: Generation
    seqs: list[Sequence]
    rngs: list[random.Random]
    arrived_at: float
    plans: list[_Planned | None] = field(default_factory=list)
    # Per sequence, the generator of its log-probabilities, when they were asked for.
    logprob_rngs: list[random.Random] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: bool = False


class ReplicaSim:
    """The engine loop, meters and metrics of one replica, and its ASGI app."""

    def __init__(
        self,
        spec: ReplicaSpec,
        clock: Callable[[], float] = time.monotonic,
        truth: TruthWriter | None = None,
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.truth = truth
        self.scheduler = Scheduler(spec.engine)
        self.metrics = VllmMetrics(spec.served_model, spec.engine)
        now = clock()
        self.born = now
        self.meters = [GpuMeter(spec.gpu, now) for _ in range(spec.gpu_count)]
        self.finished_requests = 0
        self._ids = random.Random(spec.seed)
        self.fingerprint = f"vllm-{VLLM_VERSION}-{self._ids.getrandbits(32):08x}"
        self._wake = asyncio.Event()
        self._owners: dict[Sequence, _Request] = {}
        self._exported = {"prompt": 0, "gen": 0, "queries": 0, "hits": 0, "preempt": 0}
        self._task: asyncio.Task[None] | None = None
        self.started_at = time.time()
        # The engine keeps its own clock; the truth log speaks wall time.
        self._wall_offset = self.started_at - now

    # -- engine loop ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._truth_instance("start")

    async def stop(self) -> None:
        """Stop the engine loop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._truth_instance("stop")

    def _truth_instance(self, event: str) -> None:
        if self.truth is not None:
            self.truth.write(
                "instance",
                {
                    "event": event,
                    "instance": self.spec.instance,
                    "replica": self.spec.replica_id,
                    "model": self.spec.served_model,
                    "gpu_count": self.spec.gpu_count,
                    "t": time.time(),
                    "pid": os.getpid(),
                },
            )

    def _truth_request(
        self, req: _Request, path: str, request_id: str, given_id: str | None
    ) -> None:
        """What the engine did for ``req``, once it ended (the ground-truth log)."""
        assert self.truth is not None
        wall = self._wall_offset
        seqs = req.seqs
        firsts = [s.first_token_at for s in seqs if s.first_token_at is not None]
        ends = [s.finished_at for s in seqs if s.finished_at is not None]
        self.truth.write(
            "request",
            {
                "instance": self.spec.instance,
                "replica": self.spec.replica_id,
                "request_id": given_id,
                "response_id": request_id,
                "endpoint": path,
                "stream": req.gen.stream,
                "n": req.gen.n,
                "arrived": req.arrived_at + wall,
                "first_token": min(firsts) + wall if firsts else None,
                "ended": (max(ends) if ends else self.clock()) + wall,
                "prompt_tokens": [
                    s.prompt_tokens if s.admitted_at is not None else 0 for s in seqs
                ],
                "cached_tokens": [
                    s.cached_tokens if s.admitted_at is not None else 0 for s in seqs
                ],
                "completion_tokens": [s.generated for s in seqs],
                "aborted": any(s.finish_reason == "abort" for s in seqs),
            },
        )

    async def _run(self) -> None:
        while True:
            start = self.clock()
            step = self.scheduler.plan(start)
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep to the step's planned end, not for its duration, so the loop's own overhead
            # does not slow the simulated GPU down.
            end = start + step.duration
            await asyncio.sleep(max(0.0, end - self.clock()))
            for meter in self.meters:
                meter.busy(start, end, step.load)
            batch_tokens = step.prefill_tokens + len(step.decode)
            self.metrics["iteration_tokens_total"].observe(batch_tokens)
            for seq in self.scheduler.commit(step, end):
                owner = self._owners.get(seq)
                if owner is not None:
                    owner.ready.set()
                    if seq.done:
                        del self._owners[seq]
                        self._observe_finished(owner, seq)

    def submit(self, gen: Generation) -> _Request:
        """Queue a validated request's sequences (one per prompt and choice)."""
        now = self.clock()
        seqs: list[Sequence] = []
        rngs: list[random.Random] = []
        plans: list[_Planned | None] = []
        mean = self.spec.engine.mean_output_tokens
        for p_index, prompt in enumerate(gen.prompts):
            blocks = prefix_block_hashes(prompt, self.spec.engine.block_size)
            for choice in range(gen.n):
                rng = request_rng(self.spec.seed, gen.prompt_text, gen.seed, p_index, choice)
                stop_after = (
                    gen.max_tokens if gen.ignore_eos else int(rng.expovariate(1 / mean)) + 1
                )
                plan = None
                if gen.stop:
                    # Every token has a text but the end of sequence that stops short.
                    count = gen.max_tokens if stop_after >= gen.max_tokens else stop_after - 1
                    texts = [next_text(rng) for _ in range(count)]
                    hit = find_stop(texts, gen.stop, gen.include_stop, gen.min_tokens)
                    if hit is not None:
                        stop_after = hit.token
                        texts = texts[: hit.token]
                    plan = _Planned(texts, hit)
                plans.append(plan)
                seq = Sequence(
                    seq_id=f"{p_index}-{choice}",
                    prompt_tokens=len(prompt),
                    max_tokens=gen.max_tokens,
                    stop_after=stop_after,
                    prefix_blocks=blocks,
                    arrived_at=now,
                )
                seqs.append(seq)
                rngs.append(rng)
        req = _Request(gen, seqs, rngs, now, plans)
        if gen.logprobs is not None:
            req.logprob_rngs = [
                request_rng(self.spec.seed, "logprobs", gen.prompt_text, gen.seed, i // gen.n, i)
                for i in range(len(seqs))
            ]
        for seq in seqs:
            self._owners[seq] = req
            self.scheduler.add(seq)
        self._wake.set()
        return req

    def abort(self, req: _Request) -> None:
        """Abort every sequence of a request whose client went away."""
        now = self.clock()
        for seq in req.seqs:
            self.scheduler.abort(seq, now)
            self._owners.pop(seq, None)

    def _observe_finished(self, req: _Request, seq: Sequence) -> None:
        m = self.metrics
        self.finished_requests += 1
        assert seq.finished_at is not None
        assert seq.first_token_at is not None
        admitted = seq.admitted_at if seq.admitted_at is not None else seq.arrived_at
        m[f"request_success:{seq.finish_reason}"].inc()
        m["time_to_first_token_seconds"].observe(seq.first_token_at - seq.arrived_at)
        itl = m["inter_token_latency_seconds"]
        for gap in seq.itl:
            itl.observe(gap)
        decode = seq.finished_at - seq.first_token_at
        m["e2e_request_latency_seconds"].observe(seq.finished_at - seq.arrived_at)
        m["request_queue_time_seconds"].observe(admitted - seq.arrived_at)
        m["request_inference_time_seconds"].observe(seq.finished_at - admitted)
        m["request_prefill_time_seconds"].observe(seq.first_token_at - admitted)
        m["request_decode_time_seconds"].observe(decode)
        if seq.generated > 1:
            m["request_time_per_output_token_seconds"].observe(decode / (seq.generated - 1))
        m["request_prompt_tokens"].observe(seq.prompt_tokens)
        m["request_generation_tokens"].observe(seq.generated)
        m["request_max_num_generation_tokens"].observe(seq.max_tokens)
        m["request_params_max_tokens"].observe(seq.max_tokens)
        m["request_params_n"].observe(req.gen.n)
        m["request_num_preemptions"].observe(seq.preemptions)
        m["request_prefill_kv_computed_tokens"].observe(seq.prompt_tokens - seq.cached_tokens)

    # -- metrics and GPU readings -----------------------------------------------------------------

    def render_metrics(self) -> bytes:
        """The /metrics exposition, with gauges and counters brought up to date first."""
        s, m, c, seen = self.scheduler, self.metrics, self.scheduler.counters, self._exported
        m["num_requests_running"].set(len(s.running))
        m["num_requests_waiting"].set(len(s.waiting))
        m["num_requests_waiting_by_reason:capacity"].set(len(s.waiting))
        m["kv_cache_usage_perc"].set(s.kv_usage())
        for key, total, names in (
            ("prompt", c.prompt_tokens, ("prompt_tokens",)),
            ("gen", c.generation_tokens, ("generation_tokens",)),
            ("queries", c.prefix_cache_queries, ("prefix_cache_queries",)),
            (
                "hits",
                c.prefix_cache_hits,
                (
                    "prefix_cache_hits",
                    "prompt_tokens_cached",
                    "prompt_tokens_by_source:local_cache_hit",
                    "prompt_tokens_cached_by_source:device",
                ),
            ),
            ("preempt", c.preemptions, ("num_preemptions",)),
        ):
            if total > seen[key]:
                for name in names:
                    m[name].inc(total - seen[key])
                seen[key] = total
        computed = c.prompt_tokens - c.prefix_cache_hits
        source = m["prompt_tokens_by_source:local_compute"]
        source.inc(max(0, computed - source._value.get()))
        return generate_latest(m.registry)

    def gpu_readings(self) -> list[dict[str, float]]:
        """Each GPU's readings now, for the dcgm-exporter stand-in."""
        now = self.clock()
        out = []
        for index, meter in enumerate(self.meters):
            r = meter.read(now)
            out.append(
                {
                    "index": index,
                    "utilization_pct": r.utilization_pct,
                    "power_watts": r.power_watts,
                    "energy_joules": r.energy_joules,
                    "busy_seconds": r.busy_seconds,
                    "memory_used_mib": r.memory_used_mib,
                    "memory_free_mib": r.memory_free_mib,
                    "running": len(self.scheduler.running),
                }
            )
        return out

    def usage(self) -> dict[str, object]:
        """What this process served and drew since it started, for comparison with billing.

        GPU-seconds seen are its GPUs' wall time since start; busy are the seconds a step ran.
        """
        now = self.clock()
        c = self.scheduler.counters
        return {
            "instance": self.spec.instance,
            "replica": self.spec.replica_id,
            "gpu_count": self.spec.gpu_count,
            "gpu_seconds_seen": self.spec.gpu_count * (now - self.born),
            "gpu_seconds_busy": sum(m.read(now).busy_seconds for m in self.meters),
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
            "finished_sequences": self.finished_requests,
        }

    # -- HTTP ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                await respond(
                    send, 405, b'{"detail":"Method Not Allowed"}', [(b"allow", b"POST"), *_JSON]
                )
                return
            await self._generate(path, header(scope, b"x-request-id"), receive, send)
        elif method == "GET" and path == "/metrics":
            await respond(send, 200, self.render_metrics(), _METRICS)
        elif method == "GET" and path == "/health":
            await respond(send, 200, b"", [_VARY])
        elif method == "GET" and path == "/v1/models":
            await respond(send, 200, self._models_body(), _JSON)
        elif method == "GET" and path == "/version":
            await respond(send, 200, orjson.dumps({"version": VLLM_VERSION}), _JSON)
        elif method == "GET" and path == "/_sim/gpus":
            await respond(send, 200, orjson.dumps(self.gpu_readings()), _JSON)
        elif method == "GET" and path == "/_sim/usage":
            await respond(send, 200, orjson.dumps(self.usage()), _JSON)
        else:
            await respond(send, 404, b'{"detail":"Not Found"}', _JSON)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _models_body(self) -> bytes:
        created = int(time.time())
        perm_id = f"modelperm-{self._ids.getrandbits(64):016x}"
        return orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.spec.served_model,
                        "object": "model",
                        "created": created,
                        "owned_by": "vllm",
                        "root": f"/models/{self.spec.served_model}",
                        "parent": None,
                        "max_model_len": self.spec.max_model_len,
                        "permission": [
                            {
                                "id": perm_id,
                                "object": "model_permission",
                                "created": created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def _generate(
        self, path: str, given_id: str | None, receive: Receive, send: Send
    ) -> None:
        chat = path == "/v1/chat/completions"
        try:
            raw = await read_body(receive, MAX_BODY_BYTES)
            if raw is None:
                raise ApiError(413, "Request body too large.", "Bad Request", None)
            data = parse_json(raw)
            parse = parse_chat if chat else parse_completion
            gen = parse(data, self.spec.served_model, self.spec.max_model_len)
        except ApiError as err:
            await respond(send, err.status, err.body(), _JSON)
            return
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{given_id or f'{self._ids.getrandbits(64):016x}'}"
        fmt_cls = ChatFormatter if chat else CompletionFormatter
        fmt = fmt_cls(request_id, int(time.time()), self.spec.served_model, self.fingerprint)
        req = self.submit(gen)
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(req, receive))
        try:
            if gen.stream:
                await self._stream(req, fmt, send)
            else:
                await self._complete(req, fmt, send)
        finally:
            watcher.cancel()
            if any(not s.done for s in req.seqs):
                self.abort(req)
            if self.truth is not None:
                self._truth_request(req, path, request_id, given_id)

    async def _watch_disconnect(self, req: _Request, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                req.disconnected = True
                self.abort(req)
                req.ready.set()
                return

    async def _stream(
        self, req: _Request, fmt: ChatFormatter | CompletionFormatter, send: Send
    ) -> None:
        gen = req.gen
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        chat = isinstance(fmt, ChatFormatter)
        prompt = gen.prompt_tokens
        choice_prompt = [len(gen.prompts[i // gen.n]) for i in range(len(req.seqs))]
        emitted = [0] * len(req.seqs)
        asked, others = gen.logprobs, _alternatives(gen, chat)
        echoed = [self._echo(req, i, others) for i in range(len(req.seqs))]
        # Where each choice's next token starts in its text (the completions' text_offset).
        offsets = [0] * len(req.seqs)
        started = False
        while True:
            await req.ready.wait()
            req.ready.clear()
            if req.disconnected:
                return
            parts: list[bytes] = []
            if chat and not started and any(s.generated for s in req.seqs):
                started = True
                parts.extend(
                    fmt.role_chunk(i, (choice_prompt[i], 0) if gen.continuous_usage else None)  # type: ignore[union-attr]
                    for i in range(len(req.seqs))
                )
            for i, seq in enumerate(req.seqs):
                rng, plan = req.rngs[i], req.plans[i]
                while emitted[i] < seq.generated:
                    emitted[i] += 1
                    last = seq.done and emitted[i] == seq.generated
                    finish = seq.finish_reason if last else None
                    reason = None
                    if plan is None:
                        token = text = "" if finish == "stop" else next_text(rng)
                    else:
                        token = plan.token(emitted[i])
                        text = plan.delta(emitted[i], last, gen.held_back)
                        if last and plan.hit is not None:
                            finish, reason = "stop", plan.hit.stop
                    logprobs, prompt_ids = b"null", b"null"
                    entries: list[TokenLogprob] = []
                    if emitted[i] == 1 and gen.echo:
                        # vLLM sends the prompt, its ids and its tokens with the first token.
                        text = "".join(gen.prompts[i // gen.n]) + text
                        prompt_ids = orjson.dumps([token_id(t) for t in gen.prompts[i // gen.n]])
                        entries = echoed[i]
                    if asked is not None:
                        entries = [*entries, draw_logprob(req.logprob_rngs[i], token, others)]
                        if chat:
                            logprobs = orjson.dumps(chat_logprobs(entries, asked))
                        else:
                            logprobs = orjson.dumps(completion_logprobs(entries, offsets[i]))
                            offsets[i] += sum(len(e.token) for e in entries)
                    # As vLLM: a chunk's running usage is its own choice's completion tokens
                    # and its own prompt's tokens (serving_chat/serving_completion).
                    usage = (choice_prompt[i], emitted[i]) if gen.continuous_usage else None
                    # Without a usage chunk to end the stream, vLLM stamps its fingerprint on
                    # every finish chunk, each choice's.
                    stamp = finish is not None and not gen.include_usage
                    if isinstance(fmt, ChatFormatter):
                        chunk = fmt.token_chunk(i, text, finish, usage, stamp, reason, logprobs)
                    else:
                        chunk = fmt.token_chunk(
                            i, text, finish, usage, stamp, reason, logprobs, prompt_ids
                        )
                    parts.append(chunk)
            done = all(s.done for s in req.seqs)
            if done:
                if gen.include_usage:
                    parts.append(fmt.usage_chunk(prompt, sum(s.generated for s in req.seqs)))
                parts.append(fmt.done())
            if parts:
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": not done}
                )
            if done:
                return

    async def _complete(
        self, req: _Request, fmt: ChatFormatter | CompletionFormatter, send: Send
    ) -> None:
        while not all(s.done for s in req.seqs):
            await req.ready.wait()
            req.ready.clear()
            if req.disconnected:
                return
        gen = req.gen
        chat = isinstance(fmt, ChatFormatter)
        asked, others = gen.logprobs, _alternatives(gen, chat)
        texts, finishes, reasons = [], [], []
        logprobs: list[Any] = []
        prompts: list[Any] = []
        for i, (seq, rng, plan) in enumerate(zip(req.seqs, req.rngs, req.plans, strict=True)):
            finish, reason = seq.finish_reason or "length", None
            if plan is None:
                drawn = seq.generated - (seq.finish_reason == "stop")
                tokens = [next_text(rng) for _ in range(drawn)]
                text = "".join(tokens)
            else:
                tokens = [plan.token(t) for t in range(1, seq.generated + 1)]
                text = plan.final_text
                if plan.hit is not None:
                    finish, reason = "stop", plan.hit.stop
            # (The end of sequence has no text, but a log-probability.)
            tokens += [""] * (seq.generated - len(tokens))
            echoed = self._echo(req, i, others)
            texts.append("".join(gen.prompts[i // gen.n]) + text if gen.echo else text)
            finishes.append(finish)
            reasons.append(reason)
            if asked is not None:
                entries = echoed + [draw_logprob(req.logprob_rngs[i], t, others) for t in tokens]
                if chat:
                    logprobs.append(chat_logprobs(entries, asked))
                else:
                    logprobs.append(completion_logprobs(entries, 0))
                    prompts.append(prompt_logprobs(echoed) if gen.echo else None)
        completion = sum(s.generated for s in req.seqs)
        if isinstance(fmt, ChatFormatter):
            body = fmt.full(
                texts, finishes, gen.prompt_tokens, completion, reasons, logprobs or None
            )
        else:
            body = fmt.full(
                texts,
                finishes,
                gen.prompt_tokens,
                completion,
                reasons,
                logprobs or None,
                prompts if any(p is not None for p in prompts) else None,
            )
        await respond(send, 200, body, _JSON)

    @staticmethod
    def _echo(req: _Request, index: int, others: int) -> list[TokenLogprob]:
        """The log-probabilities of the prompt a choice echoes, drawn before its tokens' (none
        without echo or log-probabilities): nothing predicts the first prompt token."""
        gen = req.gen
        if not gen.echo or gen.logprobs is None:
            return []
        rng = req.logprob_rngs[index]
        first, *rest = gen.prompts[index // gen.n]
        return [TokenLogprob(first, None), *(draw_logprob(rng, t, others) for t in rest)]
