"""A ``--sidecar-launcher`` for ``bench/sidecar_overhead.py``: the sidecar with one part changed.

Each variant answers "what does this part cost?" by running the real sidecar without it, in the
same benchmark as nginx and the unchanged sidecar. ``SIDECAR_VARIANT`` names it:

- ``unmetered``: streamed blocks are relayed as they arrive, with no ``StreamMeter.feed`` (the
  client gets vLLM's bytes, per-chunk usage included; only ``[DONE]`` is still detected);
- ``asyncio``: Python's own event loop instead of uvloop (``sidecar.event_loop: asyncio``);
- ``arena1``: glibc's malloc limited to one arena (``MALLOC_ARENA_MAX=1``), for RSS;
- ``malloc``: Python's objects allocated by glibc's malloc, not pymalloc (``PYTHONMALLOC=malloc``),
  for RSS;
- ``cprofile``: the unchanged sidecar under cProfile from its ``SIDECAR_PROFILE_FROM``-th
  generation request (default 40) until the ``SIDECAR_PROFILE_TO``-th (default 200) ends; the
  stats go to ``SIDECAR_PROFILE`` (``pstats`` format). cProfile's cost per call inflates
  call-heavy code several-fold: read it for call counts and shares, not for µs.

    SIDECAR_VARIANT=unmetered .venv/bin/python -m bench.sidecar_overhead --quick \\
        --phases paced_500 --sidecar-launcher bench/sidecar_variant.py
    SIDECAR_VARIANT=cprofile SIDECAR_PROFILE=/tmp/c16.prof .venv/bin/python -m \
        bench.sidecar_overhead --quick --phases c16_json --sidecar-launcher bench/sidecar_variant.py

It takes the arguments of ``infermeter sidecar``. Not for production: a measuring tool only.
"""

from __future__ import annotations

import os
import sys

_DONE = b"data: [DONE]\n\n"


def _unmetered() -> None:
    from sidecar.direct import StreamSink

    def body(self: StreamSink, data: bytes, now: float) -> None:
        if data.endswith(_DONE):
            self.meter.done = True
        writer = self.writer
        if writer is not None:
            writer.write(data)
        elif self.pending is None:
            self.pending = [data]
        else:
            self.pending.append(data)

    StreamSink.body = body  # type: ignore[method-assign]


def _cprofile() -> None:
    import cProfile
    from typing import Any

    from sidecar.app import Sidecar

    profile = cProfile.Profile()
    first = int(os.environ.get("SIDECAR_PROFILE_FROM", "40"))
    last = int(os.environ.get("SIDECAR_PROFILE_TO", "200"))
    out = os.environ.get("SIDECAR_PROFILE", "sidecar.prof")
    served = 0
    generate = Sidecar._generate

    async def counted(self: Sidecar, *args: Any) -> None:
        nonlocal served
        served += 1
        number = served
        if number == first:
            profile.enable()
        try:
            await generate(self, *args)
        finally:
            if number == last:
                profile.disable()
                profile.dump_stats(out)

    Sidecar._generate = counted  # type: ignore[method-assign,assignment]


def main() -> int:
    """Apply ``SIDECAR_VARIANT`` and run ``infermeter`` with this process's arguments."""
    variant = os.environ.get("SIDECAR_VARIANT", "")
    if variant == "arena1" and os.environ.get("MALLOC_ARENA_MAX") != "1":
        env = dict(os.environ, MALLOC_ARENA_MAX="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if variant == "malloc" and os.environ.get("PYTHONMALLOC") != "malloc":
        env = dict(os.environ, PYTHONMALLOC="malloc")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if variant == "unmetered":
        _unmetered()
    elif variant == "asyncio":
        from infermeter import serving

        serving.loop_factory = lambda choice: None
    elif variant == "cprofile":
        _cprofile()
    elif variant not in ("", "arena1", "malloc"):
        raise SystemExit(f"SIDECAR_VARIANT: unknown variant {variant!r}")
    from infermeter.cli import main as run_infermeter

    return run_infermeter(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
