"""The sidecar names its models: the aliases in /v1/models, approved versions served, 404s that list."""

from __future__ import annotations

from tests.sidecar.conftest import make_config

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


async def test_models_lists_the_alias_and_the_served_version(stack):
    """/v1/models names the alias clients use and every approved version, each rooted at the served one."""
    async with stack.client() as c:
        listing = (await c.get("/v1/models")).json()
    ids = [m["id"] for m in listing["data"]]
    assert ids[0] == "chat-small"
    assert {"llama-3.1-8b-instruct", "llama-3.1-8b-instruct-2024-07"} <= set(ids)
    assert len(ids) == len(set(ids))
    alias = listing["data"][0]
    assert alias["object"] == "model"
    assert alias["root"] == "llama-3.1-8b-instruct"


async def test_an_approved_version_not_served_here_is_served_by_the_running_one(stack):
    """A request naming another approved version is answered by the served version, not a 404."""
    async with stack.client() as c:
        r = await c.post(
            "/v1/chat/completions", json={**CHAT, "model": "llama-3.1-8b-instruct-2024-07"}
        )
    assert r.status_code == 200
    assert r.json()["model"] == "llama-3.1-8b-instruct"
    assert (await stack.records())[-1]["model"] == "chat-small"


async def test_an_unknown_model_is_a_404_naming_the_models_there_are(stack):
    """The 404 for an unknown model lists the alias and approved versions in OpenAI's error body."""
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"})
    error = r.json()["error"]
    assert r.status_code == 404
    assert error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"
    assert "Available models: `chat-small`, `llama-3.1-8b-instruct`" in error["message"]


async def test_the_404_stays_short_whatever_the_name_asked_for(stack):
    """A megabyte model name is quoted capped, so the 404 body stays a few hundred bytes."""
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "x" * 1_000_000})
    assert r.status_code == 404
    assert len(r.content) < 600


async def test_a_rolled_back_replica_lists_nothing_to_ask_for(stack):
    """With its version no longer approved, the 404 says the replica serves no approved version."""
    rolled_back = {
        "models.1.approved_versions": ["llama-3.1-8b-instruct-2024-07"],
        "models.1.serve_version": "llama-3.1-8b-instruct-2024-07",
    }
    stack.sidecar.reload(make_config(stack.upstream, **rolled_back))
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "chat-small"})
    assert r.status_code == 404
    assert "serves no approved version" in r.json()["error"]["message"]
