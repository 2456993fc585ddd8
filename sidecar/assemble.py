"""Non-streamed completions served from vLLM's stream, so a client that leaves is still metered.

vLLM sends nothing of a non-streamed completion, not even its headers, until it is done, so a
client that hangs up half-way leaves no trace of the tokens the engine spent on it. For such a
request the sidecar asks vLLM for the stream instead, with ``include_usage`` and
``continuous_usage_stats`` (every chunk then carries the running token counts), reads it to the
end and answers the client with the body vLLM would have sent for the non-streamed request:
the same fields in the same order, the same types, the same usage, serialised as vLLM's
``JSONResponse`` serialises it (``json.dumps``, compact, UTF-8; for an answer without floats,
orjson, which writes the same bytes for less: ``_dumps``). Closing the stream is also how
vLLM learns of an abandoned request, at once.

Only requests whose answer can be rebuilt from the stream exactly are assembled
(``assemblable``): plain sampling parameters, log-probabilities (each chunk carries its tokens',
and the whole answer lists them all in the same form, text offsets included) and a completion's
echo (the first chunk's text begins with the prompt); not tools, beam search, token ids, prompt
log-probabilities or an echo with log-probabilities, whose non-streamed answers carry what a
stream spreads out differently or not at all (an echo's ``prompt_logprobs``). The others are
relayed as they are, and a client leaving them is metered as before.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from infermeter.records import RequestStatus
from sidecar.pool import UpstreamClosed
from sidecar.request_ids import response_id
from sidecar.stream import UsageCounts, parse_usage
from sidecar.upstream import upstream_failure

__all__ = ["Answer", "Assembler", "answer", "assemblable", "streamed_body"]

CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"

# Parameters that only choose which tokens are drawn and how many: the answer's shape is the
# same whether it is streamed or not.
_SAMPLING = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "length_penalty",
        "ignore_eos",
        "min_tokens",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "user",
        "priority",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "response_format",
        "structured_outputs",
        "add_special_tokens",
        "truncate_prompt_tokens",
    }
)
_PLAIN: Final = {
    CHAT: _SAMPLING
    | {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "parallel_tool_calls",
        "logprobs",
        "top_logprobs",
    },
    COMPLETIONS: _SAMPLING | {"prompt", "logprobs", "echo"},
}
# Parameters that change the answer's shape, allowed only when switched off.
_WHEN_OFF = frozenset(
    {
        "stream",
        "logprobs",
        "top_logprobs",
        "echo",
        "use_beam_search",
        "return_token_ids",
        "tools",
        "tool_choice",
        "stream_options",
        "best_of",
        "prompt_logprobs",
        "return_tokens_as_token_ids",
    }
)
_FALSE_IS_OFF = frozenset(
    {
        "stream",
        "logprobs",
        "echo",
        "use_beam_search",
        "return_token_ids",
        "return_tokens_as_token_ids",
    }
)
_PROMPT_DETAILS = ("cached_tokens", "created_cache_tokens", "multimodal_tokens")
_DONE = b"data: [DONE]\n\n"
# A token chunk is read without decoding it (``_events_of``): one choice whose delta is text
# only, with no finish reason, as vLLM 0.32 writes it; anything else is parsed whole. What comes
# after the choice's index, around its text (a JSON string's body, escapes kept).
_TOKEN_SHAPES: Final = {
    CHAT: (
        rb',"delta":\{"content":"',
        rb'"\},"logprobs":null,"finish_reason":null(?:,"token_ids":null)?\}\]',
    ),
    COMPLETIONS: (
        rb',"text":"',
        rb'","logprobs":null,"finish_reason":null,"stop_reason":null'
        rb'(?:,"prompt_token_ids":null)?(?:,"token_ids":null)?\}\]',
    ),
}
# The groups of a match: the index, the text, the usage (when the chunk has one) of a token
# chunk; or the JSON of any other event.
_TOKEN_USAGE: Final = 3
_OTHER: Final = 4


_NOTHING = re.compile(rb"(?!)")
# The body of a JSON string, escapes kept: runs of plain characters around each escape (a loop
# unrolled, about three times faster in ``re`` than an alternation per character).
_TEXT: Final = rb'([^"\\\n]*(?:\\.[^"\\\n]*)*)'


@functools.lru_cache(maxsize=64)
def _events_of(endpoint: str, kind: bytes, model: bytes) -> re.Pattern[bytes]:
    """The events of a stream on ``endpoint`` whose chunks are of object ``kind`` and name
    ``model`` (both as JSON): one match per event, a token chunk's index, text and usage in
    groups 1-3, any other event's JSON in group 4. Every stream of a sidecar names one model (a
    regular expression is made once, not per stream); literal, they make a match about a third
    cheaper than patterns for any name."""
    before, after = _TOKEN_SHAPES[endpoint]
    token = (
        rb'data: \{"id":"[^"\\\n]*","object":'
        + re.escape(kind)
        + rb',"created":\d+,"model":'
        + re.escape(model)
        + rb',"choices":\[\{"index":(\d+)'
        + before
        + _TEXT
        + after
        + rb'(,"usage":\{[^\n]*)?\}'
    )
    return re.compile(rb"^(?:" + token + rb"|data: (\{[^\n]*))$", re.MULTILINE)


@functools.lru_cache(maxsize=64)
def _tokens_of(endpoint: str, kind: bytes, model: bytes) -> re.Pattern[bytes]:
    """The token chunks of the first choice, for ``split``: the text is the one group, and a
    chunk's usage and the blank line after it are inside the match, so the pieces between two
    token chunks in a row are empty. ``split`` then cuts a stream into its texts and the other
    events in one pass of C, with no object per token but its text."""
    before, after = _TOKEN_SHAPES[endpoint]
    return re.compile(
        rb'^data: \{"id":"[^"\\\n]*","object":'
        + re.escape(kind)
        + rb',"created":\d+,"model":'
        + re.escape(model)
        + rb',"choices":\[\{"index":0'
        + before
        + _TEXT
        + after
        + rb'(?:,"usage":\{[^\n]*)?\}\n\n',
        re.MULTILINE,
    )


def assemblable(endpoint: str, body: dict[str, Any]) -> bool:
    """True when ``body``, a non-streamed request, can be answered from vLLM's stream exactly.

    ``stream_options`` on a non-streamed request is refused by vLLM; the request is relayed as
    it is so that the client gets vLLM's own refusal.
    """
    plain = _PLAIN.get(endpoint)
    if plain is None:
        return False
    if endpoint == COMPLETIONS and body.get("echo") and body.get("logprobs") is not None:
        # The whole answer adds the prompt's log-probabilities by token id, which no chunk has.
        return False
    for key, value in body.items():
        if key in plain:
            continue
        if key not in _WHEN_OFF:
            return False
        off = value is None or (value is False and key in _FALSE_IS_OFF)
        if not off:
            return False
    return True


def streamed_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request sent upstream: ``body`` streamed, with usage on every chunk."""
    return {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


@dataclass
class _Choice:
    role: str | None = None
    parts: list[str] = field(default_factory=list)
    # Text of token chunks as it is in the stream (JSON string escapes kept), not decoded yet:
    # decoded once, in one piece, before a part is added or the text is read (``text``).
    raw: list[bytes] = field(default_factory=list)
    reasoning: list[str] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    # The log-probabilities of the chunks, their lists joined in order (chat: ``content``; a
    # completion: ``text_offset``, ``token_logprobs``, ``tokens``, ``top_logprobs``); None: none.
    logprobs: dict[str, Any] | None = None

    def add(self, part: str) -> None:
        """A decoded part of the text, after what ``raw`` holds."""
        if self.raw:
            self._decode()
        self.parts.append(part)

    def text(self) -> str:
        """The choice's text so far."""
        if self.raw:
            self._decode()
        return "".join(self.parts)

    def _decode(self) -> None:
        # Escaped JSON string bodies joined are the escaped body of the joined text.
        self.parts.append(orjson.loads(b'"%s"' % b"".join(self.raw)))
        self.raw = []


@dataclass
class Assembler:
    """Reads one vLLM stream and builds the non-streamed answer it stands for.

    While the stream runs, a block is only kept: the events are read when the stream has ended
    and the answer is built, or when a stream abandoned half-way is asked for the tokens it had
    spent (the journal's tick). A token chunk is not decoded: its text, as the stream escapes
    it, is found by a few byte searches and appended to its choice's buffer, and its usage is
    kept where it is, parsed only when asked for (``_token``). The buffer is decoded once, when
    the text is read. The other events (the role chunk, the finish chunk, the usage chunk, an
    error, anything unexpected) are parsed whole. Everything read from it (``done``, ``error``,
    ``usage``, ``response_id``) is what the blocks fed so far hold.
    """

    endpoint: str
    # Choices per prompt (the request's ``n``): a cut-short stream's counts are per choice.
    n: int = 1
    _done: bool = False
    # ``{"message", "type", "param", "code"}`` when vLLM ended the stream with an error event.
    _error: dict[str, Any] | None = None
    _response_id: str | None = None
    _head: dict[str, Any] = field(default_factory=dict)
    _choices: dict[int, _Choice] = field(default_factory=dict)
    _final: dict[str, Any] = field(default_factory=dict)
    # Blocks fed and not parsed yet; ``_tail`` is the parsed text's incomplete last event.
    _blocks: list[bytes] = field(default_factory=list)
    _tail: bytes = b""
    _started: bool = False
    # The usage object of the latest chunk that carried one, or where it is in a token chunk.
    _usage: dict[str, Any] | tuple[bytes, int] | None = None
    # The latest (prompt, completion) counts of each choice, for a stream that was cut short
    # (or where they are in a token chunk).
    _per_choice: dict[int, tuple[int, int] | tuple[bytes, int]] = field(default_factory=dict)
    # How this stream's events read (``_events_of``), from its first chunk.
    _events: re.Pattern[bytes] = field(default_factory=lambda: _NOTHING)
    # How its first choice's token chunks read, for ``split`` (``_tokens_of``).
    _tokens: re.Pattern[bytes] = field(default_factory=lambda: _NOTHING)

    def feed(self, block: bytes) -> None:
        """Take a block of the stream as it arrived (events may be split across blocks)."""
        self._blocks.append(block)

    @property
    def done(self) -> bool:
        """True once vLLM's ``[DONE]`` was fed."""
        self._parse()
        return self._done

    @property
    def error(self) -> dict[str, Any] | None:
        """vLLM's error event, when the stream ended with one."""
        self._parse()
        return self._error

    @property
    def response_id(self) -> str | None:
        """vLLM's id for the response, from the first event."""
        self._parse()
        return self._response_id

    @property
    def usage(self) -> UsageCounts | None:
        """The latest token counts vLLM reported, None before any."""
        self._parse()
        u = self._usage
        if u is None:
            return None
        if isinstance(u, tuple):
            block, at = u
            return parse_usage(block[at : at + 400])
        details = u.get("prompt_tokens_details") or {}
        return UsageCounts(
            int(u.get("prompt_tokens") or 0),
            int(u.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0),
        )

    def usage_so_far(self) -> UsageCounts | None:
        """The tokens spent on a stream that did not finish: every choice's latest counts.

        With continuous usage, vLLM's chunk of one choice carries that choice's completion
        tokens and its prompt's tokens, so ``n > 1`` or several prompts are summed here.
        """
        latest = self.usage
        if latest is None or self._done or not self._per_choice:
            return latest
        counts = {i: _counts(c) for i, c in sorted(self._per_choice.items())}
        prompts = {i // self.n: p for i, (p, _) in counts.items()}
        completion = sum(c for _, c in counts.values())
        return UsageCounts(sum(prompts.values()), completion, latest.cached)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's finish reason, once the answer is built."""
        self._parse()
        first = self._choices.get(min(self._choices)) if self._choices else None
        return None if first is None else first.finish_reason

    def _parse(self) -> None:
        """Read every whole event fed so far: token chunks by one regular expression over them
        all (``_events_of``), the other events parsed whole."""
        if not self._blocks:
            return
        data = b"".join([self._tail, *self._blocks])
        self._blocks = []
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return
        self._tail = data[end + 2 :]
        data = data[: end + 2]
        if not self._started:
            self._started = True
            self._response_id = response_id(data)
        if _DONE in data:
            self._done = True
        chat = self.endpoint == CHAT
        pos = 0
        while not self._head and pos < len(data):
            # The first chunk gives the answer's head: one event at a time until it is read.
            nl = data.find(b"\n", pos)
            line = data[pos:nl]
            pos = nl + 1
            if line.startswith(b"data: {"):
                self._take(orjson.loads(line[6:]), chat)
        if not self._head:
            return
        if self.n == 1:
            rest = data[pos:] if pos else data
            # [events before, text, (empty), text, ..., text, events after]
            parts = self._tokens.split(rest)
            if len(parts) > 1 and not any(parts[2:-1:2]):
                self._scan(parts[0], 0, chat)
                choice = self._choices.get(0)
                if choice is None:
                    choice = self._choices[0] = _Choice()
                choice.raw += parts[1::2]
                # The latest usage is the last token chunk's (none: the events' before).
                at = rest.rfind(b',"usage":{', len(parts[0]), len(rest) - len(parts[-1]))
                if at >= 0:
                    self._usage = self._per_choice[0] = (rest, at + 1)
                self._scan(parts[-1], 0, chat)
                return
        self._scan(data, pos, chat)

    def _scan(self, data: bytes, pos: int, chat: bool) -> None:
        """Read the events of ``data`` from ``pos``, one match each (``_events_of``)."""
        choices = self._choices
        for event in self._events.finditer(data, pos):
            if event.lastindex == _OTHER:
                self._take(orjson.loads(event[_OTHER]), chat)
                continue
            index = int(event[1])
            choice = choices.get(index)
            if choice is None:
                choice = choices[index] = _Choice()
            choice.raw.append(event[2])
            if event.lastindex == _TOKEN_USAGE:
                where = (data, event.start(_TOKEN_USAGE) + 1)
                self._usage = where
                self._per_choice[index] = where

    def _take(self, chunk: dict[str, Any], chat: bool) -> None:
        choices: list[dict[str, Any]] | None = chunk.get("choices")
        if choices is None and "error" in chunk:
            self._error = chunk["error"]
            return
        if not self._head:
            self._head = {k: chunk[k] for k in ("id", "created", "model")}
            kind, model = orjson.dumps(chunk.get("object")), orjson.dumps(chunk["model"])
            self._events = _events_of(self.endpoint, kind, model)
            self._tokens = _tokens_of(self.endpoint, kind, model)
        for c in choices or ():
            self._choice(c, chat)
        usage = chunk.get("usage")
        if usage:
            self._usage = usage
            if choices and len(choices) == 1:
                self._per_choice[int(choices[0]["index"])] = (
                    int(usage.get("prompt_tokens") or 0),
                    int(usage.get("completion_tokens") or 0),
                )
        if not choices:
            # The final usage chunk: vLLM's fingerprint and per-request metrics ride on it.
            self._final = chunk

    def _choice(self, c: dict[str, Any], chat: bool) -> None:
        index = int(c["index"])
        choice = self._choices.get(index)
        if choice is None:  # (not setdefault: that would build a _Choice for every chunk)
            choice = self._choices[index] = _Choice()
        if chat:
            delta = c.get("delta") or {}
            role = delta.get("role")
            if role is not None:
                choice.role = role
            content = delta.get("content")
            if content is not None:
                choice.add(content)
            reasoning = delta.get("reasoning")
            if reasoning is not None:
                choice.reasoning = [*(choice.reasoning or ()), reasoning]
        else:
            text = c.get("text")
            if text is not None:
                choice.add(text)
        logprobs = c.get("logprobs")
        if logprobs:
            if choice.logprobs is None:
                choice.logprobs = {k: [] if isinstance(v, list) else v for k, v in logprobs.items()}
            for key, value in logprobs.items():
                if isinstance(value, list):
                    choice.logprobs[key] += value
        finish = c.get("finish_reason")
        if finish is not None:
            choice.finish_reason, choice.stop_reason = finish, c.get("stop_reason")

    def error_body(self) -> tuple[int, bytes]:
        """The status and body vLLM answers a non-streamed request with for the stream's error."""
        error = self.error
        assert error is not None
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        return status, _dumps({"error": error})

    def body(self) -> bytes:
        """The non-streamed answer, as vLLM serialises it."""
        self._parse()
        chat = self.endpoint == CHAT
        choices = [
            self._chat_choice(i, c) if chat else self._text_choice(i, c)
            for i, c in sorted(self._choices.items())
        ]
        out: dict[str, Any] = {
            "id": self._head.get("id"),
            "object": "chat.completion" if chat else "text_completion",
            "created": self._head.get("created"),
            "model": self._head.get("model"),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self._final.get("system_fingerprint"),
            "usage": self._full_usage(),
        }
        if chat:
            out |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        metrics = self._final.get("metrics")
        out |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": metrics}
        # Floats come only in what vLLM's chunks carried through (its metrics, token details,
        # log-probabilities: json.dumps writes 1e-07 where orjson writes 1e-7).
        usage = out["usage"]
        carried = (metrics, usage["prompt_tokens_details"], usage["completion_tokens_details"])
        plain = all(c.logprobs is None for c in self._choices.values())
        return _dumps(out, fast=plain and all(map(_floatless, carried)))

    def _full_usage(self) -> dict[str, Any]:
        # The stream's usage chunk leaves out what is null (exclude_none); the whole body does not.
        u = self._final.get("usage") or {}
        details = u.get("prompt_tokens_details")
        return {
            "prompt_tokens": u.get("prompt_tokens", 0),
            "total_tokens": u.get("total_tokens", 0),
            "completion_tokens": u.get("completion_tokens", 0),
            "prompt_tokens_details": None
            if details is None
            else {k: details.get(k) for k in _PROMPT_DETAILS},
            "completion_tokens_details": u.get("completion_tokens_details"),
        }

    @staticmethod
    def _chat_choice(index: int, c: _Choice) -> dict[str, Any]:
        message = {
            "role": c.role or "assistant",
            "content": c.text() if c.parts or c.raw or c.reasoning is None else None,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None if c.reasoning is None else "".join(c.reasoning),
        }
        return {
            "index": index,
            "message": message,
            "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": None,
            "routed_experts": None,
        }

    @staticmethod
    def _text_choice(index: int, c: _Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": c.text(),
            "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }


def _counts(found: tuple[int, int] | tuple[bytes, int]) -> tuple[int, int]:
    """(prompt, completion) of a choice: counted already, or read where its usage is."""
    first, second = found
    if isinstance(first, int):
        return first, second
    usage = parse_usage(first[second : second + 400])
    return (0, 0) if usage is None else (usage.prompt, usage.completion)


def _dumps(value: Any, fast: bool = False) -> bytes:
    """Exactly the bytes of vLLM's JSONResponse (Starlette's ``json.dumps``).

    ``fast``: ``value`` holds no float, so orjson writes the same bytes (its strings, integers
    and nulls are written as ``json.dumps`` writes them; a float's shortest form is not: 1e-7,
    where Python writes 1e-07), about 8 µs less a 64-token answer (``bench.assemble_cost
    --tokens 64``, docs/benchmarks.md).
    """
    if fast:
        try:
            return orjson.dumps(value)
        except orjson.JSONEncodeError:  # (an integer past 64 bits)
            pass
    return json.dumps(
        value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def _floatless(value: Any) -> bool:
    """Whether ``value`` (a JSON value read from vLLM) holds no float, however deep."""
    if value is None or isinstance(value, (str, int)):
        return True
    if isinstance(value, dict):
        return all(map(_floatless, value.values()))
    if isinstance(value, list):
        return all(map(_floatless, value))
    return False


@dataclass(frozen=True, slots=True)
class Answer:
    """What the client gets once vLLM's response is read, and how the request is recorded."""

    status: RequestStatus
    http_status: int
    body: bytes
    usage: UsageCounts | None


def answer(upstream_status: int, whole: bytes | None, assembler: Assembler) -> Answer:
    """The answer to a request whose response was read to its end (or to the upstream's).

    ``whole`` is the body when the upstream answered with one instead of a stream: vLLM's
    refusal before any event, or an upstream that does not stream; it is passed on as it is.
    An error event becomes the error vLLM gives a non-streamed request; a stream that ended
    without ``[DONE]`` is a 502 with the usage so far; otherwise the assembled body.
    """
    if whole is not None:
        at = whole.find(b'"usage":{')
        usage = parse_usage(whole[at:]) if at >= 0 else None
        status = RequestStatus.OK if upstream_status == 200 else _failed(upstream_status)
        return Answer(status, upstream_status, whole, usage)
    if assembler.error is not None:  # (parses what the stream held, once)
        code, body = assembler.error_body()
        return Answer(_failed(code), code, body, assembler.usage)
    if not assembler.done:
        code, body = upstream_failure(UpstreamClosed())
        return Answer(RequestStatus.UPSTREAM_ERROR, code, body, assembler.usage_so_far())
    return Answer(RequestStatus.OK, 200, assembler.body(), assembler.usage)


def _failed(http_status: int) -> RequestStatus:
    return RequestStatus.BAD_REQUEST if http_status < 500 else RequestStatus.UPSTREAM_ERROR
