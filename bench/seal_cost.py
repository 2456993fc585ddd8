"""What a spool line's seal costs per record, where it is paid.

Three places touch a seal (``infermeter.writers``):

- the sidecar, in ``Spool.write``, once per request (never per chunk): ``Sealer.__call__``
  on the record's JSON, the only part on the request's path;
- its shipper, off the event loop, once per line it vouches for (``Sealer.vouches``);
- billing, for a batch it must open itself (``WriterKeys.check``, a gone pod's spool).

Each is timed over the same usage records (a real ``UsageRecord``'s JSON, about 500 bytes), and
set beside what the same place already spends per record: ``orjson.dumps`` of the record in
``write``. Reported: the median of ``--rounds`` rounds, µs of CPU per record (this process's CPU
time, so a busy machine stretches the wall clock more than the figures).

    .venv/bin/python -m bench.seal_cost
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from infermeter.records import UsageRecord
from infermeter.writers import Sealer, Writer, WriterKeys, issue

SECRET = b"bench secret"


def records(n: int) -> list[dict[str, Any]]:
    """``n`` usage records as the sidecar writes them."""
    t = 1_790_000_000.0
    return [
        UsageRecord(
            request_id=f"req-{i:012d}-0123456789abcdef",
            team="search",
            model="chat-small",
            served_version="llama-3.1-8b-instruct",
            replica="small-0",
            received_at=t + i,
            first_token_at=t + i + 0.12,
            finished_at=t + i + 3.4,
            prompt_tokens=812,
            cached_prompt_tokens=512,
            completion_tokens=245,
            status="ok",
            http_status=200,
            stream=True,
            finish_reason="stop",
            instance="vllm-small-0-7f9c-abcde",
            response_id=f"chatcmpl-{i:032x}",
            client_request_id=f"client-{i}",
        ).to_json()
        for i in range(n)
    ]


def per_record(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Median µs of CPU per record of ``fn`` (which handles ``n`` records) over ``rounds`` rounds."""
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) / n * 1e6)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    """Time each place and print one line per place."""
    parser = argparse.ArgumentParser(prog="python -m bench.seal_cost", description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    n = args.records
    credential = issue(
        SECRET, Writer.for_instance("small-0", "vllm-small-0-7f9c-abcde", "10.1.2.3:9000")
    )
    sealer = Sealer(credential)
    docs = records(n)
    dumped = [orjson.dumps(d) for d in docs]
    sealed = [sealer(b) for b in dumped]
    keys = WriterKeys(SECRET)
    rows = [
        (
            "orjson.dumps of the record (write, already paid)",
            per_record(lambda: [orjson.dumps(d) for d in docs], n, args.rounds),
        ),
        (
            "seal (write: the sidecar's request path)",
            per_record(lambda: [sealer(b) for b in dumped], n, args.rounds),
        ),
        (
            "vouch (the shipper, off the event loop)",
            per_record(lambda: [sealer.vouches(s) for s in sealed], n, args.rounds),
        ),
        (
            "check (billing, a batch it opens itself)",
            per_record(lambda: [keys.check(s) for s in sealed], n, args.rounds),
        ),
    ]
    size = statistics.mean(len(b) for b in dumped)
    grown = statistics.mean(len(s) for s in sealed) - size
    print(f"{n} usage records of {size:.0f} bytes; the seal adds {grown:.0f} bytes a line")
    for label, micros in rows:
        print(f"  {label:<52} {micros:6.2f} µs/record")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
