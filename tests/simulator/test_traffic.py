"""The traffic generator: its daily shape and its mix of teams and behaviours."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import httpx
import orjson

from infermeter.local_fleet import LocalInstance, read_fleet, write_fleet
from simulator.replica import ReplicaSim
from simulator.traffic import (
    InstanceTargets,
    Target,
    TeamTraffic,
    TrafficGenerator,
    TrafficProfile,
    default_targets,
    demo_teams,
)
from tests.servers import serving
from tests.simulator.conftest import tiny_spec


def test_rate_peaks_in_the_morning_and_is_low_at_night():
    """The arrival rate is highest near 10:00 and lowest at night."""
    p = TrafficProfile(peak_requests_per_second=10, day_seconds=24, start_hour=0)
    rates = {hour: p.rate(hour) for hour in range(24)}
    assert max(rates, key=rates.__getitem__) == 10
    assert rates[3] < rates[10] / 5


def test_demo_targets_use_served_names_direct_and_aliases_via_sidecars(config):
    """Direct traffic names the served version; sidecar traffic names the model alias."""
    direct = default_targets(config, via_sidecars=False)
    via = default_targets(config, via_sidecars=True)
    assert direct[0] == Target("http://127.0.0.1:18001", "llama-3.1-70b-instruct-fp8")
    assert via[0] == Target("http://127.0.0.1:18101", "chat-large")
    assert {t.team for t in demo_teams(config)} == {"search", "assistant", "analytics", "research"}


async def test_generator_sends_every_kind_of_request():
    """Several teams, streamed chats, batch completions and hang-ups all happen."""
    sim = ReplicaSim(tiny_spec(max_model_len=8192))
    teams = [TeamTraffic("chat", "k1", 1.0, 0.0), TeamTraffic("batch", "k2", 1.0, 1.0)]
    async with serving(sim) as url:
        gen = TrafficGenerator(
            [Target(url, "tiny")],
            teams,
            TrafficProfile(peak_requests_per_second=200, day_seconds=1, disconnect_share=0.3),
        )
        await gen.run(max_requests=60)
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{url}/metrics")).text
    outcomes = gen.outcomes
    assert outcomes[("chat", "200")] > 0
    assert outcomes[("batch", "200")] > 0
    assert outcomes[("chat", "hung_up")] > 0
    assert sum(outcomes.values()) == 60
    assert "vllm:generation_tokens_total" in metrics


def test_instance_targets_follow_the_instances_file(config, tmp_path):
    """Live instances become targets (sidecar alias or served name), re-read once the interval has passed."""
    path = tmp_path / "instances.json"
    now = [0.0]
    via = InstanceTargets(config, path, via_sidecars=True, clock=lambda: now[0])
    direct = InstanceTargets(config, path, via_sidecars=False, clock=lambda: now[0])
    assert via() == ()
    inst = LocalInstance(
        "small-0-1",
        "small-0",
        "chat-small",
        "node-b",
        (2,),
        "local",
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        0.0,
    )
    write_fleet(path, [inst], [])
    assert via() == ()  # read less than every_seconds ago
    now[0] = 2.0
    assert via() == (Target("http://127.0.0.1:2", "chat-small"),)
    assert direct() == (Target("http://127.0.0.1:1", "llama-3.1-8b-instruct"),)
    # Being stopped: sent nothing new, though still in the file (its GPUs are still its own).
    write_fleet(path, [dataclasses.replace(inst, draining=True)], [])
    now[0] = 4.0
    assert via() == ()
    assert read_fleet(path).instances[0].draining
    write_fleet(path, [], [inst.stopped(5.0, None)])
    now[0] = 6.0
    assert via() == ()
    assert not read_fleet(path).stopped[0].draining


def test_an_instances_file_of_an_earlier_version_reads_as_not_draining(tmp_path):
    """Files written before ``draining`` existed still read: their instances take traffic."""
    path = tmp_path / "instances.json"
    row = {
        "instance": "small-0-1",
        "replica": "small-0",
        "model": "chat-small",
        "node": "node-b",
        "gpus": [2],
        "namespace": "local",
        "upstream_url": "http://127.0.0.1:1",
        "sidecar_url": "http://127.0.0.1:2",
        "started_at": 0.0,
        "stopped_at": None,
        "usage": None,
    }
    path.write_bytes(orjson.dumps({"instances": [row], "stopped": []}))
    [inst] = read_fleet(path).instances
    assert inst.instance == "small-0-1"
    assert inst.draining is False


def test_instances_share_their_models_traffic_and_draw_no_more():
    """With an instance of model b running, b keeps its share of requests, spread over both targets."""
    fixed = [Target("http://a", "a"), Target("http://b", "b")]
    extra = Target("http://b2", "b")
    gen = TrafficGenerator(fixed, [], instance_targets=lambda: (extra,))
    rng = random.Random(1)
    picks = Counter(gen.pick_target(rng).base_url for _ in range(4000))
    assert 0.45 < picks["http://a"] / 4000 < 0.55
    assert 0.2 < picks["http://b2"] / 4000 < 0.3
