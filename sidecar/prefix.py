"""A privacy-safe digest of a request's prompt prefix, so billing can see prompts that repeat.

The advisor prices prefix caching from how many requests share a prefix; it must never see the
text. The digest is an HMAC-SHA256, keyed by a secret of the deployment (the variable named by
``sidecar.prefix_key_env``, the same on every sidecar so equal prefixes match across replicas),
of the first message's role and its first ``sidecar.prefix_digest_chars`` characters (the
system prompt, when there is one), or of the head of a completion's prompt. A keyed hash rather
than a plain one: without the key, nobody holding the ledger can test a guessed prompt against
it. Without the key set, no digest is made.

Alongside the digest goes ``share``: the digested characters as a share of all the prompt's
characters, which billing multiplies by vLLM's prompt-token count to estimate the prefix's
tokens. Pure: the body is already parsed, and the key comes from the configuration.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DIGEST_HEX_CHARS", "Prefix", "PrefixDigester", "prefix_digester", "prefix_of"]

# 128 bits: collisions between distinct prefixes of one month are out of reach.
DIGEST_HEX_CHARS = 32


@dataclass(frozen=True, slots=True)
class Prefix:
    """A request's prefix digest and the share of its prompt characters that it covers."""

    digest: str
    share: float


def _text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str))
    return None


def _head_and_total(body: Mapping[str, Any]) -> tuple[str, str, int] | None:
    """(role, text of the first message or prompt, characters of the whole prompt), if any."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        texts = [_text(m.get("content")) if isinstance(m, dict) else None for m in messages]
        first = texts[0]
        if first is None:
            return None
        return str(messages[0].get("role", "")), first, sum(len(t) for t in texts if t)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "prompt", prompt[0], sum(len(p) for p in prompt)
    if isinstance(prompt, str):
        return "prompt", prompt, len(prompt)
    return None  # token ids, embeddings' input, or no prompt at all


@dataclass(frozen=True, slots=True)
class PrefixDigester:
    """Digests prompt heads with the deployment's key."""

    key: bytes
    chars: int

    def of(self, body: Mapping[str, Any]) -> Prefix | None:
        """The prefix of a parsed request body; None when it has no text prompt."""
        found = _head_and_total(body)
        if found is None:
            return None
        role, first, total = found
        head = first[: self.chars]
        if not head:
            return None
        mac = hmac.new(self.key, f"{role}\x00{head}".encode(), hashlib.sha256)
        return Prefix(mac.hexdigest()[:DIGEST_HEX_CHARS], len(head) / total)


def prefix_digester(key: str | None, chars: int) -> PrefixDigester | None:
    """The digester for a deployment key; None (no digests) when the key is unset or empty."""
    return PrefixDigester(key.encode(), chars) if key else None


def prefix_of(digester: PrefixDigester | None, body: Mapping[str, Any]) -> Prefix | None:
    """``digester.of(body)``, or None when digests are off."""
    return None if digester is None else digester.of(body)
