"""Non-streamed requests through the sidecar in front of real vLLM: vLLM's bytes, exact usage."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conformance.sidecar_front import spooled_records

pytestmark = pytest.mark.real_vllm

MSG = [{"role": "user", "content": "Hello world 123"}]
KEY = {"authorization": "Bearer im-demo-search"}
# What differs between two answers to the same request: vLLM's id and its creation second.
_VOLATILE = re.compile(rb'"id":"[^"]*"|"created":\d+')


def _cut(records: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    """Records of hang-ups that stopped vLLM before the whole answer."""
    return [
        r
        for r in records
        if r["status"] == "client_aborted" and r["completion_tokens"] < max_tokens
    ]


async def _engine(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    names = (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
    )
    return {
        n: sum(
            s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == n
        )
        for n in names
    }


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 12, "temperature": 0}),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 9, "n": 2, "seed": 5}),
        (
            "/v1/chat/completions",
            {"messages": MSG, "max_tokens": 40, "temperature": 0, "stop": ["9", " the"]},
        ),
        ("/v1/completions", {"prompt": "Hello world", "max_tokens": 10, "temperature": 0}),
        ("/v1/completions", {"prompt": ["Hello", "One two"], "max_tokens": 6, "seed": 1}),
    ],
)
async def test_the_assembled_body_is_vllms_own_non_streamed_body(real_vllm, sidecar, path, body):
    """Field by field, order and types included, the client gets what vLLM sends unstreamed."""
    url, app = sidecar
    async with httpx.AsyncClient(timeout=120) as c:
        via = await c.post(f"{url}{path}", json={**body, "model": "chat-small"}, headers=KEY)
        direct = await c.post(f"{real_vllm}{path}", json={**body, "model": "tiny"})
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert _VOLATILE.sub(b"", via.content) == _VOLATILE.sub(b"", direct.content)
    (record,) = await spooled_records(app)
    assert record["response_id"] == via.json()["id"]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (
        direct.json()["usage"]["prompt_tokens"],
        direct.json()["usage"]["completion_tokens"],
    )


async def test_a_refusal_is_vllms_own(real_vllm, sidecar):
    """A request vLLM refuses gets vLLM's non-streamed error, status and body."""
    url, _ = sidecar
    body = {"messages": MSG, "max_tokens": 5000}
    async with httpx.AsyncClient(timeout=120) as c:
        via = await c.post(
            f"{url}/v1/chat/completions", json={**body, "model": "chat-small"}, headers=KEY
        )
        direct = await c.post(f"{real_vllm}/v1/chat/completions", json={**body, "model": "tiny"})
    assert via.status_code == direct.status_code == 400
    assert via.json() == direct.json()


async def test_abandoned_requests_are_aborted_and_carry_vllms_counts(real_vllm, sidecar):
    """Hang-ups mid-generation: vLLM stops at once; records hold its counter deltas, less the tail.

    The hang-ups come at a share of the time vLLM takes for the whole answer on this machine,
    measured first, warm (the first answer of a fresh vLLM takes several times longer). The tail
    is what vLLM generated after the last chunk the sidecar read: a few tokens per hang-up, plus
    what vLLM makes while it notices the closed connection, which took up to 0.8 s when its own
    threads held both cores (the sidecar had mostly closed within milliseconds of the hang-up),
    so it is bounded by vLLM's rate over the time it took to stop. (Pinned to a core, vLLM kept
    the test's process off the CPU for longer than whole answers: ``real_vllm`` unpins it.)

    The test's HTTP clients are made once, before vLLM is busy: the sidecar runs on the test's
    event loop, and building a client (it loads the CA bundle, synchronously) took 1-2 s of that
    loop while vLLM's threads held both cores, so the sidecar saw the hang-up only when vLLM had
    finished. A try that vLLM finished anyway is recorded ``ok``, counted like the others, and
    tries go on until ``wanted`` were aborted (at most 40: a run needed 19 when the test's
    process got little of the CPU). Such a try also bounds the whole answer's time anew: vLLM's
    pace varies (whole answers of 1.0 to 2.5 s in one run), and a run timed slow could hang up
    after the last token every time. A hang-up can also land after vLLM's last token but before
    the answer was written to the client (the sidecar shares the test's loop): that try is
    ``client_aborted`` with the whole answer's tokens, which is true, and does not count as a
    hang-up that stopped vLLM.
    """
    url, app = sidecar
    wanted, max_tokens = 5, 480
    body = {"model": "chat-small", "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True}
    async with (
        httpx.AsyncClient(timeout=120) as engine,
        httpx.AsyncClient(base_url=url, headers=KEY) as client,
    ):
        timings = []
        for _ in range(2):
            started = time.perf_counter()
            whole = await engine.post(
                f"{real_vllm}/v1/chat/completions", json={**body, "model": "tiny"}
            )
            timings.append(time.perf_counter() - started)
            assert whole.json()["usage"]["completion_tokens"] == max_tokens
        full = min(timings)
        before = await _engine(engine, real_vllm)
        stopped_after: list[float] = []
        tries: list[tuple[float, float]] = []
        while len(_cut(await spooled_records(app), max_tokens)) < wanted:
            assert len(tries) < 40, (
                f"fewer than {wanted} of 40 hang-ups arrived before vLLM finished; "
                f"(seconds waited, whole answer's time then): {tries}; "
                "records: "
                + str([(r["status"], r["completion_tokens"]) for r in await spooled_records(app)])
            )
            # The client hangs up when no answer came after a share of the whole answer's time.
            wait = full * (0.2 + 0.05 * (len(tries) % 5))
            tries.append((round(wait, 3), round(full, 3)))
            started = time.perf_counter()
            with contextlib.suppress(httpx.ReadTimeout):
                await client.post(
                    "/v1/chat/completions", json=body, timeout=httpx.Timeout(120, read=wait)
                )
            hung_up = time.perf_counter()
            while (await _engine(engine, real_vllm))["vllm:num_requests_running"] > 0:
                assert time.perf_counter() - hung_up < 3.0, "vLLM kept generating after the hang-up"
                await asyncio.sleep(0.02)
            stopped_after.append(time.perf_counter() - hung_up)
            while len(records := await spooled_records(app)) < len(tries):
                assert time.perf_counter() - hung_up < 3.0, "the try left no record"
                await asyncio.sleep(0.02)
            if not _cut(records[-1:], max_tokens):
                # vLLM finished within this try: the next hang-ups are timed by it.
                full = min(full, hung_up - started)
        await asyncio.sleep(0.5)
        after = await _engine(engine, real_vllm)
    records = await spooled_records(app)
    aborted = [r for r in records if r["status"] == "client_aborted"]
    assert len(records) == len(tries)
    assert all(r["usage_exact"] and r["response_id"].startswith("chatcmpl-") for r in records)
    assert len(_cut(records, max_tokens)) >= wanted
    assert all(r["completion_tokens"] <= max_tokens for r in records)
    assert {r["status"] for r in records} <= {"client_aborted", "ok"}
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    recorded = sum(r["completion_tokens"] for r in records)
    print(
        f"\n{len(aborted)} of {len(tries)} tries aborted; vLLM stopped {max(stopped_after):.2f} s at "
        f"most after a hang-up and generated {generated - recorded:.0f} token(s) past the "
        "last chunk read"
    )
    assert sum(r["prompt_tokens"] for r in records) == prompt
    # What vLLM generated between the last chunk the sidecar read and noticing the closed
    # connection: a few tokens per hang-up, and its rate over the time it took to stop.
    rate = max_tokens / full
    assert 0 <= generated - recorded <= 10 * len(aborted) + rate * sum(stopped_after)
