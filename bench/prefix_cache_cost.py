"""What a cached prompt token costs the engine, against an uncached one, measured on real vLLM.

vLLM's prefix cache keeps the KV blocks of prompts it has seen; a prompt that starts with one of
them skips the prefill of those tokens. Billing weighs a cached prompt token by
``billing.token_weights.cached_prompt`` (a fraction of the prompt weight), and this bench is
where its default comes from.

It starts the real vLLM CPU build (``.venv-vllm``, the tiny local model of
``tests/conformance``) with prefix caching on and ``--enable-prompt-tokens-details`` (so each
answer says how many of its prompt tokens came from the cache), then times the prefill of
prompts of ``N`` token ids: TTFT of a streamed ``/v1/completions`` request with
``max_tokens=1``. For each repetition and length it sends, in a shuffled order:

- cold: a fresh random prompt (nothing of it cached);
- full: a prompt sent once unmeasured, then again (every whole KV block cached);
- partial: a prompt whose first half was sent before, with a fresh second half.

It prints the median TTFT of each kind and length, and fits
``ttft = fixed + per_uncached * uncached + per_cached * cached`` (least squares through those
medians, with the cached counts vLLM reports), so the fixed cost of a request (HTTP, scheduling,
the one token every prefill computes) does not blur the per-token figures. The ratio
``per_cached / per_uncached`` is the cost of a cached prompt token in uncached ones.

    .venv/bin/python -m bench.prefix_cache_cost --reps 60 --lengths 256 512 768 1000

Flags: ``--lengths`` (prompt lengths, default 256 512 768 1000), ``--reps`` (repetitions per
kind and length, default 60), ``--seed``, ``--json``. One to two minutes, half of it vLLM
starting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from infermeter.serving import free_port

__all__ = ["Sample", "fit", "main"]

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
MODEL = ROOT / ".cache" / "tiny-llama"
#: The tiny model's context (max_position_embeddings); prompts plus one token must fit.
MAX_MODEL_LEN = 1024
#: Token ids drawn for prompts: above the special and byte tokens, within the 2048 vocabulary.
TOKEN_IDS = range(300, 2000)
START_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Sample:
    """One timed request: its kind, prompt length, cached tokens (as vLLM said) and TTFT."""

    kind: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float


def _command(port: int) -> list[str]:
    """Real vLLM on loopback with prefix caching on and cached-token counts in its usage."""
    return [
        str(VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        str(MODEL),
        "--served-model-name",
        "tiny",
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
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]


@contextmanager
def _vllm(scratch: Path) -> Iterator[str]:
    """Run real vLLM for the block (its own process group, stopped and reaped after)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HOME=str(scratch / "hf"),
        VLLM_CACHE_ROOT=str(scratch / "vllm"),
    )
    log = scratch / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _command(port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=scratch,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start:\n{log.read_text()[-4000:]}")
            with suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _ttft(client: httpx.Client, prompt: list[int]) -> tuple[float, int]:
    """The time to the first token of ``prompt`` (ms) and the prompt tokens vLLM had cached."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    first = None
    cached = 0
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert first is not None, "no token came back"
    return (first - start) * 1000, cached


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(TOKEN_IDS) for _ in range(n)]


def measure(url: str, lengths: list[int], reps: int, seed: int) -> list[Sample]:
    """Time every kind at every length ``reps`` times, in a shuffled order."""
    rng = random.Random(seed)
    plan = [(kind, n) for n in lengths for kind in ("cold", "full", "partial") for _ in range(reps)]
    rng.shuffle(plan)
    samples = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for n in lengths:  # warm the engine at each length, unmeasured
            _ttft(client, _fresh(rng, n))
        for kind, n in plan:
            prompt = _fresh(rng, n)
            if kind == "full":
                _ttft(client, prompt)
            elif kind == "partial":
                _ttft(client, prompt[: n // 2])
                prompt = prompt[: n // 2] + _fresh(rng, n - n // 2)
            ms, cached = _ttft(client, prompt)
            samples.append(Sample(kind, n, cached, ms))
    return samples


def fit(samples: list[Sample]) -> tuple[float, float, float]:
    """Least squares ``ttft = fixed + a * uncached + b * cached``: (fixed, a, b) in ms."""
    rows = [
        (1.0, float(s.prompt_tokens - s.cached_tokens), float(s.cached_tokens)) for s in samples
    ]
    ys = [s.ttft_ms for s in samples]
    # Normal equations of a 3-parameter fit, solved by Cramer's rule: no numpy needed.
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]

    def det(a: list[list[float]]) -> float:
        return (
            a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
        )

    d = det(m)
    out = []
    for k in range(3):
        mk = [[v[i] if j == k else m[i][j] for j in range(3)] for i in range(3)]
        out.append(det(mk) / d)
    return out[0], out[1], out[2]


def _report(samples: list[Sample]) -> dict[str, object]:
    table = []
    for n in sorted({s.prompt_tokens for s in samples}):
        for kind in ("cold", "partial", "full"):
            group = [s for s in samples if s.prompt_tokens == n and s.kind == kind]
            table.append(
                {
                    "prompt_tokens": n,
                    "kind": kind,
                    "requests": len(group),
                    "median_cached": statistics.median(s.cached_tokens for s in group),
                    "median_ttft_ms": round(statistics.median(s.ttft_ms for s in group), 3),
                }
            )
    # Fitted through each kind and length's median (its median cached count), so the few
    # requests a busy machine delays do not pull the line.
    fixed, uncached, cached = fit(
        [
            Sample(
                str(r["kind"]),
                int(r["prompt_tokens"]),
                int(r["median_cached"]),
                float(r["median_ttft_ms"]),
            )
            for r in table
        ]
    )
    return {
        "medians": table,
        "fixed_ms": round(fixed, 3),
        "us_per_uncached_token": round(uncached * 1000, 3),
        "us_per_cached_token": round(cached * 1000, 3),
        "cached_over_uncached": round(cached / uncached, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Start vLLM, measure, print the medians and the fitted per-token ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 768, 1000])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if max(args.lengths) >= MAX_MODEL_LEN:
        parser.error(f"lengths must be below {MAX_MODEL_LEN}")
    with (
        tempfile.TemporaryDirectory(prefix="prefix-cache-") as scratch,
        _vllm(Path(scratch)) as url,
    ):
        samples = measure(url, args.lengths, args.reps, args.seed)
    report = _report(samples)
    if args.json:
        print(json.dumps({**report, "samples": [asdict(s) for s in samples]}))
        return 0
    print(f"{'prompt':>7} {'kind':>8} {'n':>4} {'cached':>7} {'median TTFT ms':>15}")
    for row in report["medians"]:  # type: ignore[attr-defined]
        print(
            f"{row['prompt_tokens']:>7} {row['kind']:>8} {row['requests']:>4} "
            f"{row['median_cached']:>7} {row['median_ttft_ms']:>15}"
        )
    print(
        f"fit: fixed {report['fixed_ms']} ms, {report['us_per_uncached_token']} us per uncached "
        f"token, {report['us_per_cached_token']} us per cached token"
    )
    print(f"cached/uncached per prompt token: {report['cached_over_uncached']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
