"""A sidecar loads redis-py, its own Redis client's hiredis, httpx, OpenTelemetry's SDK and
``cryptography`` only when it uses them, and never aiohttp or uvicorn.

Each costs an idle sidecar memory (docs/benchmarks.md): the relay's one transport is the pool on
asyncio protocols (``sidecar.pool``), https included, so aiohttp is never needed; redis-py and
hiredis (``sidecar.resp``, also the fleet's gateway nonces) are for shared limits only, httpx
for shipping or a budget's spend, the SDK for exporting spans (the API alone passes a trace
on), and ``cryptography``'s primitives (8 MB) for checking the signature of a key set read from
Redis, not before a set is read, even with Redis configured (redis-py imports the package's
top, a few kB, to see whether it is installed). The sidecar serves on its own server (``sidecar.http_server``), so
uvicorn is never needed.
Checked in a fresh interpreter, since this test process has long imported them all.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_PROBE = textwrap.dedent(
    """
    import sys, tempfile
    from pathlib import Path
    import launcher.cli
    from infermeter.config import DEFAULT_CONFIG, load_config
    from sidecar.app import Sidecar

    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
    config = load_config(DEFAULT_CONFIG, environ={
        "INFERMETER__" + key.upper().replace(".", "__"): value for key, value in overrides.items()
    })
    Sidecar(config, "small-0", spool_dir=Path(tempfile.mkdtemp()))
    import sidecar.serve
    print(" ".join(m for m in ("aiohttp", "redis", "hiredis", "httpx", "opentelemetry.sdk",
                                "uvicorn", "cryptography.hazmat")
                   if m in sys.modules))
    """
)


def _loaded(*overrides: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *overrides],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    return set(out.stdout.split())


def test_a_default_sidecar_loads_none_of_them() -> None:
    assert _loaded() == set()


def test_shared_limits_load_redis_and_still_not_aiohttp() -> None:
    # (and the fleet's live-instance list reads billing with httpx)
    assert _loaded("sidecar.shared_limits.redis_url=redis://127.0.0.1:1/0") == {
        "redis",
        "hiredis",
        "httpx",
    }


def test_a_budget_spend_loads_httpx() -> None:
    assert _loaded("sidecar.budgets.spend_url=http://127.0.0.1:1") == {"httpx"}


def test_an_https_upstream_and_the_old_relay_switch_load_none_of_them() -> None:
    """``sidecar.protocol_relay: false`` once brought aiohttp in, and an https upstream httpx."""
    assert (
        _loaded("sidecar.protocol_relay=false", "replicas.small_0.upstream_url=https://h:1")
        == set()
    )
