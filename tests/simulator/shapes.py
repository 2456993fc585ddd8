"""Compare JSON by shape (key order, nesting and value types), not by value."""

from __future__ import annotations

from typing import Any

import orjson


def skeleton(obj: Any) -> Any:
    """Keys in order and value types, recursively; lists by their first element."""
    if isinstance(obj, dict):
        return [(k, skeleton(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [skeleton(obj[0])] if obj else []
    if obj is None:
        return "null"
    return type(obj).__name__


def sse_events(raw: bytes | str) -> list[str]:
    """The data payloads of an SSE body, checking vLLM's framing on the way."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: ") :] for e in events]


def classify(payload: str) -> str:
    """Name an SSE payload by its role in a vLLM stream."""
    if payload == "[DONE]":
        return "done"
    data = orjson.loads(payload)
    if not data["choices"]:
        return "usage"
    choice = data["choices"][0]
    delta = choice.get("delta", {})
    if "role" in delta:
        return "role"
    return "finish" if choice["finish_reason"] else "token"


def kinds_in_order(payloads: list[str]) -> list[str]:
    """The payloads' kinds in order, runs of token chunks collapsed, so that two streams of
    different lengths compare."""
    out: list[str] = []
    for kind in map(classify, payloads):
        if not (out and out[-1] == kind == "token"):
            out.append(kind)
    return out
