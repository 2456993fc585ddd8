"""Deterministic stand-ins for a tokenizer and a sampler.

The simulator has no model, but it must count prompt tokens the same way every time, give
prefix caching something to hit, and produce output that is reproducible under a seed. Tokens
are whitespace-led word pieces; each output token is drawn from a fixed vocabulary by a
generator seeded from the simulator seed and the request itself.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Sequence

import orjson

__all__ = [
    "VOCAB",
    "chat_prompt_text",
    "count_tokens",
    "prefix_block_hashes",
    "request_rng",
    "tokenize",
]

_PIECE = re.compile(r"<\|[a-z_]+\|>|\s*[A-Za-z]{1,6}|\s*[0-9]{1,3}|\s*[^\sA-Za-z0-9]|\s+")
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "at",
    "from",
    "or",
    "an",
    "have",
    "not",
    "which",
    "but",
    "all",
    "can",
    "has",
    "one",
    "will",
    "more",
    "their",
    "we",
    "if",
    "there",
    "been",
    "so",
    "about",
    "into",
    "than",
    "them",
    "some",
    "GPU",
    "token",
    "model",
    "batch",
    "cache",
    "queue",
    "latency",
    "cost",
    "team",
    "energy",
    "power",
    "memory",
    "budget",
    "request",
    "stream",
    "replica",
    "node",
    "prompt",
    "output",
    "vector",
    "kernel",
    "tensor",
    "shard",
    "scale",
    "metric",
    "trace",
]
VOCAB: tuple[str, ...] = tuple(
    [f" {w}" for w in _WORDS] + [f" {n}" for n in range(0, 10000, 7)] + [".", ",", "ing", "s"]
)


def tokenize(text: str) -> list[str]:
    """Split text into word-piece tokens; deterministic and total (every char is covered)."""
    return _PIECE.findall(text)


def count_tokens(text: str) -> int:
    """Number of tokens ``tokenize`` makes of ``text``."""
    return len(tokenize(text))


def chat_prompt_text(messages: Iterable[dict[str, object]]) -> str:
    """Render chat messages with a Llama-3-like template, the way vLLM applies one."""
    parts = ["<|begin_of_text|>"]
    for message in messages:
        role = str(message.get("role", "user"))
        content = message.get("content", "")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        elif not isinstance(content, str):
            content = orjson.dumps(content).decode()
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def prefix_block_hashes(tokens: Sequence[str], block_size: int) -> tuple[int, ...]:
    """Chained hashes of each full block of tokens, as vLLM's prefix cache keys them."""
    hashes: list[int] = []
    running = hashlib.blake2b(digest_size=8)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        running.update("\x00".join(tokens[start : start + block_size]).encode())
        hashes.append(int.from_bytes(running.copy().digest(), "big"))
    return tuple(hashes)


def request_rng(seed: int, *parts: object) -> random.Random:
    """A generator that depends only on the simulator seed and the request's own content."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=16).digest()
    return random.Random(int.from_bytes(digest, "big"))
