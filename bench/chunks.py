"""The vLLM chunks the per-token benchmarks feed, and their shared helpers (no sidecar import:
``--root`` must come first)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

__all__ = ["CHUNK", "ROLE", "import_root", "revision_parser", "rounds_us"]

# One token's chunk as vLLM 0.32 sends it with continuous usage, which a client that asked for
# no usage does not get (the meter cuts it out).
CHUNK = (
    b'data: {"id":"chatcmpl-5f1c0a7e9b2d4c1f8e3a6b9d0c2e4f61","object":"chat.completion.chunk",'
    b'"created":1764612000,"model":"chat-small","choices":[{"index":0,"delta":{"content":" word"},'
    b'"logprobs":null,"finish_reason":null}],'
    b'"usage":{"prompt_tokens":12,"total_tokens":20,"completion_tokens":8}}\n\n'
)
# The stream's first chunk, the assistant's role.
ROLE = CHUNK.replace(b'"delta":{"content":" word"}', b'"delta":{"role":"assistant","content":""}')


def revision_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--root`` for another revision."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--root", help="import the sidecar from this directory (another revision)")
    return parser


def import_root(root: str | None) -> str:
    """Import the sidecar from ``root`` when given; return the directory it is imported from."""
    if root:
        sys.path.insert(0, root)
    import sidecar

    return sidecar.__file__.rsplit("/", 2)[0]


def rounds_us(
    one: Callable[[], object], rounds: int, n: int, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """µs per call of ``one`` by ``clock`` (wall time by default; ``time.thread_time`` for the
    calling thread's CPU), one figure per round of ``n`` calls."""
    out = []
    for _ in range(rounds):
        start = clock()
        for _ in range(n):
            one()
        out.append((clock() - start) / n * 1e6)
    return out
