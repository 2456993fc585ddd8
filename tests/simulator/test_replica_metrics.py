"""The simulated replica's /metrics and its behaviour under load and disconnects."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infermeter.config import EngineProfile
from simulator.replica import ReplicaSim
from tests.servers import serving
from tests.simulator.conftest import tiny_spec


def _families(text: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """name -> (type, label names, bucket bounds) for every vllm: family."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:"):
            continue
        labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
        buckets = tuple(
            dict.fromkeys(s.labels["le"] for s in fam.samples if s.name.endswith("_bucket"))
        )
        out[fam.name] = (fam.type, labels, buckets)
    return out


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def test_metric_families_match_real_vllm(replica, fixture_text):
    """Every vllm: family of the capture exists with the same type, labels and buckets."""
    _sim, url = replica
    async with httpx.AsyncClient() as client:
        await client.post(f"{url}/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
        text = (await client.get(f"{url}/metrics")).text
    real = _families(fixture_text("vllm-0.32-metrics.prom"))
    assert _families(text) == real


async def test_token_counters_equal_usage_sums(replica):
    """vllm:prompt_tokens_total and generation_tokens_total equal what usage reported."""
    _, url = replica
    prompt = completion = 0
    async with httpx.AsyncClient(timeout=30) as client:
        bodies = [
            {"model": "tiny", "prompt": f"req {i} " * (i + 1), "max_tokens": 3 + i}
            for i in range(12)
        ]
        for r in await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=b) for b in bodies)
        ):
            prompt += r.json()["usage"]["prompt_tokens"]
            completion += r.json()["usage"]["completion_tokens"]
        text = (await client.get(f"{url}/metrics")).text
    assert _value(text, "vllm:prompt_tokens_total") == prompt
    assert _value(text, "vllm:generation_tokens_total") == completion
    assert _value(text, "vllm:request_success_total") == 12


async def test_queue_builds_beyond_max_num_seqs():
    """More concurrent requests than slots show up in vllm:num_requests_waiting."""
    slow = EngineProfile(
        max_num_seqs=4, step_base_ms=20, step_per_seq_ms=1, prefill_tokens_per_second=50_000
    )
    sim = ReplicaSim(tiny_spec(slow))
    async with serving(sim) as url, httpx.AsyncClient(timeout=60) as client:
        body = {"prompt": "x y", "max_tokens": 30, "ignore_eos": True}
        tasks = [
            asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for _ in range(12)
        ]
        await asyncio.sleep(0.3)
        text = (await client.get(f"{url}/metrics")).text
        await asyncio.gather(*tasks)
    assert _value(text, "vllm:num_requests_running") == 4
    assert _value(text, "vllm:num_requests_waiting") == 8


async def test_ttft_rises_with_load():
    """The same request waits longer for its first token when the replica is busy."""
    profile = EngineProfile(
        max_num_seqs=8, step_base_ms=10, step_per_seq_ms=0.5, prefill_tokens_per_second=20_000
    )
    sim = ReplicaSim(tiny_spec(profile))

    async def first_token(client: httpx.AsyncClient, url: str) -> float:
        body = {"prompt": "hello", "max_tokens": 20, "stream": True, "ignore_eos": True}
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                return loop.time() - start
        raise AssertionError("no chunk")

    async with serving(sim) as url, httpx.AsyncClient(timeout=60) as client:
        idle = await first_token(client, url)
        load = [
            asyncio.create_task(
                client.post(
                    f"{url}/v1/completions",
                    json={"prompt": "z", "max_tokens": 200, "ignore_eos": True},
                )
            )
            for _ in range(24)
        ]
        await asyncio.sleep(0.1)
        busy = await first_token(client, url)
        await asyncio.gather(*load)
    assert busy > idle * 3


async def test_client_disconnect_aborts_the_sequence(replica):
    """A client that hangs up frees its slot; generation stops and is not counted a success."""
    _sim, url = replica
    body = {"model": "tiny", "prompt": "go", "max_tokens": 400, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += bool(line)
                if seen == 5:
                    break
        await asyncio.sleep(0.2)
        before = (await client.get(f"{url}/metrics")).text
        await asyncio.sleep(0.2)
        after = (await client.get(f"{url}/metrics")).text
    generated = _value(after, "vllm:generation_tokens_total")
    assert 5 <= generated < 400
    assert generated == _value(before, "vllm:generation_tokens_total")
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:request_success_total") == 0


async def test_gpu_energy_is_the_integral_of_reported_power():
    """The energy a replica's GPU meter reports equals idle plus busy power over time."""
    sim = ReplicaSim(tiny_spec(gpus=2))
    async with serving(sim) as url, httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions",
                    json={"prompt": "p", "max_tokens": 50, "ignore_eos": True},
                )
                for _ in range(8)
            )
        )
        rows = (await client.get(f"{url}/_sim/gpus")).json()
    assert len(rows) == 2
    for row in rows:
        busy = row["busy_seconds"]
        assert busy > 0
        gpu = sim.spec.gpu
        # Energy lies between all-idle and all-busy-at-full-power for the time elapsed.
        elapsed = sim.clock() - sim.meters[0]._history[0][0]
        assert row["energy_joules"] >= gpu.idle_watts * elapsed * 0.99
        assert row["energy_joules"] <= gpu.idle_watts * (elapsed - busy) + gpu.max_watts * busy + 1
