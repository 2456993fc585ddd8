"""A ``--sidecar-launcher`` for ``bench/sidecar_overhead.py``: the sidecar with one part changed.

Each variant answers "what does this part cost?" by running the real sidecar without it, in the
same benchmark as nginx and the unchanged sidecar. ``SIDECAR_VARIANT`` names it:

- ``unmetered``: streamed blocks are relayed as they arrive, with no ``StreamMeter.feed`` (the
  client gets vLLM's bytes, per-chunk usage included; only ``[DONE]`` is still detected);
- ``asyncio``: Python's own event loop instead of uvloop (``sidecar.event_loop: asyncio``);
- ``arena1``: glibc's malloc limited to one arena (``MALLOC_ARENA_MAX=1``), for RSS.

    SIDECAR_VARIANT=unmetered .venv/bin/python -m bench.sidecar_overhead --quick \\
        --phases paced_500 --sidecar-launcher bench/sidecar_variant.py

It takes the arguments of ``infermeter sidecar``. Not for production: a measuring tool only.
"""

from __future__ import annotations

import os
import sys

_DONE = b"data: [DONE]\n\n"


def _unmetered() -> None:
    from sidecar.direct import StreamSink

    def body(self: StreamSink, data: bytes) -> None:
        if data.endswith(_DONE):
            self.meter.done = True
        writer = self.writer
        if writer is not None:
            writer.write(data)
        else:
            self.pending.append(data)

    StreamSink.body = body  # type: ignore[method-assign]


def main() -> int:
    """Apply ``SIDECAR_VARIANT`` and run ``infermeter`` with this process's arguments."""
    variant = os.environ.get("SIDECAR_VARIANT", "")
    if variant == "arena1" and os.environ.get("MALLOC_ARENA_MAX") != "1":
        env = dict(os.environ, MALLOC_ARENA_MAX="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if variant == "unmetered":
        _unmetered()
    elif variant == "asyncio":
        from infermeter import serving

        serving.loop_factory = lambda choice: None
    elif variant not in ("", "arena1"):
        raise SystemExit(f"SIDECAR_VARIANT: unknown variant {variant!r}")
    from infermeter.cli import main as run_infermeter

    return run_infermeter(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
