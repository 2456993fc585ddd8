"""The scrape loop: read every target, join GPUs to replicas, account energy, hand on samples.

``FleetCollector.scrape_once`` is one round: every target that is due is read concurrently,
each under the scrape timeout. A target that fails (down, slow, garbage, no NVML, or a page
its source raised an unforeseen error on) is marked down with its one-line reason; the other
targets and the loop go on. How soon it is tried again depends on what the failure cost: one
that came back at once (a refused connection, an HTTP error, a page that is not the exporter's)
is tried again next round, because it cost the round nothing and an engine that is starting
answers so until its server listens, and the first reading of a new engine is the baseline
reconciliation counts from; one that held a scrape slot for half the timeout or more backs off,
doubling, up to ``max_backoff_seconds``. The latest joined view (GPU and engine samples, target
states, running energy totals) stays on the object for /metrics to read.

Two clocks: intervals (a GPU's time between readings, when a target is due) are measured on the
monotonic clock, the wall clock only stamps samples and the restart baseline, which outlives the
process. Measured on the wall clock, an NTP step back lost an interval's energy and GPU time (the
baseline moved to a reading "before" it), and a step forward past the gap limit made a measured
interval a gap billed for seconds that never were.

Engine targets come and go while the loop runs (``replace_engine_sources``, fed by discovery): a
target that vanished takes its state (up/down, back-off, latest sample) with it, and so does a
pod that left a GPU, so memory stays bounded however many instances have come and gone. A GPU
or MIG slice its node's page left out for longer than the gap limit is forgotten the same way,
and measured afresh if it comes back (``collectors.presence``): its absence is no gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from collectors.attribution import Owner, Placements, owner_of
from collectors.baseline import BaselineFile, shifted
from collectors.energy import Energy, Point, interval_energy, next_baseline
from collectors.presence import Key, absences, listed_keys
from collectors.sources import (
    EngineReading,
    EngineSource,
    GpuReading,
    GpuSource,
    ScrapeError,
    screen_gpu_readings,
)
from infermeter.boards import (
    POWER_MARGIN,
    UNKNOWN_BOARD_WATTS,
    board_key,
    configured_watts,
    max_watts,
)
from infermeter.config import Config
from infermeter.ids import sample_id
from infermeter.records import EngineSample, GpuSample
from infermeter.spool import SpoolError

__all__ = [
    "SLOW_FAILURE_SHARE",
    "Batch",
    "FleetCollector",
    "Sink",
    "TargetState",
    "backoff_seconds",
    "board_homes",
]

log = logging.getLogger("infermeter.collectors")


# A failed read that took at least this share of the scrape timeout is slow: it backs off.
SLOW_FAILURE_SHARE: Final = 0.5


def backoff_seconds(failures: int, interval_seconds: float, max_seconds: float) -> float:
    """Wait before retrying a target after ``failures`` failures in a row: doubling, capped."""
    if failures <= 0:
        return 0.0
    return min(max_seconds, interval_seconds * 2.0 ** (failures - 1))


@dataclass
class TargetState:
    """How one target fared: up or down, why, and when it is next due.

    ``failures`` counts the failures in a row; ``slow_failures`` those of them that held a
    scrape slot (the back-off grows with these only). ``next_attempt`` is on the collector's
    monotonic clock, so a wall-clock step neither lengthens nor cuts a back-off.
    """

    target: str
    kind: str
    up: bool = False
    failures: int = 0
    slow_failures: int = 0
    next_attempt: float = 0.0
    last_error: str | None = None
    scrape_seconds: float = 0.0
    errors_total: int = 0
    # Values a page gave that could not be true (``screen_gpu_readings``), and the first of the
    # last round's, so a target that starts or stops sending them is logged once, not per round.
    refused_values_total: int = 0
    refusing: str | None = None
    # Boards (UUIDs) the target reported that were sampled under another target, and last
    # round's, with the node each went to, so a change is logged once (``board_homes``).
    duplicate_gpus_total: int = 0
    duplicates: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stamp:
    """When a target was read: wall time for the samples, monotonic time for intervals."""

    wall: float
    monotonic: float


@dataclass(frozen=True)
class Batch:
    """The samples one round produced."""

    gpus: list[GpuSample] = field(default_factory=list)
    engines: list[EngineSample] = field(default_factory=list)


Sink = Callable[[Batch], Awaitable[None]]


class FleetCollector:
    """Scrapes GPU and engine sources and keeps the joined fleet view."""

    def __init__(
        self,
        config: Config,
        gpu_sources: Sequence[GpuSource],
        engine_sources: Sequence[EngineSource],
        clock: Callable[[], float] = time.time,
        max_concurrent_scrapes: int = 32,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` stamps samples (wall time); ``monotonic`` measures intervals and back-off."""
        self.config = config
        self.settings = config.collector
        self.gpu_sources = list(gpu_sources)
        self.engine_sources = list(engine_sources)
        self.clock = clock
        self.monotonic = monotonic
        sources: list[GpuSource | EngineSource] = [*self.gpu_sources, *self.engine_sources]
        self.states = {(s.target, s.kind): TargetState(s.target, s.kind) for s in sources}
        self.gpus: dict[str, list[GpuSample]] = {}
        # The latest sample of each engine, by its target key (instance id, else replica id).
        self.engines: dict[str, EngineSample] = {}
        self.gpu_energy_joules: dict[tuple[str, str], float] = {}
        self.replica_energy_joules: dict[str, float] = {}
        self.gaps_total = 0
        self.round_errors_total = 0
        self.sink_errors_total = 0
        self.rounds = 0
        # Each GPU's last reading, its time on the ``monotonic`` clock; those whose GPU a page
        # read since left out are ``_missing``, and forgotten past the gap limit
        # (``collectors.presence``).
        self._last: dict[Key, Point] = {}
        self._missing: set[Key] = set()
        # Where each GPU's last reading is kept across restarts (``collectors.baseline``).
        self.baseline: BaselineFile | None = None
        # Owner of each (GPU, pod) seen in the last round of each GPU target: rebuilt every round,
        # so the pods that have come and gone on a GPU are forgotten.
        self._owners: dict[str, dict[tuple[tuple[str, str, str], str | None], Owner]] = {}
        # The instances discovery found, which GPUs are joined to by their pod labels (None: no
        # discovery, the configuration and the pod-name rule; ``collectors.attribution``).
        self.placements: Placements | None = None
        # The pod-name rule for pods discovery has not placed (yet): all but Kubernetes discovery.
        self._name_rule = config.collector.discovery != "kubernetes"
        # What each board can draw (W), by ``board_key``: billing holds samples to it, so the
        # collector holds its readings to it too (``_gpu_samples``).
        self._board_watts = max_watts(configured_watts(config))
        # httpx's connection pool does work in proportion to its connections on every request,
        # so a round of 128 scrapes at once cost more CPU than the parsing (docs/benchmarks.md).
        self._limit = asyncio.Semaphore(max_concurrent_scrapes)

    @property
    def gap_seconds(self) -> float:
        """An interval longer than this between two readings of a GPU is a gap."""
        return self.settings.gap_after_intervals * self.settings.scrape_interval_seconds

    async def run(self, sink: Sink | None = None, rounds: int | None = None) -> None:
        """Scrape every interval, forever (or ``rounds`` times); nothing raises out of it."""
        interval = self.settings.scrape_interval_seconds
        loop = asyncio.get_running_loop()
        next_round = loop.time()
        done = 0
        while rounds is None or done < rounds:
            before = dict(self._last)
            try:
                batch = await self.scrape_once()
            except Exception:
                # A bug in one round must not stop GPU telemetry for the fleet: log it with its
                # traceback, count it, and try again next round.
                log.exception("collector round failed")
                self.round_errors_total += 1
                batch = Batch()
            if sink is not None and (batch.gpus or batch.engines):
                await self._deliver(sink, batch, before)
            done += 1
            next_round += interval
            await asyncio.sleep(max(0.0, next_round - loop.time()))

    def restore(self, baseline: BaselineFile, now: float) -> None:
        """Take each GPU's last reading from ``baseline``, and keep it there from now on.

        ``now`` is wall time: the file's readings are (no monotonic clock outlives a process),
        moved onto this process's monotonic clock as they are taken.
        """
        self.baseline = baseline
        for key, point in shifted(baseline.read(now), self.monotonic() - now).items():
            self._last.setdefault(key, point)

    async def _deliver(
        self, sink: Sink, batch: Batch, before: dict[Key, Point] | None = None
    ) -> None:
        """Spool ``batch``; ``before``: each GPU's last reading before the round made it. A
        batch that cannot be spooled puts them back, so the next round measures its GPUs from
        what was last spooled: the interval lost with the batch is in the next one (or a gap
        past the gap limit), never billed by no one."""
        try:
            await sink(batch)
        except (SpoolError, OSError, ValueError) as exc:
            self.sink_errors_total += 1
            log.error(
                "collector could not spool %d samples: %s",
                len(batch.gpus) + len(batch.engines),
                exc,
            )
            if before is not None:
                self._last = before
            return
        # Only once the samples are on disk: the next start measures from what was spooled.
        # A GPU the last page left out is not kept: the next process could not tell its
        # absence from its own restart, and would bill it as a gap.
        if self.baseline is not None and batch.gpus:
            kept = {k: p for k, p in self._last.items() if k not in self._missing}
            await self.baseline.save(shifted(kept, self.clock() - self.monotonic()))

    async def scrape_once(self) -> Batch:
        """One round over every due target; returns the new samples."""
        now = self.monotonic()
        gpu_due = [s for s in self.gpu_sources if self._due(s.target, s.kind, now)]
        engine_due = [s for s in self.engine_sources if self._due(s.target, s.kind, now)]
        results = await asyncio.gather(
            *(self._read(s) for s in gpu_due), *(self._read(s) for s in engine_due)
        )
        self.rounds += 1
        batch = Batch()
        read = {
            s.target: result[1]
            for s, result in zip(gpu_due, results[: len(gpu_due)], strict=True)
            if result is not None and isinstance(result[1], list)
        }
        homes = board_homes(read, self._board_holders())
        self._follow(homes)
        stamps = {
            s.target: result[0].monotonic
            for s, result in zip(gpu_due, results[: len(gpu_due)], strict=True)
            if result is not None
        }
        self._forget_absent(stamps, listed_keys((r for rs in read.values() for r in rs), homes))
        for source, result in zip(gpu_due, results[: len(gpu_due)], strict=True):
            if result is not None:
                assert isinstance(result[1], list)
                kept = [r for r in result[1] if homes.get(r.uuid, source.target) == source.target]
                self._note_duplicates(source, result[1], homes)
                readings, refused = screen_gpu_readings(kept)
                batch.gpus.extend(self._gpu_samples(source.target, result[0], readings, refused))
                self._note_refused(source, refused)
            else:
                self.gpus.pop(source.target, None)
        for esource, result in zip(engine_due, results[len(gpu_due) :], strict=True):
            if result is not None:
                assert isinstance(result[1], EngineReading)
                sample = self._engine_sample(esource, result[0], result[1])
                if sample is not None:
                    batch.engines.append(sample)
            else:
                self.engines.pop(esource.target, None)
        return batch

    def place(self, placements: Placements) -> None:
        """Join GPUs to these instances from the next round on (discovery found them).

        The owners kept per GPU and pod are forgotten: a GPU first seen before its pod was
        discovered is looked up again, not left with the platform.
        """
        self.placements = placements
        self._owners.clear()

    def replace_engine_sources(self, sources: Sequence[EngineSource]) -> None:
        """Scrape these engines from the next round on; the state of vanished ones is dropped.

        A source whose target stays keeps its state (a target that is down stays backed off).
        """
        self.engine_sources = list(sources)
        everyone: list[GpuSource | EngineSource] = [*self.gpu_sources, *self.engine_sources]
        keep = {(s.target, s.kind) for s in everyone}
        for key in keep - self.states.keys():
            self.states[key] = TargetState(*key)
        for key in self.states.keys() - keep:
            del self.states[key]
        current = {s.target for s in self.engine_sources}
        for target in self.engines.keys() - current:
            del self.engines[target]

    def _due(self, target: str, kind: str, now: float) -> bool:
        state = self.states.get((target, kind))
        return state is None or state.next_attempt <= now

    async def _read(
        self, source: GpuSource | EngineSource
    ) -> tuple[Stamp, list[GpuReading] | EngineReading] | None:
        # A source replaced while its read was queued still reports to a state of its own,
        # one nobody keeps once the round is over.
        state = self.states.get((source.target, source.kind)) or TargetState(
            source.target, source.kind
        )
        started = time.perf_counter()  # reset once a concurrency slot is free
        timeout = self.settings.scrape_timeout_seconds
        try:
            async with self._limit:
                started = time.perf_counter()
                reading: list[GpuReading] | EngineReading = await asyncio.wait_for(
                    source.read(), timeout
                )
        except (ScrapeError, TimeoutError) as exc:
            reason = str(exc) if isinstance(exc, ScrapeError) else f"no answer within {timeout:g} s"
            slow = time.perf_counter() - started >= SLOW_FAILURE_SHARE * timeout
            self._mark_down(state, reason, slow)
            return None
        except Exception as exc:
            # A source that fails in a way it did not foresee (a page its parser chokes on) is
            # that target's failure, not the round's: raised out of the gather, it would cost
            # every node's and engine's samples for as long as the page is served. The
            # traceback is logged once per new reason, as the reason itself is.
            reason = f"unreadable: {type(exc).__name__}: {exc}"[:300]
            slow = time.perf_counter() - started >= SLOW_FAILURE_SHARE * timeout
            self._mark_down(state, reason, slow, exc)
            return None
        finally:
            state.scrape_seconds = time.perf_counter() - started
        if not state.up:
            log.info("%s target %s is up", state.kind, state.target)
        state.up, state.failures, state.slow_failures = True, 0, 0
        state.last_error, state.next_attempt = None, 0.0
        return Stamp(self.clock(), self.monotonic()), reading

    def _mark_down(
        self, state: TargetState, reason: str, slow: bool, unexpected: BaseException | None = None
    ) -> None:
        """Down with ``reason``; a ``slow`` failure backs off, a quick one is due next round.

        ``unexpected`` is an error the source did not turn into a ScrapeError: its traceback
        goes with the log line, which says where the source must learn to refuse such a page.
        """
        if state.up or state.failures == 0 or reason != state.last_error:
            log.warning(
                "%s target %s is down: %s",
                state.kind,
                state.target,
                reason,
                exc_info=unexpected,
            )
        state.up = False
        state.failures += 1
        state.slow_failures = state.slow_failures + 1 if slow else 0
        state.errors_total += 1
        state.last_error = reason
        wait = backoff_seconds(
            state.slow_failures,
            self.settings.scrape_interval_seconds,
            self.settings.max_backoff_seconds,
        )
        # Due again one interval early, so the next round that falls after the wait picks it up.
        state.next_attempt = self.monotonic() + wait - self.settings.scrape_interval_seconds

    def _board_holders(self) -> dict[str, str]:
        """The node each board UUID's last reading is kept under."""
        return {uuid: node for node, uuid, _ in self._last if uuid}

    def _follow(self, homes: Mapping[str, str]) -> None:
        """Move each board's last readings to the node it is sampled under this round.

        Its counter is one, whichever URL it was read through, so the interval goes on from the
        reading before; left under the other node, that reading would one day start an interval
        overlapping what this node billed.
        """
        for key in [k for k in self._last if k[1] in homes and homes[k[1]] != k[0]]:
            point = self._last.pop(key)
            self._last.setdefault((homes[key[1]], key[1], key[2]), point)

    def _forget_absent(self, stamps: Mapping[str, float], listed: set[Key]) -> None:
        """Forget the readings of GPUs left out of a page read past the gap limit; note the rest.

        ``stamps``: when each node whose page was read this round was read (monotonic);
        ``listed``: what those pages listed. The other nodes' readings are left as they are.
        """
        held: dict[str, dict[Key, Point]] = {}
        for key, point in self._last.items():
            if key[0] in stamps:
                held.setdefault(key[0], {})[key] = point
        missing = {k for k in self._missing if k[0] not in stamps and k in self._last}
        for node, points in held.items():
            forget, gone = absences(points, listed, self._missing, stamps[node], self.gap_seconds)
            for key in forget:
                del self._last[key]
            missing |= gone
        self._missing = missing

    def _note_duplicates(
        self, source: GpuSource, readings: list[GpuReading], homes: Mapping[str, str]
    ) -> None:
        """Count the boards a target reported that are sampled under another; log on a change."""
        state = self.states.get((source.target, source.kind))
        if state is None:
            return
        elsewhere = {
            r.uuid: homes[r.uuid]
            for r in readings
            if homes.get(r.uuid, source.target) != source.target
        }
        state.duplicate_gpus_total += len(elsewhere)
        if elsewhere and elsewhere != state.duplicates:
            log.warning(
                "%s target %s reports GPUs another target reports too, sampled there only: %s",
                state.kind,
                state.target,
                ", ".join(f"{uuid} (under {node})" for uuid, node in sorted(elsewhere.items())),
            )
        elif not elsewhere and state.duplicates:
            log.info("%s target %s reports no other target's GPUs again", state.kind, state.target)
        state.duplicates = elsewhere

    def _note_refused(self, source: GpuSource, refused: list[str]) -> None:
        """Count the values refused in a target's page; log when it starts or stops sending them."""
        state = self.states.get((source.target, source.kind))
        if state is None:
            return
        state.refused_values_total += len(refused)
        first = refused[0] if refused else None
        if first is not None and state.refusing is None:
            log.warning(
                "%s target %s sends values that cannot be true, refused: %s%s",
                state.kind,
                state.target,
                ", ".join(refused[:4]),
                f" and {len(refused) - 4} more" if len(refused) > 4 else "",
            )
        elif first is None and state.refusing is not None:
            log.info("%s target %s sends believable values again", state.kind, state.target)
        state.refusing = first

    def _gpu_samples(
        self, target: str, stamp: Stamp, readings: list[GpuReading], refused: list[str]
    ) -> list[GpuSample]:
        """One sample per reading, joined to its owner.

        A board several pods share by time-slicing is read once per pod (dcgm-exporter repeats it
        with each pod's labels): its interval is measured once and each pod's sample stands for
        an equal part of it (``share``, power and energy), so the board counts once.

        Each reading is held to what its board can draw (``infermeter.boards``, as billing holds
        the samples): a power above it leaves the GPU out of the round, as a NaN does, and a
        counter increase above it over the interval is measured from power; either is appended
        to ``refused``. Shipped as read, billing refused the sample, and its GPU time was no
        one's, idle capacity included.
        """
        node = next((n for n in self.config.nodes if n.name == target), None)
        t = stamp.wall
        out = []
        owners = self._owners.get(target, {})
        seen: dict[tuple[tuple[str, str, str], str | None], Owner] = {}
        holders = Counter(r.key for r in readings)
        measured: dict[tuple[str, str, str], Energy] = {}
        boards = _board_readings(self._last, [r for r in readings if r.key not in self._last])
        for r in readings:
            owner = seen[(r.key, r.pod)] = owners.get((r.key, r.pod)) or owner_of(
                r, self.config.replicas, self.placements, self._name_rule
            )
            replica = owner.replica
            gpu_model = replica.gpu_model if replica else (node.gpu_model if node else None)
            gpu_model = gpu_model or r.model_name
            most = self._board_watts.get(board_key(gpu_model), UNKNOWN_BOARD_WATTS)
            most *= 1 + POWER_MARGIN
            if r.power_watts > most * r.share:
                refused.append(
                    f"{r.node}/{r.slot} power_watts={r.power_watts!r} (over the {most:g} W "
                    f"{gpu_model or 'a board'} can draw)"
                )
                continue
            energy = measured.get(r.key)
            if energy is None:
                point = Point(stamp.monotonic, r.power_watts, r.energy_mj)
                previous = self._last.get(r.key) or _slice_start(boards.get(r.key[:2]), point)
                energy = measured[r.key] = interval_energy(
                    previous, point, self.gap_seconds, r.share, most
                )
                if energy.counter_refused:
                    # Not believed, the counter starts no interval: the next is measured from
                    # power too, then the counter takes over again from the reading after.
                    refused.append(
                        f"{r.node}/{r.slot} energy_mj={r.energy_mj!r} (an increase over "
                        f"{energy.interval_seconds:g} s more than {gpu_model or 'a board'} "
                        "can draw)"
                    )
                    point = Point(point.t, point.power_watts, None)
                self._last[r.key] = next_baseline(self._last.get(r.key), point)
                if energy.gap:
                    self.gaps_total += 1
            part = 1.0 / holders[r.key]
            joules = None if energy.joules is None else energy.joules * part
            if joules:
                gkey = (r.node, r.slot)
                self.gpu_energy_joules[gkey] = self.gpu_energy_joules.get(gkey, 0.0) + joules
                if replica is not None:
                    self.replica_energy_joules[replica.id] = (
                        self.replica_energy_joules.get(replica.id, 0.0) + joules
                    )
            # A shared board's samples differ by pod only: the pod is part of their ids.
            sharer = (r.pod or "-",) if holders[r.key] > 1 else ()
            out.append(
                GpuSample(
                    sample_id=sample_id(t, r.node, r.uuid, r.mig_instance or "-", *sharer),
                    node=r.node,
                    gpu=r.slot,
                    uuid=r.uuid,
                    gpu_model=gpu_model,
                    replica=replica.id if replica else None,
                    model=replica.model if replica else None,
                    instance=owner.instance,
                    timestamp=t,
                    interval_seconds=energy.interval_seconds,
                    utilization=r.utilization,
                    power_watts=r.power_watts * part,
                    energy_joules=joules,
                    memory_used_mib=r.memory_used_mib,
                    memory_free_mib=r.memory_free_mib,
                    xid_errors=r.xid_errors,
                    mig_profile=r.mig_profile,
                    gap=energy.gap,
                    share=r.share * part,
                )
            )
        self.gpus[target] = out
        # A board's owner is looked up once per pod it is seen with, and kept while that pod
        # stays on it (or until discovery changes what it knows: ``place``).
        self._owners[target] = seen
        return out

    def _engine_sample(
        self, source: EngineSource, stamp: Stamp, r: EngineReading
    ) -> EngineSample | None:
        t = stamp.wall
        try:
            replica = self.config.replica(source.replica)
        except KeyError:
            return None
        sample = EngineSample(
            sample_id=sample_id(t, source.target),
            replica=replica.id,
            instance=source.instance,
            node=source.node,
            model=replica.model,
            timestamp=t,
            requests_running=r.requests_running,
            requests_waiting=r.requests_waiting,
            kv_cache_usage=r.kv_cache_usage,
            prompt_tokens_total=r.prompt_tokens_total,
            generation_tokens_total=r.generation_tokens_total,
            prefix_cache_queries_total=r.prefix_cache_queries_total,
            prefix_cache_hits_total=r.prefix_cache_hits_total,
            preemptions_total=r.preemptions_total,
            kv_cache_tokens=r.kv_cache_tokens,
        )
        # A target that vanished while it was read is not kept in the view.
        if any(s.target == source.target for s in self.engine_sources):
            self.engines[source.target] = sample
        return sample


def board_homes(
    reports: Mapping[str, list[GpuReading]], holders: Mapping[str, str]
) -> dict[str, str]:
    """The one node each board is sampled under this round, by UUID: ``reports`` by node, in
    the configuration's order of the nodes; ``holders``, the node each board was last sampled
    under.

    A UUID names one physical board, but two node targets can reach the same exporter (two
    ``nodes[]`` URLs behind one Service, a recycled IP), and the board was billed under each,
    with sample ids that differ by node, so billing could not tell. The node it was last sampled
    under keeps it while it reports it, so its interval goes on from its own last reading and a
    target that misses a round does not hand the board back and forth; otherwise the first node
    in the configuration's order takes it, an order that holds from round to round. A reading
    without a UUID cannot be matched and stays with its node.
    """
    reporters: dict[str, list[str]] = {}
    for node, readings in reports.items():
        for uuid in dict.fromkeys(r.uuid for r in readings if r.uuid):
            reporters.setdefault(uuid, []).append(node)
    return {
        uuid: holders[uuid] if holders.get(uuid) in nodes else nodes[0]
        for uuid, nodes in reporters.items()
    }


def _board_readings(
    last: dict[tuple[str, str, str], Point], new: list[GpuReading]
) -> dict[tuple[str, str], Point]:
    """The latest reading kept of each board (node, UUID) one of the ``new`` MIG slices is on."""
    wanted = {r.key[:2] for r in new if r.mig_instance}
    out: dict[tuple[str, str], Point] = {}
    for key, point in last.items() if wanted else ():
        board = key[:2]
        if board in wanted and (board not in out or point.t > out[board].t):
            out[board] = point
    return out


def _slice_start(board: Point | None, current: Point) -> Point | None:
    """Where the first interval of a MIG slice new on a board that was read before starts.

    A GPU instance created since the board's last reading has a part of the board's increase
    since then (its share, as the others have theirs), so its interval starts at that reading,
    from the board's counter. Started at 0 s, 0 J, that part was nobody's. Without counters there
    is no power of the slice to integrate from, and it starts at 0 s, 0 J as any new GPU does.
    """
    if board is None or board.energy_mj is None or current.energy_mj is None:
        return None
    return Point(board.t, current.power_watts, board.energy_mj)
