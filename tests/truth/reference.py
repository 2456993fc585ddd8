"""The reference model: what the statement should say, computed from the ground-truth log alone.

Small, slow and plain on purpose: loops over seconds and minutes, dictionaries, no SQL, nothing
shared with ``billing``. It reads what really happened (``simulator.truth``: the engines'
requests, the boards' holders and counters, the clients' side) and applies the allocation rules
as docs/billing.md states them, so a disagreement with the product is either a bug in the
product or a rule the docs do not state.

The rules applied:

- **Cost of a board-second**: the GPU model's USD per GPU-hour / 3600, plus the energy the board
  drew x USD per kWh x PUE. A board held by an instance (lent to it, or owned by a fixed
  replica) is that instance's; a spare board is the platform's, model ``(unallocated)``.
- **In-flight split**, per instance and minute: a team pays ``its in-flight seconds / max(60, all
  in-flight seconds)`` of the instance's cost in that minute. In flight means on the instance:
  from the moment its sidecar had the request (a request waiting in the sidecar's fair-share
  queue waits for this instance's GPUs, as one in vLLM's own queue does) to its end. The truth
  bounds that moment between the client's send and the engine's arrival (``expected``'s
  ``widest``).
- **Idle** (the rest of each minute) by the group's ``idle_policy``: ``spread`` over the teams in
  proportion to what they paid on that instance in the period (else on its group; else the
  platform's), ``platform``, or ``owner``.
- **Tokens**: a request that ended normally carries what vLLM's usage reports (the prompt once
  per prompt, completions summed over choices); one that was aborted or cut off carries at least
  what its client received and at most what the engine computed. The engines' own counters take
  each choice's prompt, and every token generated, aborted tails included.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SLOT = 60.0
UNALLOCATED = "(unallocated)"


@dataclass(frozen=True)
class Group:
    """What the reference needs of a replica group."""

    replica: str
    model: str
    idle_policy: str = "spread"
    owner_team: str | None = None


@dataclass(frozen=True)
class Book:
    """The price book and the fleet's accounts."""

    usd_per_gpu_hour: Mapping[str, float]
    usd_per_kwh: float
    pue: float
    platform_account: str = "platform"


@dataclass
class Line:
    """Expected figures of one (team, model): exact where the truth is exact, bounded elsewhere."""

    requests: int = 0
    prompt_tokens: int = 0  # requests that ended normally: exact
    completion_tokens: int = 0
    # Cut-off requests: the statement's tokens lie between what the clients received and what
    # the engines computed.
    cut_prompt_min: int = 0
    cut_prompt_max: int = 0
    cut_completion_min: int = 0
    cut_completion_max: int = 0
    gpu_seconds: float = 0.0
    energy_j: float = 0.0
    busy_usd: float = 0.0
    idle_usd: float = 0.0

    @property
    def total_usd(self) -> float:
        """Busy and idle cost."""
        return self.busy_usd + self.idle_usd


@dataclass
class InstanceFigures:
    """One instance over the period: what it held, what it served, and its idle share."""

    replica: str
    gpu_seconds: float = 0.0
    energy_j: float = 0.0
    cost_usd: float = 0.0
    measured_seconds: float = 0.0  # 60 s for every minute the instance held its boards in
    busy_seconds: float = 0.0  # per such minute, its in-flight seconds up to 60
    engine_prompt_tokens: int = 0
    engine_completion_tokens: int = 0

    @property
    def idle_share(self) -> float:
        """1 - busy / measured (in [0, 1])."""
        return 1.0 - self.busy_seconds / self.measured_seconds if self.measured_seconds else 0.0


@dataclass
class Expected:
    """The reference's answer for a period."""

    lines: dict[tuple[str, str], Line] = field(default_factory=dict)
    instances: dict[str, InstanceFigures] = field(default_factory=dict)
    fleet_usd: float = 0.0
    # Requests by the caller's id: what the engine did and what the client saw.
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def line(self, team: str, model: str) -> Line:
        """The line of ``team`` and ``model``, created empty when absent."""
        return self.lines.setdefault((team, model), Line())

    def engine_tokens(self, model: str, groups: Mapping[str, Group]) -> tuple[int, int]:
        """Prompt and completion tokens the engines of ``model`` counted."""
        prompt = completion = 0
        for fig in self.instances.values():
            if groups[fig.replica].model == model:
                prompt += fig.engine_prompt_tokens
                completion += fig.engine_completion_tokens
        return prompt, completion

    def requests_of(self, model: str, groups: Mapping[str, Group]) -> list[dict[str, Any]]:
        """The engines' lines of the requests ``model``'s instances served."""
        return [
            r["engine"]
            for r in self.requests.values()
            if groups[r["engine"]["replica"]].model == model
        ]


def _minutes(a: float, b: float) -> Iterable[tuple[int, float]]:
    """The minutes ``[a, b)`` overlaps and the seconds it spends in each."""
    t = a
    while t < b:
        m = math.floor(t / SLOT)
        end = min(b, (m + 1) * SLOT)
        yield m, end - t
        t = end


def _board_intervals(
    boards: list[dict[str, Any]], lo: float, hi: float
) -> Iterable[dict[str, Any]]:
    """Each board's consecutive readings as intervals ``(a, b]``, held as at ``b``, clipped."""
    by_board: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in boards:
        by_board[(row["node"], row["index"])].append(row)
    for rows in by_board.values():
        rows.sort(key=lambda r: r["t"])
        for prev, cur in itertools.pairwise(rows):
            a, b = max(prev["t"], lo), min(cur["t"], hi)
            span = cur["t"] - prev["t"]
            if b <= a or span <= 0:
                continue
            part = (b - a) / span
            yield {
                "a": a,
                "b": b,
                "holder": cur["holder"],
                "replica": cur["replica"],
                "gpu_model": cur["gpu_model"],
                "energy_j": (cur["energy_j"] - prev["energy_j"]) * part,
            }


def expected(
    truth: Any,
    groups: Mapping[str, Group],
    book: Book,
    lo: float,
    hi: float,
    widest: bool = True,
    spans: Mapping[str, tuple[float, float]] | None = None,
) -> Expected:
    """The statement, instance figures and request outcomes the truth implies over ``[lo, hi)``.

    What the truth cannot pin down is when a sidecar had a request: after its client sent it,
    and before the engine saw it; and when it let go: the engine's end, or the client's for a
    client that hung up before vLLM's abort took effect. ``widest`` takes each request's span
    from the earlier start to the later end (client sent to the later end); without it, the
    engine's own span. A product that meters in-flight time right lies between the two.
    ``spans``: by the caller's request id, the span to use instead (the product's own, once each
    has been checked against the truth): the split is then exact to the product's clock.
    """
    out = Expected()
    clients = {c["request_id"]: c for c in truth.clients if c.get("request_id")}
    kwh_usd = book.usd_per_kwh * book.pue

    # Cost per instance and minute, and each instance's measured seconds.
    cost: dict[tuple[str, int], float] = defaultdict(float)
    gpu_s: dict[tuple[str, int], float] = defaultdict(float)
    energy: dict[tuple[str, int], float] = defaultdict(float)
    for iv in _board_intervals(truth.boards, lo, hi):
        price = book.usd_per_gpu_hour.get(iv["gpu_model"], 0.0) / 3600.0
        length = iv["b"] - iv["a"]
        for m, seconds in _minutes(iv["a"], iv["b"]):
            joules = iv["energy_j"] * seconds / length
            usd = price * seconds + joules / 3.6e6 * kwh_usd
            out.fleet_usd += usd
            if iv["holder"] is None:
                line = out.line(book.platform_account, UNALLOCATED)
                line.idle_usd += usd
                continue
            key = (iv["holder"], m)
            cost[key] += usd
            gpu_s[key] += seconds
            energy[key] += joules
            fig = out.instances.setdefault(iv["holder"], InstanceFigures(iv["replica"]))
            fig.gpu_seconds += seconds
            fig.energy_j += joules
            fig.cost_usd += usd

    # In-flight seconds per instance, minute and (team, model), from the engines' side.
    inflight: dict[tuple[str, int], dict[tuple[str, str], float]] = defaultdict(
        lambda: defaultdict(float)
    )
    for req in truth.requests:
        client = clients.get(req.get("request_id") or "")
        team = client["team"] if client else "(no client)"
        group = groups[req["replica"]]
        fig = out.instances.setdefault(req["instance"], InstanceFigures(req["replica"]))
        fig.engine_prompt_tokens += sum(req["prompt_tokens"])
        fig.engine_completion_tokens += sum(req["completion_tokens"])
        out.requests[req.get("request_id") or req["response_id"]] = {
            "engine": req,
            "client": client,
        }
        if not (lo <= req["ended"] < hi):
            continue
        line = out.line(team, group.model)
        line.requests += 1
        per_prompt = req["prompt_tokens"][:: max(1, req["n"])]
        if not req["aborted"]:
            line.prompt_tokens += sum(per_prompt)
            line.completion_tokens += sum(req["completion_tokens"])
        else:
            received = (client or {}).get("received_tokens", 0)
            got_prompt = (client or {}).get("status") == 200 and received > 0
            line.cut_prompt_min += sum(per_prompt) if got_prompt else 0
            line.cut_prompt_max += sum(per_prompt)
            line.cut_completion_min += received
            line.cut_completion_max += sum(req["completion_tokens"])
        began, ended = req["arrived"], req["ended"]
        if widest and client:
            began = min(began, client["sent"])
            ended = max(ended, client.get("ended") or ended)
        if spans is not None and req.get("request_id") in spans:
            began, ended = spans[req["request_id"]]
        for m, seconds in _minutes(max(began, lo), min(ended, hi)):
            inflight[(req["instance"], m)][(team, group.model)] += seconds

    # The in-flight split of each instance-minute, and what is left idle.
    idle_of: dict[str, float] = defaultdict(float)
    paid: dict[str, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
    for (instance, m), usd in cost.items():
        fig = out.instances[instance]
        shares = inflight.get((instance, m), {})
        total = sum(shares.values())
        # The allocation's resolution is the minute: a minute the instance held its boards in
        # at all is measured whole, as docs/billing.md states.
        fig.measured_seconds += SLOT
        fig.busy_seconds += min(total, SLOT)
        denominator = max(SLOT, total)
        for team_model, seconds in shares.items():
            line = out.line(*team_model)
            share = seconds / denominator
            line.busy_usd += usd * share
            line.gpu_seconds += gpu_s[(instance, m)] * share
            line.energy_j += energy[(instance, m)] * share
            paid[instance][team_model] += usd * share
        idle_of[instance] += usd * (1.0 - total / denominator)
    for instance, usd in idle_of.items():
        _charge_idle(out, instance, usd, groups, book, paid)
    return out


def _charge_idle(
    out: Expected,
    instance: str,
    usd: float,
    groups: Mapping[str, Group],
    book: Book,
    paid: Mapping[str, Mapping[tuple[str, str], float]],
) -> None:
    group = groups[out.instances[instance].replica]
    if group.idle_policy == "owner" and group.owner_team:
        out.line(group.owner_team, group.model).idle_usd += usd
        return
    if group.idle_policy == "spread":
        payers = dict(paid.get(instance, {}))
        if not payers:
            for other, fig in out.instances.items():
                if fig.replica == group.replica:
                    for key, amount in paid.get(other, {}).items():
                        payers[key] = payers.get(key, 0.0) + amount
        total = sum(payers.values())
        if total > 0:
            for (team, _), amount in payers.items():
                out.line(team, group.model).idle_usd += usd * amount / total
            return
    out.line(book.platform_account, group.model).idle_usd += usd
