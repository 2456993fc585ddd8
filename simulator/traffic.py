"""A traffic generator: several teams, chats and batch jobs, a morning peak, impatient clients.

Arrivals are a Poisson process whose rate follows a compressed day (``day_seconds`` of wall time
per simulated day) with a peak at 10:00, so a demo shows queues building and draining. Each
team has its own mix: interactive teams send short streamed chats, batch teams send long prompts
without streaming, and a share of streamed clients hang up part-way, as real users do.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infermeter.config import Config
from infermeter.day_curve import hour_of_day, share_of_peak
from infermeter.local_fleet import LocalInstance, read_fleet

__all__ = [
    "InstanceTargets",
    "Target",
    "TeamTraffic",
    "TrafficGenerator",
    "TrafficProfile",
    "default_targets",
    "demo_teams",
    "instance_target",
]


@dataclass(frozen=True)
class Target:
    """Where requests for one model go, and the model name to put in them."""

    base_url: str
    model: str


@dataclass(frozen=True)
class TeamTraffic:
    """One team's share of the traffic and the kind of work it sends."""

    team: str
    api_key: str
    weight: float
    batch_share: float


@dataclass(frozen=True)
class TrafficProfile:
    """Rates and shapes of the generated load."""

    peak_requests_per_second: float = 6.0
    day_seconds: float = 600.0
    start_hour: float = 8.0
    disconnect_share: float = 0.05
    max_in_flight: int = 256
    seed: int = 7

    def rate(self, elapsed: float) -> float:
        """Requests per second at ``elapsed`` wall seconds: a night floor and a 10:00 peak."""
        hour = hour_of_day(elapsed, self.day_seconds, self.start_hour)
        return self.peak_requests_per_second * share_of_peak(hour)


def demo_teams(config: Config) -> list[TeamTraffic]:
    """The demo's teams with their public demo keys (``im-demo-<team>``)."""
    shapes = {
        "search": (3.0, 0.0),
        "assistant": (4.0, 0.05),
        "analytics": (1.0, 0.9),
        "research": (1.5, 0.4),
    }
    return [
        TeamTraffic(t.name, f"im-demo-{t.name}", *shapes.get(t.name, (1.0, 0.2)))
        for t in config.teams
    ]


def instance_target(config: Config, instance: LocalInstance, via_sidecars: bool) -> Target:
    """Where requests for a simulated instance go: its sidecar, or the replica itself."""
    group = config.replica(instance.replica)
    model = config.model(group.model)
    if via_sidecars and instance.sidecar_url:
        return Target(instance.sidecar_url.rstrip("/"), model.name)
    return Target(instance.upstream_url.rstrip("/"), group.served_version or model.current_version)


@dataclass
class InstanceTargets:
    """The live simulated instances' targets, re-read from the instances file every few seconds.

    The autoscaler's local hook replaces that file whole at every change, so a read is either
    the previous fleet or the new one. It marks an instance draining
    ``autoscale.local.delist_seconds`` (more than ``every_seconds``) before stopping it, and a
    draining instance is sent nothing new; one that died on its own costs a few refused
    connections, counted as such.
    """

    config: Config
    path: Path
    via_sidecars: bool
    every_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _read_at: float | None = None
    _targets: tuple[Target, ...] = ()

    def __call__(self) -> tuple[Target, ...]:
        """The current targets (from the last read when it is recent enough)."""
        now = self.clock()
        if self._read_at is None or now - self._read_at >= self.every_seconds:
            self._read_at = now
            known = {r.id for r in self.config.replicas}
            self._targets = tuple(
                instance_target(self.config, i, self.via_sidecars)
                for i in read_fleet(self.path).instances
                if i.replica in known and not i.draining
            )
        return self._targets


def default_targets(config: Config, via_sidecars: bool) -> list[Target]:
    """One target per replica: its sidecar (model alias) or the replica itself (served name)."""
    targets = []
    for r in config.replicas:
        model = config.model(r.model)
        if via_sidecars and r.sidecar_listen:
            targets.append(Target(f"http://{r.sidecar_listen}", model.name))
        else:
            targets.append(
                Target(r.upstream_url.rstrip("/"), r.served_version or model.current_version)
            )
    return targets


@dataclass
class TrafficGenerator:
    """Sends generated requests until stopped, counting outcomes per team."""

    targets: Sequence[Target]
    teams: Sequence[TeamTraffic]
    profile: TrafficProfile = TrafficProfile()
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    instance_targets: Callable[[], Sequence[Target]] | None = None

    def pick_target(self, rng: random.Random) -> Target:
        """The next request's target.

        With instances running: a model as the fixed targets weigh it, then any of that model's
        targets, so scaling a model spreads its share of the load and does not draw more.
        """
        extra = self.instance_targets() if self.instance_targets is not None else ()
        if not extra:
            return rng.choice(self.targets)
        if not self.targets:
            return rng.choice(extra)
        model = rng.choice(self.targets).model
        return rng.choice([t for t in (*self.targets, *extra) if t.model == model])

    async def run(
        self, duration_seconds: float | None = None, max_requests: int | None = None
    ) -> None:
        """Generate load for ``duration_seconds`` (or until cancelled), then wait for stragglers."""
        rng = random.Random(self.profile.seed)
        weights = [t.weight for t in self.teams]
        in_flight: set[asyncio.Task[None]] = set()
        limit = asyncio.Semaphore(self.profile.max_in_flight)
        start = time.monotonic()
        sent = 0
        limits = httpx.Limits(
            max_connections=self.profile.max_in_flight, max_keepalive_connections=64
        )
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(300.0, connect=5.0), limits=limits
        ) as client:
            try:
                while duration_seconds is None or time.monotonic() - start < duration_seconds:
                    if max_requests is not None and sent >= max_requests:
                        break
                    await asyncio.sleep(
                        rng.expovariate(self.profile.rate(time.monotonic() - start))
                    )
                    team = rng.choices(self.teams, weights)[0]
                    target = self.pick_target(rng)
                    request = self._request(rng, team, target)
                    await limit.acquire()
                    task = asyncio.create_task(self._send(client, team, target, *request))
                    task.add_done_callback(lambda _t: limit.release())
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    sent += 1
            finally:
                if in_flight:
                    await asyncio.wait(in_flight, timeout=60)
                for task in in_flight:
                    task.cancel()

    def _request(
        self, rng: random.Random, team: TeamTraffic, target: Target
    ) -> tuple[str, dict[str, object], int | None]:
        batch = rng.random() < team.batch_share
        words = rng.randint(600, 2400) if batch else rng.randint(8, 120)
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        if batch:
            body: dict[str, object] = {
                "model": target.model,
                "prompt": text,
                "max_tokens": rng.randint(64, 400),
            }
            return "/v1/completions", body, None
        body = {
            "model": target.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": rng.randint(32, 400),
            "stream": True,
        }
        hang_up_after = rng.randint(1, 40) if rng.random() < self.profile.disconnect_share else None
        return "/v1/chat/completions", body, hang_up_after

    async def _send(
        self,
        client: httpx.AsyncClient,
        team: TeamTraffic,
        target: Target,
        path: str,
        body: dict[str, object],
        hang_up_after: int | None,
    ) -> None:
        headers = {"Authorization": f"Bearer {team.api_key}"}
        url = target.base_url + path
        try:
            if not body.get("stream"):
                response = await client.post(url, json=body, headers=headers)
                self.outcomes[(team.team, str(response.status_code))] += 1
                return
            async with client.stream("POST", url, json=body, headers=headers) as response:
                lines = 0
                async for line in response.aiter_lines():
                    lines += bool(line)
                    if hang_up_after is not None and lines >= hang_up_after:
                        self.outcomes[(team.team, "hung_up")] += 1
                        return
                self.outcomes[(team.team, str(response.status_code))] += 1
        except httpx.HTTPError as exc:
            self.outcomes[(team.team, type(exc).__name__)] += 1

    def summary(self) -> str:
        """One line per team with its outcome counts."""
        teams = sorted({t for t, _ in self.outcomes})
        return "\n".join(
            f"  {t}: "
            + ", ".join(f"{k}={v}" for (tt, k), v in sorted(self.outcomes.items()) if tt == t)
            for t in teams
        )


_WORDS = [
    "the",
    "a",
    "GPU",
    "request",
    "latency",
    "invoice",
    "cluster",
    "token",
    "model",
    "search",
    "ranking",
    "summary",
    "report",
    "table",
    "customer",
    "order",
    "policy",
    "vector",
    "cache",
    "energy",
    "budget",
    "deploy",
    "review",
    "draft",
    "answer",
    "question",
    "data",
]


async def run_until_cancelled(gen: TrafficGenerator, duration_seconds: float | None) -> None:
    """Run the generator, treating cancellation (Ctrl-C) as a normal end."""
    with contextlib.suppress(asyncio.CancelledError):
        await gen.run(duration_seconds)
