"""A month of a simulated fleet in virtual time, into a real ledger: the advisor's scenarios.

A ``Month`` names replica groups (how many instances each runs in every hour of the day, on what
GPUs, with what engine), and streams of requests (a team sending a model requests of one size,
Poisson at a rate for each hour of the day, optionally opening with a shared system prompt, streamed
or not). ``run`` simulates it: each instance is the engine model (``simulator.engine``: vLLM's
continuous batching, KV cache, preemption and prefix cache) on a virtual clock; each request goes
to the next of its model's serving instances in turn, as a Service's round robin spreads them;
prompts are tokens whose shared head has the same KV blocks in every request (vLLM's chained block
hashes) and the digest the sidecar gives it. An instance of a dynamic group is a pod with a
lifetime (start and stop events); one started after the month began pays ``startup_seconds`` of
GPU time before it serves. What comes out is what the sidecars and the collector would have sent
(usage, GPU samples every 10 minutes at 0 W, engine samples every 5 minutes with the engine's
KV-cache size), and, measured by the simulation itself, the fleet's GPU cost and each team's TTFT.

The advisor replays the ledger; a test checks its saving against ``run`` of the month again with
the change applied.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from billing.efficiency.store import Report, read_report
from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, Config, EngineProfile
from sidecar.prefix import PrefixDigester
from simulator.engine import Scheduler, Sequence as Seq
from simulator.text import prefix_block_hashes
from tests.billing.conftest import OCT, batch, gpu_samples, usage

NOW = OCT + 40 * 86400
DIGESTER = PrefixDigester(b"scenario-key", 2048)
HOUR, DAY = 3600.0, 86400.0
ENGINE_EVERY, GPU_EVERY = 300.0, 600.0


def month_config(slower: float = 1.0, **replicas: dict[str, Any]) -> Config:
    """The demo fleet with ``min_replicas`` 1, its engines ``slower`` times slower and its SLAs
    as much looser; ``replicas`` change replica groups (by id)."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["scaling"]["min_replicas"] = 1
    for engine in data["simulator"]["engines"].values():
        engine["step_base_ms"] *= slower
        engine["step_per_seq_ms"] = engine.get("step_per_seq_ms", 0.25) * slower
        engine["prefill_tokens_per_second"] /= slower
    for model in data["models"]:
        model["sla"]["ttft_p95_seconds"] *= slower
        model["sla"]["min_output_tokens_per_second"] /= slower
    for r in data["replicas"]:
        r.update(replicas.get(r["id"], {}))
    return Config.model_validate(data)


def hourly(night: float, day: float, start: int = 8, end: int = 20) -> tuple[float, ...]:
    """A value for each hour of the day: ``day`` from ``start`` to ``end``, ``night`` else."""
    return tuple(day if start <= h < end else night for h in range(24))


@dataclass(frozen=True)
class Stream:
    """One team's requests to a model: Poisson at ``per_hour[h]`` an hour in hour ``h`` (UTC)."""

    team: str
    model: str
    per_hour: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    head: str | None = None  # a system prompt every request of the stream opens with
    head_tokens: int = 0
    stream: bool = True


@dataclass(frozen=True)
class Group:
    """A replica group of the configuration: instances by the hour of the day, and its engines.

    A fixed group is the replica itself (one instance, all month); a dynamic one runs pods named
    ``<replica>-<k>`` with lifetimes.
    """

    replica: str
    counts: tuple[int, ...] = (1,) * 24
    dynamic: bool = False
    gpus: int | None = None  # GPUs per instance (default: the configuration's gpu_count)
    gpu_model: str | None = None
    max_num_seqs: int | None = None
    kv_cache_tokens: int | None = None
    prefix_caching: bool = False
    slower: float = 1.0  # its engines run this many times slower than the configuration says


@dataclass(frozen=True)
class Month:
    """A scripted month: groups, streams, and the seed of its arrivals."""

    groups: tuple[Group, ...]
    streams: tuple[Stream, ...]
    days: int = 30
    seed: int = 1
    # (team, model) -> (model, max prompt, max output): a team's short requests go elsewhere.
    routes: Mapping[tuple[str, str], tuple[str, int, int]] = field(default_factory=dict)
    # (team, model) -> {hour: hour}: a team's requests in an hour of the day sent later.
    moves: Mapping[tuple[str, str], Mapping[int, int]] = field(default_factory=dict)

    def group(self, replica: str) -> Group:
        """The group of replica ``replica``."""
        return next(g for g in self.groups if g.replica == replica)

    def with_group(self, replica: str, **changes: Any) -> Month:
        """The month with one group changed."""
        return replace(
            self,
            groups=tuple(replace(g, **changes) if g.replica == replica else g for g in self.groups),
        )


@dataclass
class _Request:
    team: str
    model: str
    t: float
    prompt: int
    completion: int
    stream: bool
    blocks: tuple[str, ...]  # the prompt's first tokens: the shared head, then its own
    digest: str | None
    share: float | None
    head_tokens: int = 0
    seq: Seq | None = None
    instance: str = ""


@dataclass
class _Instance:
    replica: str
    name: str | None  # None: the fixed replica itself
    model: str
    paid_from: float
    start: float
    end: float
    gpus: int
    gpu_model: str
    profile: EngineProfile
    caching: bool
    requests: list[_Request] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Outcome:
    """What a simulated month left: its ledger's report, its GPU cost and each team's TTFTs."""

    report: Report | None
    cost_usd: float
    hours: float
    ttft: dict[str, list[float]]
    itl: dict[str, list[float]]
    used: set[tuple[str, str]] = field(default_factory=set)  # (team, model) served

    def per_month(self, usd: float) -> float:
        """``usd`` over the month simulated, per month of 730 hours."""
        return usd * 730.0 / self.hours

    def ttft_p95(self, team: str) -> float:
        """A team's 95th-percentile TTFT, as the simulation measured it."""
        values = sorted(self.ttft[team])
        return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]


def _arrivals(month: Month) -> list[_Request]:
    rng = random.Random(month.seed)
    out: list[_Request] = []
    for s in month.streams:
        # One character a token, so a head of up to 1,000 tokens lies within the 2,048
        # characters the sidecar digests (``sidecar.prefix_digest_chars``).
        head = [s.head[j % len(s.head)] for j in range(s.head_tokens)] if s.head else []
        for day in range(month.days):
            for hour in range(24):
                rate, t = s.per_hour[hour], OCT + day * DAY + hour * HOUR
                while rate > 0:
                    t += rng.expovariate(rate / HOUR)
                    if t >= OCT + day * DAY + (hour + 1) * HOUR:
                        break
                    k = len(out)
                    own = [f"r{k}-{j}" for j in range(min(64, s.prompt_tokens - len(head)))]
                    prefix = None
                    if head:  # the sidecar digests the first message: the shared system prompt
                        rest = " ".join("u" * (s.prompt_tokens - len(head)))
                        prefix = DIGESTER.of(
                            {
                                "messages": [
                                    {"role": "system", "content": " ".join(head)},
                                    {"role": "user", "content": rest},
                                ]
                            }
                        )
                    out.append(
                        _Request(
                            s.team,
                            s.model,
                            t,
                            s.prompt_tokens,
                            s.completion_tokens,
                            s.stream,
                            tuple(head + own),
                            prefix.digest if prefix else None,
                            prefix.share if prefix else None,
                            len(head),
                        )
                    )
    return _moved(month, sorted(out, key=lambda r: r.t))


def _moved(month: Month, requests: list[_Request]) -> list[_Request]:
    for r in requests:
        route = month.routes.get((r.team, r.model))
        if route and r.prompt <= route[1] and r.completion <= route[2]:
            r.model = route[0]
        hours = month.moves.get((r.team, r.model), {})
        hod = int((r.t - OCT) // HOUR) % 24
        if hod in hours:
            r.t += ((hours[hod] - hod) % 24) * HOUR
    return sorted(requests, key=lambda r: r.t)


def _instances(config: Config, month: Month) -> list[_Instance]:
    out, startup, end = [], config.scaling.startup_seconds, OCT + month.days * DAY
    for g in month.groups:
        r = config.replica(g.replica)
        base = config.simulator.engine_for(r.model)
        profile = base.model_copy(
            update={
                "max_num_seqs": g.max_num_seqs or r.max_num_seqs or base.max_num_seqs,
                "kv_cache_tokens": g.kv_cache_tokens or base.kv_cache_tokens,
                "step_base_ms": base.step_base_ms * g.slower,
                "step_per_seq_ms": base.step_per_seq_ms * g.slower,
                "prefill_tokens_per_second": base.prefill_tokens_per_second / g.slower,
            }
        )
        for k in range(max(g.counts) if g.dynamic else 1):
            live = [g.counts[h % 24] > k for h in range(month.days * 24)]
            h = 0
            while h < len(live):
                if not live[h]:
                    h += 1
                    continue
                first = h
                while h < len(live) and live[h]:
                    h += 1
                start = OCT + first * HOUR
                name = f"{g.replica}-{k}" if g.dynamic else None
                out.append(
                    _Instance(
                        g.replica,
                        name if name is None else f"{name}-{first}",
                        r.model,
                        start - startup if first > 0 else start,
                        start,
                        min(end, OCT + h * HOUR),
                        g.gpus or r.gpu_count,
                        g.gpu_model or r.gpu_model,
                        profile,
                        g.prefix_caching,
                    )
                )
    return out


def _route(requests: list[_Request], instances: list[_Instance]) -> None:
    """Each request to the next serving instance of its model, in turn (a Service's round robin)."""
    by_model: dict[str, list[_Instance]] = defaultdict(list)
    for i in instances:
        by_model[i.model].append(i)
    turn: dict[str, int] = defaultdict(int)
    for r in requests:
        live = [i for i in by_model[r.model] if i.start <= r.t < i.end]
        if live:
            live[turn[r.model] % len(live)].requests.append(r)
            turn[r.model] += 1


def _sample(i: _Instance, sched: Scheduler, at: float) -> None:
    c = sched.counters
    i.samples.append(
        {
            "sample_id": f"e-{i.name or i.replica}-{at}",
            "replica": i.replica,
            "model": i.model,
            "timestamp": at,
            "requests_running": float(len(sched.running)),
            "requests_waiting": float(len(sched.waiting)),
            "kv_cache_usage": sched.kv_usage(),
            "prompt_tokens_total": float(c.prompt_tokens),
            "generation_tokens_total": float(c.generation_tokens),
            "prefix_cache_queries_total": float(c.prefix_cache_queries),
            "prefix_cache_hits_total": float(c.prefix_cache_hits),
            "preemptions_total": float(c.preemptions),
            "kv_cache_tokens": float(i.profile.kv_cache_tokens),
            "instance": i.name,
        }
    )


_HEADS: dict[tuple[tuple[str, ...], int], tuple[int, ...]] = {}


def _blocks(r: _Request, size: int) -> tuple[int, ...]:
    """vLLM's chained hashes of the prompt's whole blocks: those of its shared head (the same in
    every request that opens with it: hashed once). The blocks after the head are the request's
    own, found in no cache, so they are left out."""
    if not r.head_tokens:
        return prefix_block_hashes(r.blocks, size)[:1]
    head = r.blocks[: r.head_tokens]
    key = (head[:1] + head[-1:], len(head))
    if key not in _HEADS:
        _HEADS[key] = prefix_block_hashes(head, size)
    return _HEADS[key]


def _drive(i: _Instance) -> None:
    """The instance's engine through its requests, sampled every ``ENGINE_EVERY`` while it lives."""
    sched = Scheduler(i.profile, keep_itl=False)
    size = i.profile.block_size
    pending = i.requests
    t, k, next_sample = i.start, 0, i.start + ENGINE_EVERY
    while True:
        while k < len(pending) and pending[k].t <= t:
            r = pending[k]
            blocks = _blocks(r, size) if i.caching else ()
            r.seq = Seq(f"{k}", r.prompt, r.completion, r.completion, blocks, arrived_at=r.t)
            r.instance = i.name or i.replica
            sched.add(r.seq)
            k += 1
        step = sched.plan(t)
        until = min(pending[k].t if k < len(pending) else math.inf, next_sample)
        if step is None:
            if k >= len(pending) and next_sample >= i.end:
                break
            t = until
        else:
            t, _ = sched.advance(step, t, until)
        while next_sample <= t and next_sample < i.end:
            _sample(i, sched, next_sample)
            next_sample += ENGINE_EVERY


def _records(config: Config, instances: list[_Instance]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    gpu_index: dict[str, int] = defaultdict(int)
    for i in instances:
        node = config.replica(i.replica).node
        served = config.replica(i.replica).served_version or config.model(i.model).current_version
        for r in i.requests:
            s = r.seq
            assert s is not None
            assert s.finished_at is not None
            record = usage(
                r.team,
                r.t,
                s.finished_at - r.t,
                replica=i.replica,
                model=r.model,
                served_version=served,
                first_token_at=s.first_token_at,
                prompt_tokens=r.prompt,
                cached_prompt_tokens=s.cached_tokens,
                completion_tokens=s.generated,
                stream=r.stream,
                prefix_digest=r.digest,
                prefix_share=r.share,
            )
            out["usage"].append(record | ({"instance": i.name} if i.name else {}))
        out["engine_samples"] += i.samples
        for _ in range(i.gpus):
            n = gpu_index[node]
            gpu_index[node] += 1
            rows = gpu_samples(
                i.replica,
                start=i.paid_from,
                seconds=i.end - i.paid_from,
                every=GPU_EVERY,
                gpu_model=i.gpu_model,
                watts=0.0,
                node=node,
                gpu=str(n),
            )
            mine = {"model": i.model} | ({"instance": i.name} if i.name else {})
            out["gpu_samples"] += [s | mine for s in rows]
        if i.name:
            out["instances"] += _lifetime(i, node)
    return out


def _lifetime(i: _Instance, node: str) -> list[dict[str, Any]]:
    common = {
        "instance": i.name,
        "replica": i.replica,
        "model": i.model,
        "started_at": i.start,
        "node": node,
        "gpu_model": i.gpu_model,
        "gpu_count": i.gpus,
        "gpus": ",".join(f"GPU-{i.name}-{g}" for g in range(i.gpus)),
    }
    return [
        common
        | {"event_id": f"{round(t * 1000):013d}/{i.name}/{kind}", "event": kind, "timestamp": t}
        for kind, t in (("start", i.start), ("stop", i.end))
    ]


def run(config: Config, month: Month, ledger: Ledger | None = None) -> Outcome:
    """Simulate ``month`` on ``config``'s fleet; with ``ledger``, ingest it and read October's report."""
    requests = _arrivals(month)
    instances = _instances(config, month)
    _route(requests, instances)
    for i in instances:
        _drive(i)
    cost = sum(
        (i.end - i.paid_from) / HOUR * i.gpus * config.prices.usd_per_gpu_hour[i.gpu_model]
        for i in instances
    )
    ttft: dict[str, list[float]] = defaultdict(list)
    itl: dict[str, list[float]] = defaultdict(list)
    used = {(r.team, r.model) for r in requests}
    for r in requests:
        s = r.seq
        assert s is not None, r
        assert s.first_token_at is not None, r
        assert s.finished_at is not None, r
        ttft[r.team].append(s.first_token_at - r.t)
        if s.generated > 1:
            itl[r.team].append((s.finished_at - s.first_token_at) / (s.generated - 1))
    report = None
    if ledger is not None:
        for kind, rows in _records(config, instances).items():
            for k in range(0, len(rows), 50_000):
                result = ledger.ingest(batch(kind, rows[k : k + 50_000]), now=NOW)
                assert result.rejected == [], result.rejected[:3]
        with ledger.reader() as cursor:
            report = read_report(cursor, config, "2026-10", NOW)
    return Outcome(report, cost, month.days * 24.0, dict(ttft), dict(itl), used)


def engines_of(report: Report, model: str) -> Sequence[int | None]:
    """The engines by the hour a report's capacity change for ``model`` sets."""
    for r in report.recommendations:
        for key in ("engines_by_hour", f"{model}.engines_by_hour"):
            if r.model == model and key in r.change:
                return list(r.change[key])
    return []
