"""Fleet scenarios run through the simulator's engine model in virtual time, into a real ledger.

A scenario names which replica groups run on which GPU type, and streams of requests: a team
sending one request every few seconds to a model, each alike in size, optionally opening with a
shared system prompt. Each engine is ``simulator.engine.Scheduler`` (vLLM's continuous batching,
KV cache and prefix cache) driven by a virtual clock; prompts are rendered and tokenized as the
simulated replica does (``simulator.text``) and digested as the sidecar does (``sidecar.prefix``).
What comes out is what the sidecar and the collector would have sent: one usage record per
request, an engine sample a minute per engine and a GPU sample a minute per GPU (at 0 W, so a
group's cost is its GPU-hours at the price book's rate). The ledger then answers the advisor.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from billing.efficiency.store import Report, read_report
from billing.ledger import Ledger
from infermeter.config import Config
from sidecar.prefix import PrefixDigester
from simulator.engine import Scheduler, Sequence as Seq
from simulator.text import chat_prompt_text, prefix_block_hashes, tokenize
from tests.billing.conftest import OCT, batch, gpu_samples, usage

START = OCT + 3600  # 01:00 on 2026-10-01
NOW = OCT + 40 * 86400
DIGESTER = PrefixDigester(b"scenario-key", 2048)
_ids = itertools.count()


@dataclass(frozen=True)
class Stream:
    """One team's requests to a model: one every ``every_seconds``, all of one size."""

    team: str
    model: str
    every_seconds: float
    user_words: int
    completion_tokens: int
    system_words: int = 0  # a system prompt every request of the stream shares (0: none)
    offset_seconds: float = 0.0
    until_seconds: float | None = None  # the last request is sent before this (None: the end)
    stream: bool = True  # whether the client streams the answer (a batch job does not)

    def messages(self, k: int) -> list[dict[str, object]]:
        """The ``k``-th request's chat messages: the shared system prompt, then its own question."""
        question = " ".join(f"q{k}w{j}" for j in range(self.user_words))
        system = " ".join(f"rule{j}" for j in range(self.system_words))
        head: list[dict[str, object]] = [{"role": "system", "content": system}]
        return [*(head if self.system_words else []), {"role": "user", "content": question}]

    def prompt_tokens(self, k: int) -> int:
        """The prompt's tokens as the simulated engine counts them."""
        return len(tokenize(chat_prompt_text(self.messages(k))))


@dataclass(frozen=True)
class Scenario:
    """Replica groups (id -> GPU type they run on), the streams, and whether prefixes are cached."""

    replicas: Mapping[str, str]
    streams: tuple[Stream, ...]
    hours: int = 1
    prefix_caching: bool = False
    # Streams of a model go to its replicas in turn; this sends a model's requests elsewhere.
    routes: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (team, model) -> model

    def arrivals(self, stream: Stream) -> list[float]:
        """When the stream's requests arrive: evenly, stopping two minutes before the end."""
        end = START + self.hours * 3600 - 120
        if stream.until_seconds is not None:
            end = min(end, START + stream.until_seconds)
        times, t = [], START + stream.offset_seconds
        while t < end:
            times.append(t)
            t += stream.every_seconds
        return times


@dataclass
class _Engine:
    replica: str
    model: str
    scheduler: Scheduler
    pending: list[tuple[float, Seq, dict[str, Any]]] = field(default_factory=list)
    finished: list[tuple[Seq, dict[str, Any]]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


def _engines(config: Config, scenario: Scenario) -> dict[str, _Engine]:
    out = {}
    for rid in scenario.replicas:
        r = config.replica(rid)
        profile = config.simulator.engine_for(r.model)
        profile = profile.model_copy(
            update={"max_num_seqs": r.max_num_seqs or profile.max_num_seqs}
        )
        out[rid] = _Engine(rid, r.model, Scheduler(profile))
    return out


def _queue(config: Config, scenario: Scenario, engines: dict[str, _Engine]) -> None:
    """Every request of every stream, on the replicas of the model it goes to, in turn."""
    turn: dict[str, itertools.cycle[str]] = {}
    for model in {e.model for e in engines.values()}:
        turn[model] = itertools.cycle(sorted(r for r, e in engines.items() if e.model == model))
    block = {r: e.scheduler.profile.block_size for r, e in engines.items()}
    for s in scenario.streams:
        model = scenario.routes.get((s.team, s.model), s.model)
        for k, t in enumerate(scenario.arrivals(s)):
            rid = next(turn[model])
            tokens = tokenize(chat_prompt_text(s.messages(k)))
            blocks = prefix_block_hashes(tokens, block[rid]) if scenario.prefix_caching else ()
            seq = Seq(f"s{next(_ids)}", len(tokens), s.completion_tokens, s.completion_tokens,
                      blocks, arrived_at=t)  # fmt: skip
            prefix = DIGESTER.of({"messages": s.messages(k)})
            meta = {"team": s.team, "model": model, "stream": s.stream,
                    "prefix_digest": prefix.digest if prefix else None,
                    "prefix_share": prefix.share if prefix else None}  # fmt: skip
            engines[rid].pending.append((t, seq, meta))
    for e in engines.values():
        e.pending.sort(key=lambda p: p[0])


def _sample(e: _Engine, at: float) -> None:
    c, sch = e.scheduler.counters, e.scheduler
    e.samples.append({
        "sample_id": f"e-{next(_ids)}", "replica": e.replica, "model": e.model, "timestamp": at,
        "requests_running": float(len(sch.running)), "requests_waiting": float(len(sch.waiting)),
        "kv_cache_usage": sch.kv_usage(), "prompt_tokens_total": float(c.prompt_tokens),
        "generation_tokens_total": float(c.generation_tokens),
        "prefix_cache_queries_total": float(c.prefix_cache_queries),
        "prefix_cache_hits_total": float(c.prefix_cache_hits), "preemptions_total": float(c.preemptions),
    })  # fmt: skip


def _run(e: _Engine, end: float) -> None:
    """Drive one engine through its arrivals in virtual time, sampling it at :30 of every minute."""
    t, i, owners = START, 0, {}
    next_sample = START + 30
    while True:
        while i < len(e.pending) and e.pending[i][0] <= t:
            _, seq, meta = e.pending[i]
            e.scheduler.add(seq)
            owners[id(seq)] = (seq, meta)
            i += 1
        step = e.scheduler.plan(t)
        if step is None:
            if i >= len(e.pending):
                break
            t = e.pending[i][0]
        else:
            t += step.duration
            e.scheduler.commit(step, t)
            for seq in [*step.decode, *(s for s, _ in step.prefill)]:
                if seq.done and id(seq) in owners:
                    e.finished.append(owners.pop(id(seq)))
        while next_sample <= t and next_sample < end:
            _sample(e, next_sample)
            next_sample += 60
    while next_sample < end:
        _sample(e, next_sample)
        next_sample += 60


def _usage(e: _Engine, seq: Seq, meta: dict[str, Any], served: str) -> dict[str, Any]:
    assert seq.finished_at is not None
    return usage(meta["team"], seq.arrived_at, seq.finished_at - seq.arrived_at,
                 replica=e.replica, model=meta["model"], served_version=served,
                 first_token_at=seq.first_token_at, prompt_tokens=seq.prompt_tokens,
                 cached_prompt_tokens=seq.cached_tokens, completion_tokens=seq.generated,
                 prefix_digest=meta["prefix_digest"], prefix_share=meta["prefix_share"],
                 stream=meta["stream"])  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """What a scenario left in the ledger, and its month's report."""

    report: Report
    usage: Sequence[dict[str, Any]]

    def cost_usd(self, model: str | None = None) -> float:
        """The GPU cost the report's groups measured (of one model, or all)."""
        rows = self.report.groups.iter_rows(named=True)
        return float(sum(r["cost_usd"] for r in rows if model is None or r["model"] == model))


def run(ledger: Ledger, config: Config, scenario: Scenario) -> Outcome:
    """Run ``scenario`` into ``ledger`` and read October's report."""
    engines = _engines(config, scenario)
    _queue(config, scenario, engines)
    end = START + scenario.hours * 3600
    records: list[dict[str, Any]] = []
    gpus: list[dict[str, Any]] = []
    engine_samples: list[dict[str, Any]] = []
    for rid, e in engines.items():
        _run(e, end)
        served = config.replica(rid).served_version or config.model(e.model).current_version
        records += [_usage(e, seq, meta, served) for seq, meta in e.finished]
        engine_samples += e.samples
        for g in range(config.replica(rid).gpu_count):
            gpus += gpu_samples(rid, start=START, seconds=scenario.hours * 3600, every=60,
                                gpu_model=scenario.replicas[rid], watts=0.0, node=f"node-{rid}",
                                gpu=str(g))  # fmt: skip
    for kind, rows in (
        ("usage", records),
        ("gpu_samples", gpus),
        ("engine_samples", engine_samples),
    ):
        result = ledger.ingest(batch(kind, rows), now=NOW)
        assert result.rejected == [], result.rejected
    with ledger.reader() as cursor:
        report = read_report(cursor, config, "2026-10", NOW)
    return Outcome(report, records)


def by_kind(outcome: Outcome, kind: str) -> list[Any]:
    """The report's recommendations of one kind."""
    return [r for r in outcome.report.recommendations if r.kind == kind]


def requests_of(outcome: Outcome) -> dict[tuple[str, str], int]:
    """Finished requests per (team, model)."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for r in outcome.usage:
        counts[(r["team"], r["model"])] += 1
    return dict(counts)


def with_replicas(scenario: Scenario, replicas: Mapping[str, str]) -> Scenario:
    """The same scenario on other replica groups."""
    return replace(scenario, replicas=dict(replicas))
