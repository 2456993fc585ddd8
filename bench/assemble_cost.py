"""What building one non-streamed answer from vLLM's stream costs, in process: µs per answer.

The sidecar answers a non-streamed chat completion from vLLM's stream (``sidecar.assemble``):
it keeps each block as it arrives, parses them once at the end and serializes the answer as
vLLM would. This feeds an ``Assembler`` the blocks of a ``--tokens``-token stream with usage on
every chunk (one block per chunk, as the sidecar reads them at one request at a time) and times
``answer`` with the reads the relay makes of it (finish reason, response id), warm.

    .venv/bin/python -m bench.assemble_cost
    .venv/bin/python -m bench.assemble_cost --tokens 256
"""

from __future__ import annotations

import argparse
import statistics

from bench.chunks import CHUNK, ROLE, rounds_us

_FIRST = b'"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]'
_LAST = b'"delta":{"content":" word"},"logprobs":null,"finish_reason":"stop"}]'


def stream(tokens: int) -> list[bytes]:
    """The blocks of a ``tokens``-token chat stream with usage on every chunk (vLLM's chunks of
    ``bench.chunks``): the role, the tokens, the last with its finish reason, the usage chunk
    and [DONE]."""
    choices = CHUNK[CHUNK.index(b'"choices":[') + 11 : CHUNK.index(b'],"usage"')]
    last = CHUNK.replace(_FIRST, _LAST)
    usage = CHUNK.replace(choices, b"") + b"data: [DONE]\n\n"
    return [ROLE, *[CHUNK] * (tokens - 1), last, usage]


def measure(tokens: int, rounds: int, n: int) -> list[float]:
    """µs per answer, one figure per round of ``n`` answers."""
    from sidecar.assemble import CHAT, Assembler, answer

    blocks = stream(tokens)

    def one() -> None:
        assembler = Assembler(CHAT)
        for block in blocks:
            assembler.feed(block)
        out = answer(200, None, assembler)
        assert out.http_status == 200
        assert out.usage is not None
        _ = assembler.finish_reason, assembler.response_id

    return rounds_us(one, rounds, n)


def main() -> None:
    """Print the best and median µs per answer."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per answer")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=3000, help="answers per round")
    args = parser.parse_args()
    figures = measure(args.tokens, args.rounds, args.n)
    print(
        f"one {args.tokens}-token answer assembled from its stream, {args.rounds} rounds of "
        f"{args.n}: best {min(figures):.1f} µs, median {statistics.median(figures):.1f} µs"
    )


if __name__ == "__main__":
    main()
