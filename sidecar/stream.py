"""The per-chunk path: meter a vLLM SSE stream and give the client exactly what it asked for.

The sidecar always asks vLLM for ``include_usage`` and ``continuous_usage_stats``, so every chunk
carries exact running token counts and an aborted stream still has them. The client gets the
stream it would have had from vLLM directly: per-chunk usage is cut out unless it asked for
continuous stats, the final usage chunk is dropped unless it asked for usage, and then its
``system_fingerprint`` moves back to the finish chunks, where vLLM puts it in that case (each
choice's: ``StreamMeter.fingerprint``).

Nothing here decodes JSON, and nothing runs a regular expression per block. Upstream reads arrive
as blocks of one or more complete SSE events (plus possibly a partial one, kept for the next
block). One left-to-right walk over a block's ``"usage":{`` keys finds the running usage, the final
usage chunk and the per-chunk usage objects to cut out, with ``bytes.find`` on fixed markers and
constant-time checks of the bytes before each key, because this code runs for every token of every
user. Apart from the bytes sent on, a block allocates nothing unless it holds a finish chunk, but
the copy of the start of its last usage object that goes to the stream's admission-journal slot
(``StreamMeter.slot``, ``sidecar.progress``) before the client gets the block: what a sidecar
killed mid-stream bills the request.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.metrics import ITL_BUCKETS
from sidecar.request_ids import response_id

__all__ = ["CostRate", "ProgressSlot", "StreamMeter", "UsageCounts", "parse_usage"]


# What the meter writes to and reads from, as protocols: the modules that implement them
# (``sidecar.progress``, ``sidecar.rates``) import this one for ``UsageCounts``.
class ProgressSlot(Protocol):
    """A request's slot in the admission journal (``sidecar.progress.Slot``)."""

    counted: bool

    def counts(self, usage: UsageCounts | None) -> None: ...

    def usage(self, data: bytes, usage_at: int) -> None: ...

    def first_token(self, now: float) -> None: ...

    def response_id(self, value: str | None) -> None: ...

    def began(self) -> None: ...


class CostRate(Protocol):
    """A model's cost rate (``sidecar.rates.Rate``): puts the estimate on the final usage chunk."""

    def final_chunk(self, block: bytes) -> bytes: ...


_DONE = b"data: [DONE]\n\n"
# vLLM's error event: what a stream that failed after its head ends with, before its [DONE].
# (Generated text never holds an unescaped quote, so only a real event matches.)
_ERROR = b'data: {"error":'
_END = b"\n\n"
_ROLE = b'"delta":{"role"'
_USAGE_ONLY = b'"choices":[],"usage"'
_FINISH = b'"finish_reason":"'
_USAGE_KEY = b'"usage":{'
# Per-chunk usage follows the choices array ("}],"), an object of numbers and nulls with at most
# one level of nested objects (prompt_tokens_details); anything deeper is not usage and is left
# alone. The final usage chunk's follows '"choices":[],' instead.
_CHUNK_USAGE = re.compile(rb'\}\],"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')
_AFTER_CHOICES = b"}],"
_USAGE_LAST = b"}}\n\n"
_EVENT_END = b"}\n\n"
_NO_CHOICES = b'"choices":[],'
_FINGERPRINT = b',"system_fingerprint":"'
_DONE_SIZE = len(_DONE)
_NO_CHOICES_SIZE = len(_NO_CHOICES)
_USAGE_KEY_SIZE = len(_USAGE_KEY)
_ITL_BOUNDS = tuple(float(b) for b in ITL_BUCKETS)
_ITL_EMPTY = bytes(array("d", [0.0]).itemsize * (len(_ITL_BOUNDS) + 2))
_PROMPT = re.compile(rb'"prompt_tokens":(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens":(\d+)')
_CACHED = re.compile(rb'"cached_tokens":(\d+)')
_CHOICE_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')


def object_end(data: bytes, brace: int) -> int:
    """The offset just past the object opening at ``data[brace]``, -1 past one level of nesting.

    Usage objects hold numbers, nulls and at most one level of nested objects
    (``prompt_tokens_details``); anything deeper or unclosed is left alone, as it is not usage.
    """
    pos = brace + 1
    while True:
        close = data.find(b"}", pos)
        if close < 0:
            return -1
        inner = data.find(b"{", pos, close)
        if inner < 0:
            return close + 1
        inner_close = data.find(b"}", inner + 1)
        if inner_close < 0 or data.find(b"{", inner + 1, inner_close) >= 0:
            return -1
        pos = inner_close + 1


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """Token counts as vLLM reported them."""

    prompt: int
    completion: int
    cached: int = 0


def parse_usage(fragment: bytes) -> UsageCounts | None:
    """Counts from the bytes of a ``"usage":{...}`` object (or a text starting with one)."""
    prompt = _PROMPT.search(fragment)
    completion = _COMPLETION.search(fragment)
    if prompt is None or completion is None:
        return None
    cached = _CACHED.search(fragment)
    return UsageCounts(int(prompt[1]), int(completion[1]), int(cached[1]) if cached else 0)


@dataclass(slots=True)
class StreamMeter:
    """Timing, token counts and client-facing rewriting of one streamed response."""

    client_usage: bool
    client_continuous: bool
    started_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_events: int = 0
    final_usage: bool = False
    done: bool = False
    # vLLM ended the stream with an error event (``data: {"error": ...}``, then ``[DONE]``): the
    # engine failed the request after its head was sent, and the stream is not a whole answer.
    failed: bool = False
    finish_reason: str | None = None
    # vLLM's id for the response (``chatcmpl-...``), read from the first chunk.
    response_id: str | None = None
    # Inter-token gaps as a histogram of ``ITL_BUCKETS`` (counts per bucket, +Inf, then the sum,
    # the layout of ``FastHistogram``): fixed memory however long the stream, one bisect per
    # block, and one merge into the shared histogram when the request ends.
    _itl: array[float] = field(default_factory=lambda: array("d", _ITL_EMPTY))
    _tail: bytes = b""
    _held: bytes = b""
    _usage: UsageCounts | None = None
    # The block holding the latest usage object seen and where it starts, parsed only when asked
    # for: every chunk carries one, only the last one counts, and keeping the block costs no copy.
    _usage_block: bytes = b""
    _usage_at: int = 0
    # Whether the block just scanned holds a finish chunk (the rewrite may have to hold it).
    _finish_in_block: bool = False
    # Choices per prompt when the stream carries several choices (``n`` > 1, or a batch of
    # prompts), else 0. vLLM's running usage on a chunk then counts that chunk's choice only,
    # so the latest counts of every choice are kept for a stream that ends before its total.
    choices: int = 0
    _per_choice: dict[int, tuple[int, int]] | None = None
    # The next block may take the short path (``_token``): set by every block the long path
    # (``_block``) takes, and left as it is by the short path, which changes none of its terms.
    _steady: bool = False
    # The admission journal's slot of this request (``sidecar.progress``), written as each
    # block is metered, before the client gets its bytes: what a killed sidecar's request is
    # billed. None when not journaled.
    slot: ProgressSlot | None = None
    # The model's cost rate (``sidecar.rates``), for a client that asked for usage: the final
    # usage chunk it gets carries the cost estimate. None: no estimate.
    rate: CostRate | None = None
    # The replica's ``,"system_fingerprint":"..."`` member as its final usage chunk carries it:
    # given from an earlier stream of the replica, and taken from this one's. Without usage, vLLM
    # puts it on every choice's finish chunk; with several choices all but the last are sent
    # before the usage chunk, so they get the one known from before (none before the first).
    fingerprint: bytes | None = None

    @property
    def usage(self) -> UsageCounts | None:
        """The latest token counts vLLM reported, None before any.

        For several choices before vLLM's final usage chunk: every choice's latest counts, each
        prompt's tokens once.
        """
        if self._per_choice and not self.final_usage:
            latest = self._latest()
            prompts = {i // self.choices: p for i, (p, _) in sorted(self._per_choice.items())}
            completion = sum(c for _, c in self._per_choice.values())
            return UsageCounts(sum(prompts.values()), completion, latest.cached if latest else 0)
        return self._latest()

    @usage.setter
    def usage(self, counts: UsageCounts | None) -> None:
        self._usage, self._usage_block, self._per_choice = counts, b"", None

    def _latest(self) -> UsageCounts | None:
        if self._usage_block:
            at = self._usage_at
            # One level of nesting (prompt_tokens_details) fits well within 400 bytes.
            counts = parse_usage(self._usage_block[at : at + 400])
            self._usage_block = b""
            if counts is not None:
                self._usage = counts
        return self._usage

    @property
    def itl(self) -> array[float]:
        """Inter-token gaps: tokens per ``ITL_BUCKETS`` bucket (not cumulative), +Inf, the sum."""
        return self._itl

    @property
    def passthrough(self) -> bool:
        """True when the client asked for exactly what the sidecar asks vLLM for."""
        return self.client_usage and self.client_continuous

    def feed(self, data: bytes, now: float) -> bytes:
        """Meter a block from upstream; return the bytes to send on (complete events only)."""
        if self._steady:
            out = self._token(data, now)
            if out is not None:
                return out
        return self._block(data, now)

    def _token(self, data: bytes, now: float) -> bytes | None:
        """The usual block, one token's chunk in one read, in the fewest steps; else None.

        None, having changed nothing, for anything else: several events or part of one, the
        first token, a finish, the final usage chunk, ``[DONE]``, a chunk without usage. Those
        take ``_block``, which handles every block. ``_steady`` says the stream is past its
        first token, has one choice, and holds no partial event and no finish chunk.
        """
        size = len(data)
        if data.find(b"\n") != size - 2 or data[-1] != 10 or size == _DONE_SIZE:
            return None
        last = data.rfind(_USAGE_KEY)
        if (
            last < 0
            or data.startswith(_NO_CHOICES, last - _NO_CHOICES_SIZE)
            or data.rfind(_FINISH) >= 0
        ):
            return None
        self._usage_block, self._usage_at = data, last
        if self.slot is not None:
            self.slot.usage(data, last)
        last_at = self.last_token_at
        assert last_at is not None
        gap = now - last_at
        itl = self._itl
        itl[bisect_left(_ITL_BOUNDS, gap)] += 1
        itl[-1] += gap
        self.token_events += 1
        self.last_token_at = now
        if (self.client_continuous and self.client_usage) or not data.startswith(
            _AFTER_CHOICES, last - 3
        ):
            return data
        if data.endswith(_USAGE_LAST) and data.find(b"{", last + _USAGE_KEY_SIZE) < 0:
            return data[: last - 1] + _EVENT_END
        stop = object_end(data, last + _USAGE_KEY_SIZE - 1)
        return data if stop < 0 else data[: last - 1] + data[stop:]

    def _block(self, data: bytes, now: float) -> bytes:
        """``feed`` for any block.

        The block that ends the stream (vLLM's ``[DONE]``) gives nothing: what the client
        should see of it is held for ``close``, so that it goes out with the stream's last event
        once the request's ending is kept, in one write (the finish and usage chunks, ``[DONE]``
        and the chunked body's end), never before the ending.
        """
        out = self._events(data, now)
        if self.done and out:
            self._held = out
            return b""
        return out

    def _events(self, data: bytes, now: float) -> bytes:
        """What the client should see of a block, metered."""
        self._steady = False
        if self._tail:
            data = self._tail + data
            self._tail = b""
        if not data.endswith(_END):
            end = data.rfind(_END)
            if end < 0:
                self._tail = data
                return b""
            self._tail = data[end + 2 :]
            data = data[: end + 2]
        if self.response_id is None:
            self.response_id = response_id(data)
            if self.slot is not None:
                self.slot.response_id(self.response_id)
        if data.endswith(_DONE):
            self.done = True
            data = data[: -len(_DONE)]
            if not data:
                return self._flush_held()
        if not self.failed and data.find(_ERROR) >= 0:
            self.failed = True
        was_final = self.final_usage
        out = self._scan(data, now)
        self._steady = (
            self.first_token_at is not None
            and not self.choices
            and not self._tail
            and not self._held
            and not self.final_usage
            and not self.done
            and not self._finish_in_block
            and self.response_id is not None
        )
        if self.client_usage:
            if self.rate is not None and self.final_usage and not was_final:
                return self.rate.final_chunk(out)  # once a stream, in its last block
            return out
        out = self._rewrite(out, self._finish_in_block)
        self._steady = self._steady and not self._held
        return out + self._flush_held() if self.done else out

    def _scan(self, data: bytes, now: float) -> bytes:
        """Meter ``data``; cut per-chunk usage unless asked for.

        A few C-level searches over the block and no Python loop over it: this runs for every
        block of every stream. A block of one event (the usual case: one read per token) takes
        the shortest path; several events take one regular-expression substitution.
        """
        # Count event ends, not "data: ": generated text may contain "data: ", never a raw newline.
        # So the block is one event when its first newline is the end's (a one-byte search).
        single = data.find(b"\n") == len(data) - 2
        tokens = 1 if single else data.count(_END)
        if self.first_token_at is None:
            # vLLM sends every choice's role chunk before any token.
            tokens -= data.count(_ROLE)
        # A key inside generated text is escaped (\"usage\":{), so every match is a real key.
        last = data.rfind(_USAGE_KEY)
        if last >= 0:
            self._usage_block, self._usage_at = data, last
            if self.choices:
                self._track_choices(data)
            if single:
                finals = 1 if data.startswith(_NO_CHOICES, last - len(_NO_CHOICES)) else 0
            else:
                finals = data.count(_NO_CHOICES + _USAGE_KEY)
            if finals:
                tokens -= finals
                self.final_usage = True
                fp = data.find(_FINGERPRINT, last)
                if fp >= 0:
                    self.fingerprint = data[fp : data.find(b'"', fp + len(_FINGERPRINT)) + 1]
            slot = self.slot
            if slot is not None:
                if self.choices or not slot.counted:
                    slot.counts(self.usage)
                else:
                    slot.usage(data, last)
        finish = data.rfind(_FINISH)
        self._finish_in_block = finish >= 0
        if finish >= 0:
            i = finish + len(_FINISH)
            self.finish_reason = data[i : data.find(b'"', i)].decode()
        if tokens > 0:
            self._count(tokens, now)
        if last < 0 or self.passthrough:
            return data
        # Keep the "}]" closing the choices; drop ',"usage":{...}'. The final usage chunk's
        # follows '"choices":[],' and is kept.
        if single:
            if not data.startswith(_AFTER_CHOICES, last - 3):
                return data
            brace = last + len(_USAGE_KEY) - 1
            # vLLM puts usage last in the chunk: with no object nested in it, it ends where the
            # event's own closing brace begins.
            if data.endswith(_USAGE_LAST) and data.find(b"{", brace + 1) < 0:
                return data[: last - 1] + _EVENT_END
            stop = object_end(data, brace)
            return data if stop < 0 else data[: last - 1] + data[stop:]
        return _CHUNK_USAGE.sub(b"}]", data)

    def _track_choices(self, data: bytes) -> None:
        """Keep each choice's latest counts (streams of several choices only)."""
        if self._per_choice is None:
            self._per_choice = {}
        for event in data.split(_END):
            index = _CHOICE_INDEX.search(event)
            at = event.rfind(_USAGE_KEY)
            if index is not None and at >= 0:
                counts = parse_usage(event[at : at + 400])
                if counts is not None:
                    self._per_choice[int(index[1])] = (counts.prompt, counts.completion)

    def _count(self, tokens: int, now: float) -> None:
        if self.first_token_at is None:
            # Tokens that arrive with the first one follow it after no gap at all.
            self.first_token_at = self.last_token_at = now
            if self.slot is not None:
                self.slot.first_token(now)
            self.token_events += 1
            tokens -= 1
            if tokens <= 0:
                return
        if self.last_token_at is not None:
            # Events that arrive together share the gap since the previous block.
            gap = (now - self.last_token_at) / tokens
            itl = self._itl
            itl[bisect_left(_ITL_BOUNDS, gap)] += tokens
            itl[-1] += gap * tokens
        self.token_events += tokens
        self.last_token_at = now

    def _rewrite(self, data: bytes, has_finish: bool) -> bytes:
        """Drop the final usage chunk for a client that did not ask for usage."""
        if has_finish and self.choices and self.fingerprint is not None:
            data = self._stamped(data)
        out = self._held + data if self._held else data
        self._held = b""
        at = out.find(_USAGE_ONLY) if self.final_usage else -1
        if at >= 0:
            before = out.rfind(_END, 0, at)
            start = before + 2 if before >= 0 else 0
            stop = out.find(_END, at) + 2
            usage_event = out[start:stop]
            out = out[:start] + out[stop:]
            fp = usage_event.find(_FINGERPRINT)
            # (The last finish chunk holds one already when it was stamped: ``_stamped``.)
            if (
                fp >= 0
                and start > 0
                and out.find(_FINGERPRINT, out.rfind(_END, 0, start - 2) + 2, start) < 0
            ):
                fp_end = usage_event.find(b'"', fp + len(_FINGERPRINT)) + 1
                # start - 3 is the closing brace of the previous event (the last finish chunk).
                out = out[: start - 3] + usage_event[fp:fp_end] + out[start - 3 :]
            return out
        if not has_finish:
            return out
        # A finish chunk that ends the block may be the last JSON chunk: hold it until the next
        # block shows whether the usage chunk (with the fingerprint to move) follows.
        cut = out.rfind(_END, 0, len(out) - 2)
        last = cut + 2 if cut >= 0 else 0
        if out and out.find(_FINISH, last) >= 0:
            self._held = out[last:]
            return out[:last]
        return out

    def _stamped(self, data: bytes) -> bytes:
        """``data`` with the known fingerprint on each of its finish chunks, as vLLM puts it."""
        fingerprint = self.fingerprint
        assert fingerprint is not None
        pieces: list[bytes] = []
        pos = 0
        at = data.find(_FINISH)
        while at >= 0:
            end = data.find(_END, at)
            if end < 0:
                break
            # The event's closing brace is the byte before its end.
            pieces += (data[pos : end - 1], fingerprint)
            pos = end - 1
            at = data.find(_FINISH, end)
        pieces.append(data[pos:])
        return b"".join(pieces)

    def _flush_held(self) -> bytes:
        held, self._held = self._held, b""
        return held

    def close(self) -> bytes:
        """Bytes still held when the stream ends: the block that ended it, or a finish chunk
        waiting for its fingerprint."""
        return self._flush_held()
