"""vLLM's continuous-batching engine loop as a pure state machine: the one engine model.

Real vLLM runs one engine loop per replica. Each step it admits waiting requests while there is a
free sequence slot and room in the KV cache, prefills (in chunks of at most
``max_num_batched_tokens``) and decodes one token for every running sequence. That one loop is
why time to first token grows with the queue, why per-sequence decode speed falls as the batch
grows and why total throughput still rises with it. This module models exactly that loop and
nothing else: it has no clock and no I/O. ``plan()`` says how long the next step takes and
``commit()`` applies it, so a caller drives it with a virtual clock or with asyncio.

Two callers share it, which is why it lives in the core: the simulator's replicas
(``simulator.replica``, on asyncio's clock) and the efficiency advisor's replay
(``billing.efficiency.replay``, on a virtual clock over a month of recorded arrivals). For the
replay, ``advance()`` applies a run of identical decode steps in one pass: between two events
(an arrival, a sequence finishing, the KV cache filling) every step decodes the same batch and
lasts as long, so a month costs per request, not per token.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from infermeter.config import EngineProfile

__all__ = [
    "MAX_NUM_BATCHED_TOKENS",
    "PREFIX_CACHE_BLOCKS",
    "Counters",
    "Scheduler",
    "Sequence",
    "Step",
]

MAX_NUM_BATCHED_TOKENS = 8192
PREFIX_CACHE_BLOCKS = 50_000


@dataclass(eq=False)
class Sequence:
    """One sequence being generated: a request with n=2 has two of them sharing a prompt."""

    seq_id: str
    prompt_tokens: int
    max_tokens: int
    stop_after: int
    prefix_blocks: tuple[int, ...] = ()
    arrived_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    prefilled: int = 0
    cached_tokens: int = 0
    generated: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    last_token_at: float | None = None
    new_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV entries the sequence needs: prompt plus what it generated."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        """True once the sequence stopped, ran out of length, or was aborted."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class Step:
    """The plan of one engine step: who runs, what gets prefilled, and how long it takes."""

    duration: float
    decode: tuple[Sequence, ...]
    prefill: tuple[tuple[Sequence, int], ...]
    load: float

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed in this step."""
        return sum(n for _, n in self.prefill)


@dataclass
class Counters:
    """Monotonic totals, exported as the ``vllm:`` counters."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    iterations: int = 0


class Scheduler:
    """The waiting queue, the running batch and the KV-cache budget of one engine.

    ``keep_itl``: whether each sequence keeps every inter-token gap (``Sequence.itl``), as the
    simulator's histograms need; a replay reads a sequence's mean gap from its first and last
    token and keeps none.
    """

    def __init__(self, profile: EngineProfile, keep_itl: bool = True) -> None:
        self.profile = profile
        self.keep_itl = keep_itl
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = Counters()
        self._prefix_cache: OrderedDict[int, None] = OrderedDict()
        self._kv_blocks_total = profile.kv_cache_tokens // profile.block_size

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; it is admitted by a later ``plan()``."""
        self.waiting.append(seq)

    def abort(self, seq: Sequence, now: float) -> None:
        """Stop a sequence at once and free its slot, as vLLM does when a client goes away."""
        if seq.done:
            return
        seq.finish_reason = "abort"
        seq.finished_at = now
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def idle(self) -> bool:
        """True when there is nothing to run."""
        return not self.running and not self.waiting

    def kv_blocks_used(self) -> int:
        """KV-cache blocks held by running sequences (prompt + generated, rounded up)."""
        size = self.profile.block_size
        return sum(-(-(s.prompt_tokens + s.generated + 1) // size) for s in self.running)

    def kv_usage(self) -> float:
        """Share of the KV cache in use, as vllm:kv_cache_usage_perc reports it (0..1)."""
        return min(1.0, self.kv_blocks_used() / self._kv_blocks_total)

    def plan(self, now: float) -> Step | None:
        """Admit what fits at ``now`` and describe the next step; None when idle."""
        self._admit(now)
        if not self.running:
            return None
        self._preempt_if_full()
        budget = MAX_NUM_BATCHED_TOKENS
        decode: list[Sequence] = []
        prefill: list[tuple[Sequence, int]] = []
        for seq in self.running:
            remaining = seq.prompt_tokens + seq.generated - seq.prefilled - seq.cached_tokens
            if remaining > 0:
                chunk = min(remaining, budget)
                if chunk > 0:
                    prefill.append((seq, chunk))
                    budget -= chunk
            else:
                decode.append(seq)
                budget -= 1
        p = self.profile
        prefill_tokens = sum(n for _, n in prefill)
        batch = len(decode) + len(prefill)
        duration_ms = (
            p.step_base_ms
            + p.step_per_seq_ms * batch
            + 1000.0 * prefill_tokens / p.prefill_tokens_per_second
        )
        load = min(1.0, batch / p.max_num_seqs + prefill_tokens / MAX_NUM_BATCHED_TOKENS)
        return Step(duration_ms / 1000.0, tuple(decode), tuple(prefill), load)

    def commit(self, step: Step, now: float) -> list[Sequence]:
        """Apply a planned step that ended at ``now``; return the sequences given a token."""
        self.counters.iterations += 1
        emitted: list[Sequence] = []
        for seq, n in step.prefill:
            if seq.done:
                continue
            seq.prefilled += n
            if seq.prefilled + seq.cached_tokens >= seq.context_tokens:
                emitted.append(seq)
        emitted.extend(s for s in step.decode if not s.done)
        for seq in emitted:
            self._emit_token(seq, now)
        return emitted

    def advance(
        self, step: Step, now: float, until: float = math.inf
    ) -> tuple[float, list[Sequence]]:
        """Commit ``step`` (planned at ``now``) and the identical steps that follow it.

        Once every running sequence has its prompt computed, each step computes one token's KV
        entries for each of them and gives each its next token (a one-token chunk, or a decode).
        Such a step repeats unchanged until a sequence finishes, the KV cache needs a
        preemption, or the clock reaches ``until``: the next arrival, which its driver adds at
        the first step boundary at or after it. Those repeats are applied in one pass, as
        ``plan()`` and ``commit()`` one step at a time would apply them (the clock is summed
        once rather than step by step). Returns the clock after the last step and the
        sequences the last step gave a token.
        """
        repeats = self._repeats(step, now, until) if self._steady(step) else 1
        if repeats > 1:
            self._tokens_in_bulk(step, now, step.duration, repeats - 1)
            now += (repeats - 1) * step.duration
        end = now + step.duration
        return end, self.commit(step, end)

    @staticmethod
    def _steady(step: Step) -> bool:
        """True when every sequence of the step gets a token, as it will in the next step."""
        return all(
            n == 1 and s.context_tokens - s.prefilled - s.cached_tokens == 1
            for s, n in step.prefill
        )

    def _repeats(self, step: Step, now: float, until: float) -> int:
        """How many times a steady step runs before the batch or its timing changes."""
        d = step.duration
        if d <= 0 or not (step.decode or step.prefill) or self._may_admit():
            return 1
        seqs = [*step.decode, *(s for s, _ in step.prefill)]
        n = min(min(s.max_tokens, s.stop_after) - s.generated for s in seqs)
        if until != math.inf:
            n = min(n, math.ceil((until - now) / d))
        if len(self.running) > 1:
            # Before each repeat, plan() preempts unless every sequence's next block fits:
            # sum(ceil((context + j + 2) / size)) <= total blocks after j repeats. A bound on
            # the sum keeps this O(batch); near a full cache the steps go one at a time.
            size, k = self.profile.block_size, len(self.running)
            context = sum(s.context_tokens for s in self.running)
            room = (size * self._kv_blocks_total - context - k * (size - 1)) // k - 2
            n = min(n, room + 1)
        return max(1, n)

    def _may_admit(self) -> bool:
        """Whether the next plan() could admit the head of the queue.

        A sequence preempted by the plan just made waits at the head, and may be admitted and
        preempted again by each plan after (its count of preemptions grows): those steps go one
        at a time. Free blocks only shrink while no sequence finishes, so a head that does not
        fit now does not fit later.
        """
        if not self.waiting or len(self.running) >= self.profile.max_num_seqs:
            return False
        need = math.ceil((self.waiting[0].context_tokens + 1) / self.profile.block_size)
        return need <= self._kv_blocks_total - self.kv_blocks_used() or not self.running

    def _tokens_in_bulk(self, step: Step, now: float, d: float, k: int) -> None:
        """``k`` steady steps of ``d`` seconds from ``now``, none of which finishes a sequence."""
        last = now + k * d
        seqs = [*step.decode, *(s for s, _ in step.prefill)]
        for seq, _ in step.prefill:
            seq.prefilled += k
        for seq in seqs:
            if self.keep_itl:
                if seq.last_token_at is not None:  # none before its first token
                    seq.itl.append(now + d - seq.last_token_at)
                seq.itl.extend([d] * (k - 1))
            seq.generated += k
            seq.new_tokens += k
            seq.last_token_at = last
            if seq.first_token_at is None:
                seq.first_token_at = now + d
        self.counters.generation_tokens += k * len(seqs)
        self.counters.iterations += k

    def _emit_token(self, seq: Sequence, now: float) -> None:
        if seq.last_token_at is not None and self.keep_itl:
            seq.itl.append(now - seq.last_token_at)
        seq.generated += 1
        seq.new_tokens += 1
        seq.last_token_at = now
        if seq.first_token_at is None:
            seq.first_token_at = now
        self.counters.generation_tokens += 1
        if seq.generated >= seq.max_tokens:
            seq.finish_reason = "length"
        elif seq.generated >= seq.stop_after:
            seq.finish_reason = "stop"
        if seq.done:
            seq.finished_at = now
            self.running.remove(seq)
            self._remember_prefix(seq)

    def _admit(self, now: float) -> None:
        if not self.waiting or len(self.running) >= self.profile.max_num_seqs:
            return
        size = self.profile.block_size
        free = self._kv_blocks_total - self.kv_blocks_used()
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            seq = self.waiting[0]
            need = math.ceil((seq.context_tokens + 1) / size)
            if need > free and self.running:
                break
            self.waiting.popleft()
            free -= need
            if seq.admitted_at is None:
                seq.admitted_at = now
                self._lookup_prefix(seq)
            else:
                seq.prefilled = 0
            self.running.append(seq)

    def _preempt_if_full(self) -> None:
        """Recompute-preempt the newest sequences when decode would overflow the KV cache."""
        size = self.profile.block_size
        while len(self.running) > 1:
            # The blocks held plus one for each sequence whose next token opens a block:
            # ceil((context + 1) / size) + [(context + 1) % size == 0] = ceil((context + 2) / size).
            need = sum(-(-(s.prompt_tokens + s.generated + 2) // size) for s in self.running)
            if need <= self._kv_blocks_total:
                return
            victim = self.running.pop()
            victim.preemptions += 1
            victim.cached_tokens = 0
            self.counters.preemptions += 1
            self.waiting.appendleft(victim)

    def _lookup_prefix(self, seq: Sequence) -> None:
        hits = 0
        for block in seq.prefix_blocks:
            if block not in self._prefix_cache:
                break
            self._prefix_cache.move_to_end(block)
            hits += 1
        # vLLM always recomputes at least the last prompt token, so a full hit leaves one.
        seq.cached_tokens = min(hits * self.profile.block_size, seq.prompt_tokens - 1)
        # Like vLLM, each choice of an n>1 request counts its prompt again.
        self.counters.prompt_tokens += seq.prompt_tokens
        self.counters.prefix_cache_queries += seq.prompt_tokens
        self.counters.prefix_cache_hits += seq.cached_tokens

    def _remember_prefix(self, seq: Sequence) -> None:
        for block in seq.prefix_blocks:
            self._prefix_cache[block] = None
            self._prefix_cache.move_to_end(block)
        while len(self._prefix_cache) > PREFIX_CACHE_BLOCKS:
            self._prefix_cache.popitem(last=False)
