"""Shared fixtures: the embedded configuration, a ledger for it, and captured real-system output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, Config, load_config
from tests.redis_server import RedisServer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def config() -> Config:
    """The embedded demo configuration, with no environment overrides but one: billing still
    takes the shared ingest token (``billing.shared_ingest_token``), which the tests of other
    things ship records with; tests/security holds the writers to their own credentials."""
    return load_config(DEFAULT_CONFIG, environ={"INFERMETER__BILLING__SHARED_INGEST_TOKEN": "true"})


def config_ledger(config: Config, path: str | Path = ":memory:", **options: Any) -> Ledger:
    """A ledger at ``path`` that knows the teams of ``config`` and its models' TTFT targets.

    ``options`` go to ``Ledger.open`` as they are (a known fleet, sample bounds).
    """
    slas = {m.name: m.sla.ttft_p95_seconds for m in config.models}
    return Ledger.open(path, [t.name for t in config.teams], slas, **options)


@pytest.fixture
def ledger(config: Config) -> Iterator[Ledger]:
    """An empty in-memory ledger for the teams and models of ``config``."""
    led = config_ledger(config)
    yield led
    led.close()


@pytest.fixture
def fixture_text():
    """Read a captured file from tests/fixtures."""

    def read(name: str) -> str:
        return (FIXTURES / name).read_text()

    return read


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Real vLLM (CPU build) serving the tiny local model as ``tiny``; its base URL.

    Building the venv or the model, or starting the server, fails the test loudly: a machine
    that cannot run real vLLM must not look like one where the simulator was checked against it.
    """
    from tests.conformance.real_vllm import ensure_vllm_ready, free_port, start_real_vllm

    venv_dir, model_dir = ensure_vllm_ready(Path(__file__).parents[1])
    with start_real_vllm(venv_dir, model_dir, free_port(), tmp_path_factory.mktemp("vllm")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on loopback for the whole session; stopped at its end."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_server(redis_session: RedisServer) -> Iterator[RedisServer]:
    """The session's redis-server, empty and running (a test may kill it; it is restarted)."""
    if redis_session.process is None:
        redis_session.start()
    redis_session.flush()
    yield redis_session
    if redis_session.process is None:
        redis_session.start()
