"""Whatever a team key sends, the sidecar answers below 500 and its in-flight gauge never goes negative."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving
from tests.sidecar.conftest import KEYS, make_config


def _encode(value: object) -> bytes:
    # The standard library, because orjson refuses integers past 64 bits, which clients may send.
    return json.dumps(value).encode()


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_messages = st.one_of(
    _json,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json,
                "content": st.text(max_size=30) | _json,
            }
        ),
        max_size=3,
    ),
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["chat-small", "llama-3.1-8b-instruct", "nope", ""]) | _json,
        "messages": _messages,
        "prompt": st.text(max_size=30) | _json,
        "input": st.text(max_size=30) | _json,
        "stream": st.booleans() | _json,
        "stream_options": st.fixed_dictionaries(
            {}, optional={"include_usage": _json, "continuous_usage_stats": _json}
        )
        | _json,
        "max_tokens": st.integers(min_value=-5, max_value=20) | _json,
        "max_completion_tokens": st.integers(min_value=-5, max_value=20) | _json,
        "n": st.integers(min_value=-2, max_value=3) | _json,
    },
)
_bodies = st.one_of(
    _fields.map(_encode),
    _json.map(_encode),
    st.binary(max_size=64),
)
_headers = st.dictionaries(
    st.sampled_from(
        [
            "content-type",
            "x-request-id",
            "traceparent",
            "x-infermeter-team",
            "x-infermeter-client-usage",
            "accept-encoding",
            "authorization",
        ]
    ),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
    max_size=3,
)
_paths = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])


def _in_flight(sidecar: Sidecar) -> list[float]:
    values = []
    for family in sidecar.metrics.registry.collect():
        if family.name == "infermeter_requests_in_flight":
            values += [s.value for s in family.samples]
    return values


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Sidecar]]:
    """A simulated replica and its sidecar served on loopback from a thread of their own."""
    port = free_port()
    config = make_config(f"http://127.0.0.1:{port}")
    sidecar = Sidecar(config, "small-0", spool_dir=tmp_path_factory.mktemp("fuzz") / "spool")
    ready: queue.Queue[str] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        async with (
            serving(ReplicaSim(replica_spec(config, "small-0")), port),
            serving(sidecar) as url,
        ):
            ready.put(url)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    yield ready.get(timeout=30), sidecar
    stop.set()
    thread.join(timeout=30)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=_paths, body=_bodies, headers=_headers)
def test_fuzzed_requests_never_get_a_5xx(pod, path, body, headers):
    """Bodies, headers, stream options, models, max_tokens, n and message shapes never get a 5xx."""
    url, sidecar = pod
    sent = {**headers, "authorization": f"Bearer {KEYS['search']}"}
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.post(path, content=body, headers=sent)
    assert r.status_code < 500, r.text
    assert all(v >= 0 for v in _in_flight(sidecar))
