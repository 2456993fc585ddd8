"""Requests of several choices: the record says how many, so billing counts prompts as vLLM does.

vLLM counts a prompt once per choice in ``vllm:prompt_tokens_total``; its usage object, and so
the record's ``prompt_tokens``, counts it once. These requests go through a real sidecar to the
simulated replica, whose counters follow vLLM's; the records then reconcile in a real ledger.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from billing import reconciled
from billing.ledger import Ledger
from collectors.vllm import engine_reading
from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.records import EngineSample
from sidecar.accounting import Call, engine_choices
from tests.billing.conftest import batch

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "count please"}],
    "max_tokens": 6,
}
TEXT = {"model": "chat-small", "max_tokens": 5}


async def _reading(url: str, t: float) -> dict[str, Any]:
    """The replica's engine counters now, as the collector would store them at ``t``."""
    async with httpx.AsyncClient() as c:
        r = engine_reading((await c.get(f"{url}/metrics")).text)
    return EngineSample(
        sample_id=f"eng-{t}",
        replica="small-0",
        model="chat-small",
        timestamp=t,
        requests_running=r.requests_running,
        requests_waiting=r.requests_waiting,
        kv_cache_usage=r.kv_cache_usage,
        prompt_tokens_total=r.prompt_tokens_total,
        generation_tokens_total=r.generation_tokens_total,
    ).to_json()


async def test_records_of_several_choices_reconcile_with_the_engine(stack):
    """n = 2 and 3, streamed or not, chat and a batch of prompts: no token shows as unattributed."""
    t0 = time.time() - 1.0
    before = await _reading(stack.upstream, t0)
    async with stack.client() as c:
        sent = [
            ("/v1/chat/completions", {**CHAT, "n": 2, "stream": True}),
            ("/v1/chat/completions", {**CHAT, "n": 3}),
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {**TEXT, "prompt": ["a b c", "d e f g h"], "n": 2}),
            ("/v1/completions", {**TEXT, "prompt": ["a b c", "d e"]}),
            ("/v1/completions", {**TEXT, "prompt": "a b c d", "n": 2, "stream": True}),
            # Integers as vLLM's validation takes them: a string, a float, a string with blanks.
            ("/v1/chat/completions", {**CHAT, "n": "2", "stream": True}),
            ("/v1/chat/completions", {**CHAT, "n": 2.0}),
            ("/v1/completions", {**TEXT, "prompt": "a b", "n": " 3 ", "max_tokens": "4"}),
        ]
        for path, body in sent:
            assert (await c.post(path, json=body)).status_code == 200
    t1 = time.time() + 1.0
    after = await _reading(stack.upstream, t1)
    records = await stack.records()
    assert [r["choices"] for r in records] == [2, 3, 1, 2, 1, 2, 2, 2, 3]
    assert records[-1]["completion_tokens"] == 3 * 4
    engine_prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert sum(r["prompt_tokens"] * r["choices"] for r in records) == engine_prompt
    assert sum(r["prompt_tokens"] for r in records) < engine_prompt

    config = load_config(DEFAULT_CONFIG, environ={})
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    try:
        for kind, rows in (("usage", records), ("engine_samples", [before, after])):
            result = ledger.ingest(batch(kind, rows), now=t1 + 1)
            assert result.rejected == [], result.rejected
        frame = reconciled.reconciled(ledger, t0, t1)
    finally:
        ledger.close()
    assert frame["engine_prompt_tokens"].sum() == engine_prompt
    assert frame["ledger_prompt_tokens"].sum() == engine_prompt
    assert frame["unattributed_tokens"].sum() == 0
    assert frame["difference_tokens"].sum() == 0


@pytest.mark.parametrize(
    ("endpoint", "planned", "choices"),
    [
        ("/v1/chat/completions", 0, 1),
        ("/v1/chat/completions", 4, 4),
        ("/v1/completions", 1, 1),
        ("/v1/embeddings", 2, 1),
    ],
)
def test_each_prompt_counts_once_per_choice_but_embeddings_once(endpoint, planned, choices):
    """The record's choices is the plan's n (1 for a single choice); an embedding has no choices."""
    call = Call("req-1", endpoint, 0.0, 0.0, choices=planned)
    assert engine_choices(call) == choices
