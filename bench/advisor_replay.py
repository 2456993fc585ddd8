"""The advisor's replay on a month of a 20-replica fleet's arrivals: how long a replay takes.

The fleet: 12 replicas of chat-small (one L40S each) and 8 of chat-large (two H100s each), with
the demo's engine profiles, running the whole month. The arrivals: ``--requests`` over
``--days`` days, each day shaped as the simulator's traffic is (``infermeter.day_curve``: a night
floor, a 10:00 peak and a smaller 15:00 one), 60 % to chat-small; prompts and outputs
log-normal (median 400 and 150 tokens), a third opening with one of 40 shared system prompts; 20
teams. Measured: ``billing.efficiency.replay.replay`` of each model as it ran, then of each model
capped by the hour to what its load needs (``billing.efficiency.capacity``), the two replays a
plan runs first for every model; wall time, requests per second, and the process's peak RSS.

    .venv/bin/python -m bench.advisor_replay --requests 1000000
    .venv/bin/python -m bench.advisor_replay --requests 100000 --days 3
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import time
from collections.abc import Sequence

from billing.efficiency.capacity import capped, engine_capacity, engines_by_hour, needed_by_hour
from billing.efficiency.replay import Arrival, GroupSetup, ModelReplay, ModelSetup, Run, replay
from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.day_curve import share_of_peak

DAY = 86400.0
# model -> (replicas, GPUs each, GPU model, USD per GPU-hour, share of the requests)
FLEET = {"chat-small": (12, 1, "L40S", 1.60, 0.6), "chat-large": (8, 2, "H100", 3.90, 0.4)}


def arrivals(requests: int, days: int, seed: int = 7) -> dict[str, list[Arrival]]:
    """``requests`` arrivals over ``days`` days in the traffic's daily shape, per model."""
    rng = random.Random(seed)
    weights = [share_of_peak(h + 0.5) for h in range(24)]
    hours = rng.choices(range(days * 24), weights=weights * days, k=requests)
    out: dict[str, list[Arrival]] = {m: [] for m in FLEET}
    for hour in hours:
        model = "chat-small" if rng.random() < FLEET["chat-small"][4] else "chat-large"
        prompt = min(6000, max(8, round(rng.lognormvariate(math.log(400), 0.8))))
        output = min(1500, max(1, round(rng.lognormvariate(math.log(150), 0.8))))
        shared = rng.random() < 1 / 3
        out[model].append(
            Arrival(
                hour * 3600.0 + rng.random() * 3600.0,
                f"team-{rng.randrange(20):02d}",
                model,
                prompt,
                output,
                head=f"system-{rng.randrange(40)}" if shared else None,
                head_tokens=min(prompt - 1, 300) if shared else 0,
            )
        )
    for found in out.values():
        found.sort(key=lambda a: a.t)
    return out


def fleet(days: int) -> dict[str, ModelSetup]:
    """Each model's replicas, all month, with the demo configuration's engine profiles."""
    config = load_config(DEFAULT_CONFIG, environ={})
    setups = {}
    for model, (count, gpus, gpu, usd, _) in FLEET.items():
        base = config.simulator.engine_for(model)
        seqs = 128 if model == "chat-small" else 64
        groups = tuple(
            GroupSetup(
                f"{model}-{k}",
                model,
                gpu,
                gpus,
                usd,
                base.model_copy(update={"max_num_seqs": seqs}),
                True,
            )
            for k in range(count)
        )
        runs = tuple(Run(g.replica, g.replica, 0.0, days * DAY, 0.0) for g in groups)
        setups[model] = ModelSetup(model, groups, runs)
    return setups


def timed(setup: ModelSetup, found: Sequence[Arrival], days: int) -> tuple[ModelReplay, float]:
    """One replay and its wall time."""
    t = time.perf_counter()
    r = replay(setup, found, 0.0, days * DAY)
    return r, time.perf_counter() - t


def main() -> int:
    """Generate the month's arrivals, then time each model's replay as it ran and capped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30)
    args = parser.parse_args()
    t = time.perf_counter()
    by_model = arrivals(args.requests, args.days)
    setups = fleet(args.days)
    print(
        f"arrivals   {args.requests:,} over {args.days} days, 20 replicas: "
        f"{time.perf_counter() - t:.1f} s to generate"
    )
    total = {"as it ran": 0.0, "capped": 0.0}
    for model, setup in setups.items():
        found = by_model[model]
        r, seconds = timed(setup, found, args.days)
        total["as it ran"] += seconds
        print(
            f"{model:<11} as it ran: {len(found):,} requests in {seconds:.1f} s "
            f"({len(found) / seconds:,.0f}/s); TTFT p95 {r.ttft_p95():.3f} s, inter-token p95 "
            f"{r.itl_p95():.4f} s, {r.gpu_hours:,.0f} GPU-hours"
        )
        ran = engines_by_hour(setup.runs)
        capacity = min(engine_capacity(g, found) for g in setup.groups)
        caps = tuple(needed_by_hour(r, capacity, 0.25, 1, ran))
        small, seconds = timed(capped(setup, caps, 180.0), found, args.days)
        total["capped"] += seconds
        print(
            f"{model:<11} capped {list(caps)}: {seconds:.1f} s; TTFT p95 "
            f"{small.ttft_p95():.3f} s, {small.gpu_hours:,.0f} GPU-hours"
        )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"total      as it ran {total['as it ran']:.1f} s, capped {total['capped']:.1f} s; "
        f"peak RSS {rss:,.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
