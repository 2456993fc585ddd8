"""The prompt-prefix digest: keyed, text-free, equal for equal heads, and on the usage record."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from sidecar.prefix import DIGEST_HEX_CHARS, PrefixDigester, prefix_digester, prefix_of

SYSTEM = "You are a careful assistant for the search team. " * 10
DIGESTER = PrefixDigester(b"deployment-key", 64)


def _chat(system: str, user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_requests_sharing_a_system_prompt_share_a_digest():
    """Two questions under one system prompt digest alike; another system prompt does not."""
    a = DIGESTER.of(_chat(SYSTEM, "first question"))
    b = DIGESTER.of(_chat(SYSTEM, "a second, longer question"))
    c = DIGESTER.of(_chat("You answer in French.", "first question"))
    assert a is not None
    assert b is not None
    assert c is not None
    assert a.digest == b.digest != c.digest
    assert len(a.digest) == DIGEST_HEX_CHARS


def test_the_digest_is_keyed_and_holds_no_text():
    """The digest is HMAC-SHA256 of role and head under the key: a plain hash of the prompt does not match it."""
    found = DIGESTER.of(_chat(SYSTEM, "q"))
    assert found is not None
    head = SYSTEM[:64]
    keyed = hmac.new(b"deployment-key", f"system\x00{head}".encode(), hashlib.sha256).hexdigest()
    assert found.digest == keyed[:DIGEST_HEX_CHARS]
    assert found.digest != hashlib.sha256(head.encode()).hexdigest()[:DIGEST_HEX_CHARS]
    other = PrefixDigester(b"another-deployment", 64).of(_chat(SYSTEM, "q"))
    assert other is not None
    assert other.digest != found.digest
    assert "careful" not in found.digest


def test_the_share_is_the_digested_characters_of_the_whole_prompt():
    """64 digested characters of a 500-character system prompt and a 100-character question."""
    found = DIGESTER.of(_chat(SYSTEM, "x" * 100))
    assert found is not None
    assert found.share == pytest.approx(64 / (len(SYSTEM) + 100))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "Translate: hello"}, "prompt"),
        ({"prompt": ["Translate: hello", "Translate: bye"]}, "prompt"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": "x"}},
                        ],
                    }
                ]
            },
            "parts",
        ),
        ({"prompt": [101, 2023]}, None),
        ({"input": "embed me"}, None),
        ({"messages": []}, None),
        ({"messages": [{"role": "user", "content": ""}]}, None),
    ],
)
def test_what_counts_as_a_prompt_head(body, expected):
    """Completion prompts and text parts are digested; token ids, embeddings and empty prompts are not."""
    found = DIGESTER.of(body)
    assert (found is not None) == (expected is not None)


def test_no_key_no_digest():
    """Without the deployment's key the sidecar makes no digest at all."""
    assert prefix_digester(None, 64) is None
    assert prefix_digester("", 64) is None
    assert prefix_of(None, _chat(SYSTEM, "q")) is None


async def test_the_usage_record_carries_the_digest_not_the_prompt(stack_factory, monkeypatch):
    """With a key set, the record of a chat request holds the digest and share, and no prompt text."""
    monkeypatch.setenv("TEST_PREFIX_KEY", "k-1")
    stack = await stack_factory(
        **{"sidecar.prefix_key_env": "TEST_PREFIX_KEY", "sidecar.prefix_digest_chars": 64}
    )
    async with stack.client() as c:
        for question in ("what is a GPU?", "what is a KV cache?"):
            r = await c.post(
                "/v1/chat/completions",
                json={"model": "chat-small", "max_tokens": 8, **_chat(SYSTEM, question)},
            )
            assert r.status_code == 200
    first, second = await stack.records()
    expected = PrefixDigester(b"k-1", 64).of(_chat(SYSTEM, "what is a GPU?"))
    assert expected is not None
    assert first["prefix_digest"] == second["prefix_digest"] == expected.digest
    assert first["prefix_share"] == pytest.approx(expected.share)
    assert "careful" not in str(first)


async def test_without_a_key_records_have_no_digest(stack):
    """The default deployment sets no key: the record's digest fields are null."""
    async with stack.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "chat-small", "max_tokens": 4, **_chat(SYSTEM, "q")},
        )
    assert r.status_code == 200
    (record,) = await stack.records()
    assert (record["prefix_digest"], record["prefix_share"]) == (None, None)
