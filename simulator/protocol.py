"""vLLM 0.32's OpenAI-compatible wire format: request validation and response bytes.

Everything here is pure: parse a body into a ``Generation`` or raise ``ApiError``; turn tokens
into the exact bytes vLLM sends. Key order, ``null`` fields and the SSE framing follow captures
of real vLLM 0.32 (see tests/fixtures), because clients and proxies in front of vLLM parse these
bytes and the simulator must not be easier to parse than the real thing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from simulator.text import chat_prompt_text, tokenize

__all__ = [
    "ApiError",
    "ChatFormatter",
    "CompletionFormatter",
    "Generation",
    "StopHit",
    "TokenLogprob",
    "chat_logprobs",
    "completion_logprobs",
    "find_stop",
    "parse_chat",
    "parse_completion",
    "prompt_logprobs",
    "token_id",
]

Endpoint = Literal["chat", "completion"]


class ApiError(Exception):
    """An error vLLM answers with a JSON body instead of a completion."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> bytes:
        """The error JSON exactly as vLLM writes it."""
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.err_type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


class StreamOptions(BaseModel):
    """``stream_options`` as vLLM accepts it: usage only when asked for, other keys ignored."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    priority: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False


class ChatRequest(_Common):
    """The fields of /v1/chat/completions that change what the simulator does."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0


class CompletionRequest(_Common):
    """The fields of /v1/completions that change what the simulator does."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None


@dataclass(frozen=True)
class Generation:
    """A validated request: what to generate, for how many choices, and how to stream it."""

    endpoint: Endpoint
    prompts: tuple[tuple[str, ...], ...]
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    seed: int | None
    prompt_text: str
    priority: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    min_tokens: int = 0
    # Log-probabilities asked for: the alternatives per token (chat's ``top_logprobs``, the
    # completions' ``logprobs``), None when not asked.
    logprobs: int | None = None
    # /v1/completions' ``echo``: each choice's text begins with its prompt.
    echo: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens summed over every prompt, as ``usage.prompt_tokens`` reports them."""
        return sum(len(p) for p in self.prompts)

    @property
    def held_back(self) -> int:
        """Characters vLLM keeps back from each streamed delta while a stop string could still
        begin in them (none when the stop string is sent too)."""
        if not self.stop or self.include_stop:
            return 0
        return max(len(s) for s in self.stop) - 1


@dataclass(frozen=True)
class StopHit:
    """Where a stop string ended a sequence: its token, the string, and the text kept."""

    token: int  # 1-based: the token whose text completed the stop string
    stop: str
    text: str


def find_stop(
    texts: list[str], stops: tuple[str, ...], include: bool, min_tokens: int = 0
) -> StopHit | None:
    """The first token after which one of ``stops`` appears in the text, as vLLM checks it.

    vLLM (``check_stop_strings``) looks in the newly added text and the stop string's length
    before it, only past the first ``min_tokens`` tokens, takes the stop string that ends first
    (ties in the order given), and cuts the text before it (after it with
    ``include_stop_str_in_output``).
    """
    text = ""
    floor = 0  # where the text of the tokens after min_tokens begins
    for k, piece in enumerate(texts, start=1):
        text += piece
        if k <= min_tokens:
            floor = len(text)
            continue
        if not piece:
            continue
        found: tuple[int, int, str] | None = None
        for stop in stops:
            at = text.find(stop, max(floor, len(text) - len(piece) - len(stop) + 1))
            if at != -1 and (found is None or at + len(stop) < found[0]):
                found = (at + len(stop), at, stop)
        if found is not None:
            end, at, stop = found
            return StopHit(k, stop, text[:end] if include else text[:at])
    return None


def _validation_message(exc: ValidationError) -> tuple[str, str]:
    """vLLM's wording of a request validation error: message and ``param``."""
    errors = exc.errors(include_url=False)
    lines = []
    for err in errors:
        loc = ".".join(["body", *(str(p) for p in err["loc"])])
        item: dict[str, Any] = {"type": err["type"], "loc": loc, "msg": err["msg"]}
        value = err.get("input")
        if isinstance(value, dict):
            value = f"<dict of {len(value)} items>"
        elif isinstance(value, list):
            value = f"<list of {len(value)} items>"
        item["input"] = value
        if "ctx" in err:
            item["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
        lines.append(f"  {item!r}")
    noun = "validation error" if len(errors) == 1 else "validation errors"
    first = ".".join(["body", *(str(p) for p in errors[0]["loc"])])
    return f"{len(errors)} {noun}:\n" + "\n".join(lines), first


def _bad_request(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "Bad Request", param)


def parse_json(body: bytes) -> Any:
    """Decode a request body, with vLLM's error for invalid JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:  # the standard library words the reason the way vLLM (pydantic) reports it
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        reason = getattr(exc, "msg", str(exc))
        item = {
            "type": "json_invalid",
            "loc": f"body.{pos}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": reason},
        }
        raise _bad_request(f"1 validation error:\n  {item!r}", f"body.{pos}") from None


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"The model `{requested}` does not exist. Valid aliases: {served}.",
            "NotFoundError",
            "model",
        )


def _check_max_tokens(max_tokens: int | None, max_model_len: int, name: str = "max_tokens") -> None:
    """vLLM refuses a max_tokens (or max_completion_tokens, named as sent) over the context."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise _invalid(
            f"{name}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens.",
            name,
            max_tokens,
        )


def _check_lengths(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """vLLM's length rules: a prompt that fills the context is an error, and a max_tokens that
    only overflows together with the prompt is silently capped."""
    if prompt_tokens >= max_model_len:
        # vLLM tokenizes with truncation at max_model_len + 1, so it reports "at least" that.
        value = min(prompt_tokens, max_model_len + 1)
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains at least {value} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={value})",
            "BadRequestError",
            "input_tokens",
        )
    room = max_model_len - prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


def _invalid(message: str, param: str | None = None, value: object = None) -> ApiError:
    """vLLM's ``VLLMValidationError`` answer: the parameter and its value end the message when
    the check names them, and then ``param`` is set too."""
    if param is not None:
        shown = f"{param}" if value is None else f"{param}, value={value}"
        message = f"{message} (parameter={shown})"
    return ApiError(400, message, "BadRequestError", param)


# vLLM's VLLM_MAX_N_SEQUENCES default.
MAX_N_SEQUENCES = 16384


def _check_sampling(req: _Common, max_tokens: int) -> None:
    """``SamplingParams._verify_args`` of vLLM 0.32, in its order and words."""
    n = req.n
    if n < 1:
        raise _invalid(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise _invalid(
            f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    presence = req.presence_penalty if req.presence_penalty is not None else 0.0
    if not -2.0 <= presence <= 2.0:
        raise _invalid(f"presence_penalty must be in [-2, 2], got {presence}.")
    frequency = req.frequency_penalty if req.frequency_penalty is not None else 0.0
    if not -2.0 <= frequency <= 2.0:
        raise _invalid(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    repetition = req.repetition_penalty if req.repetition_penalty is not None else 1.0
    if repetition <= 0.0:
        raise _invalid(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = req.temperature if req.temperature is not None else 1.0
    if temperature < 0.0:
        raise _invalid(
            f"temperature must be non-negative, got {temperature}.", "temperature", temperature
        )
    if temperature > 2.0:
        raise _invalid(
            f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature
        )
    top_p = req.top_p if req.top_p is not None else 1.0
    if not 0.0 < top_p <= 1.0:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise _invalid(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = req.min_p if req.min_p is not None else 0.0
    if not 0.0 <= min_p <= 1.0:
        raise _invalid(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise _invalid(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if req.min_tokens < 0:
        raise _invalid(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.")
    if req.min_tokens > max_tokens:
        raise _invalid(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {req.min_tokens}."
        )
    _stops(req)
    # vLLM raises a temperature under 0.01 to 0.01: only an exact 0 samples greedily.
    if temperature == 0.0 and n > 1:
        raise _invalid(f"n must be 1 when using greedy sampling, got {n}.")


def _stops(req: _Common) -> tuple[str, ...]:
    """The request's stop strings; vLLM refuses an empty one."""
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stops):
        raise _invalid("stop cannot contain an empty string.")
    return stops


def _stream_flags(req: _Common) -> tuple[bool, bool, bool]:
    stream = bool(req.stream)
    opts = req.stream_options
    if opts is not None and not stream:
        raise _invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    include = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
    return stream, include, continuous


def parse_chat(data: Any, served: str, max_model_len: int) -> Generation:
    """Validate a chat completion request the way vLLM does."""
    try:
        req = ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise _bad_request(*_validation_message(exc)) from None
    # vLLM's order: request validators, model, max_tokens, chat template, prompt, sampling.
    stream, include, continuous = _stream_flags(req)
    _check_model(req.model, served)
    asked = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    _check_max_tokens(max_tokens, max_model_len, asked)
    if not req.messages:
        raise _invalid(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    text = chat_prompt_text(req.messages)
    tokens = tuple(tokenize(text))
    limit = _check_lengths(len(tokens), max_tokens, max_model_len)
    _check_sampling(req, limit)
    return Generation(
        "chat",
        (tokens,),
        limit,
        req.n,
        stream,
        include,
        continuous,
        req.ignore_eos,
        req.seed,
        text,
        req.priority,
        stop=_stops(req),
        include_stop=req.include_stop_str_in_output,
        min_tokens=req.min_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )


def parse_completion(data: Any, served: str, max_model_len: int) -> Generation:
    """Validate a text completion request the way vLLM does."""
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise _bad_request(*_validation_message(exc)) from None
    stream, include, continuous = _stream_flags(req)
    _check_model(req.model, served)
    _check_max_tokens(req.max_tokens, max_model_len)
    raw = req.prompt
    if isinstance(raw, list) and not raw:
        raise _invalid("You must pass at least one prompt")
    if not raw:
        raise ApiError(
            400,
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            "BadRequestError",
            "prompt",
        )
    prompts: list[tuple[str, ...]]
    if isinstance(raw, str):
        prompts = [tuple(tokenize(raw))]
    elif raw and isinstance(raw[0], str):
        prompts = [tuple(tokenize(str(p))) for p in raw]
    elif raw and isinstance(raw[0], list):
        prompts = [tuple(str(t) for t in p) for p in raw]
    else:
        prompts = [tuple(str(t) for t in raw)]
    if not prompts or any(not p for p in prompts):
        raise _bad_request("Prompt cannot be empty.", "prompt")
    limit = 0
    for p in prompts:
        limit = _check_lengths(len(p), req.max_tokens, max_model_len)
    _check_sampling(req, limit)
    text = raw if isinstance(raw, str) else orjson.dumps(raw).decode()
    return Generation(
        "completion",
        tuple(prompts),
        limit,
        req.n,
        stream,
        include,
        continuous,
        req.ignore_eos,
        req.seed,
        text,
        req.priority,
        stop=_stops(req),
        include_stop=req.include_stop_str_in_output,
        min_tokens=req.min_tokens,
        logprobs=req.logprobs,
        echo=bool(req.echo),
    )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability as vLLM reports it, with the alternatives asked for.

    ``top`` lists the token itself first, then the likeliest others, as vLLM's sampler returns
    them; ``logprob`` is None for a prompt's first token, which nothing predicts.
    """

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


def token_id(piece: str) -> int:
    """A stable id for a token (the simulator has no vocabulary file): its own number when it is
    one (a prompt sent as ids), else a hash of its text."""
    if piece.isdigit():
        return int(piece)
    return int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=4).digest(), "big") % 32000


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(entries: list[TokenLogprob], top: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object: each token with its bytes and ``top`` alternatives."""
    return {
        "content": [
            {
                **_chat_entry(e.token, e.logprob or 0.0),
                "top_logprobs": [_chat_entry(t, lp) for t, lp in e.top[:top]],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """A text choice's ``logprobs`` object; ``offset``: where its first token starts in the
    choice's text (an echoed prompt included)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "text_offset": offsets,
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.token for e in entries],
        "top_logprobs": [dict(e.top) if e.logprob is not None else None for e in entries],
    }


def prompt_logprobs(entries: list[TokenLogprob]) -> list[Any]:
    """A whole echoed completion's ``prompt_logprobs``: per prompt token after the first, its
    id's logprob, rank and text, then the alternatives' (rank 1 up)."""
    out: list[Any] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        ranked = {
            str(token_id(e.token)): {
                "logprob": e.logprob,
                "rank": 1 + len(e.top),
                "decoded_token": e.token,
            }
        }
        for rank, (t, lp) in enumerate(e.top[1:], start=1):
            ranked.setdefault(str(token_id(t)), {"logprob": lp, "rank": rank, "decoded_token": t})
        out.append(ranked)
    return out


def _usage(prompt: int, completion: int, details: bool) -> bytes:
    tail = ',"completion_tokens_details":null' if details else ""
    return (
        f'"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
        f'"completion_tokens":{completion}{tail}}}'
    ).encode()


class _Formatter:
    """Shared framing: a fixed prefix per request so each chunk costs one small join."""

    object_name: str

    def __init__(self, request_id: str, created: int, model: str, fingerprint: str) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        self._prefix = (
            f'data: {{"id":"{request_id}","object":"{self.object_name}",'
            f'"created":{created},"model":{orjson.dumps(model).decode()},"choices":['
        ).encode()
        self._fingerprint_tail = f',"system_fingerprint":"{fingerprint}"}}\n\n'.encode()

    def usage_chunk(self, prompt: int, completion: int) -> bytes:
        """The final chunk with ``choices: []`` that ``include_usage`` asks for."""
        return b"".join(
            (
                self._prefix,
                b"],",
                _usage(prompt, completion, details=False),
                f',"system_fingerprint":"{self.fingerprint}"}}\n\n'.encode(),
            )
        )

    @staticmethod
    def done() -> bytes:
        """The SSE terminator."""
        return b"data: [DONE]\n\n"


class ChatFormatter(_Formatter):
    """Bytes of /v1/chat/completions responses."""

    object_name = "chat.completion.chunk"

    def role_chunk(self, index: int, usage: tuple[int, int] | None) -> bytes:
        """The first chunk of each choice: the assistant role with empty content."""
        extra = b"," + _usage(*usage, details=True) if usage else b""
        return b"".join(
            (
                self._prefix,
                f'{{"index":{index},"delta":{{"role":"assistant","content":""}},'
                '"logprobs":null,"finish_reason":null}]'.encode(),
                extra,
                b',"prompt_token_ids":null,"prompt_text":null}\n\n',
            )
        )

    def token_chunk(
        self,
        index: int,
        text: str,
        finish: str | None,
        usage: tuple[int, int] | None,
        last: bool = False,
        stop_reason: str | None = None,
        logprobs: bytes = b"null",
    ) -> bytes:
        """One generated token; the last one of a choice carries its finish and stop reasons.

        ``last`` marks a finish chunk of a stream that no usage chunk ends: vLLM puts
        ``system_fingerprint`` on each of those (one per choice) and nowhere else.
        """
        content = orjson.dumps(text)
        if finish is None:
            tail = b'},"logprobs":%s,"finish_reason":null,"token_ids":null}]' % logprobs
        else:
            tail = b"".join(
                (
                    b'},"logprobs":',
                    logprobs,
                    f',"finish_reason":"{finish}","stop_reason":'.encode(),
                    orjson.dumps(stop_reason),
                    b',"token_ids":null}]',
                )
            )
        extra = b"," + _usage(*usage, details=True) if usage else b""
        return b"".join(
            (
                self._prefix,
                f'{{"index":{index},"delta":{{"content":'.encode(),
                content,
                tail,
                extra,
                self._fingerprint_tail if last else b"}\n\n",
            )
        )

    def full(
        self,
        texts: list[str],
        finishes: list[str],
        prompt: int,
        completion: int,
        stop_reasons: list[str | None] | None = None,
        logprobs: list[Any] | None = None,
    ) -> bytes:
        """A whole non-streamed chat completion (``logprobs``: each choice's object)."""
        choices = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": reason,
                "token_ids": None,
                "routed_experts": None,
            }
            for i, (text, finish, reason, lp) in enumerate(
                zip(
                    texts,
                    finishes,
                    stop_reasons or [None] * len(texts),
                    logprobs or [None] * len(texts),
                    strict=True,
                )
            )
        ]
        body = {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return orjson.dumps(body)


class CompletionFormatter(_Formatter):
    """Bytes of /v1/completions responses."""

    object_name = "text_completion"

    def token_chunk(
        self,
        index: int,
        text: str,
        finish: str | None,
        usage: tuple[int, int] | None,
        last: bool = False,
        stop_reason: str | None = None,
        logprobs: bytes = b"null",
        prompt_ids: bytes = b"null",
    ) -> bytes:
        """One generated token of a text completion (``last``: see ``ChatFormatter``);
        ``prompt_ids``: the prompt's token ids, which vLLM sends with an echo's first chunk."""
        finish_json = "null" if finish is None else f'"{finish}"'
        extra = b"," + _usage(*usage, details=False) if usage else b""
        return b"".join(
            (
                self._prefix,
                f'{{"index":{index},"text":'.encode(),
                orjson.dumps(text),
                b',"logprobs":',
                logprobs,
                f',"finish_reason":{finish_json},"stop_reason":'.encode(),
                orjson.dumps(stop_reason),
                b',"prompt_token_ids":',
                prompt_ids,
                b',"token_ids":null}]',
                extra,
                self._fingerprint_tail if last else b"}\n\n",
            )
        )

    def full(
        self,
        texts: list[str],
        finishes: list[str],
        prompt: int,
        completion: int,
        stop_reasons: list[str | None] | None = None,
        logprobs: list[Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
    ) -> bytes:
        """A whole non-streamed text completion (``logprobs``: each choice's object;
        ``prompt_logprobs``: each choice's, for an echo with log-probabilities)."""
        count = len(texts)
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": reason,
                "token_ids": None,
                "prompt_logprobs": plp,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for i, (text, finish, reason, lp, plp) in enumerate(
                zip(
                    texts,
                    finishes,
                    stop_reasons or [None] * count,
                    logprobs or [None] * count,
                    prompt_logprobs or [None] * count,
                    strict=True,
                )
            )
        ]
        body = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return orjson.dumps(body)
