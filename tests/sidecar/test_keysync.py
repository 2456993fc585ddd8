"""Keys issued at run time reach every sidecar within the bound, from billing or through Redis,
and a sidecar keeps serving the keys it knew while billing is down. Real billing (a DuckDB file),
real sidecars in front of simulated replicas, real redis-server, all on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from billing.api import create_app
from billing.key_publish import RedisPublisher
from infermeter.config import SharedLimitsSettings
from infermeter.key_set_seal import seal, signing_key
from infermeter.keys import IssuedKey, IssuedKeys, redis_keys
from infermeter.serving import free_port
from tests.conftest import config_ledger
from tests.servers import serving
from tests.sidecar.conftest import make_config

ADMIN, SPEND = "im-demo-admin", "im-demo-spend"
CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# What docs/identity.md promises: a new or revoked key is taken by every sidecar within this.
BOUND_SECONDS = 5.0


@pytest.fixture(autouse=True)
def spend_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecars hold the spend_reader token, as the demo gives them."""
    monkeypatch.setenv("INFERMETER_SPEND_TOKEN", SPEND)


@contextlib.asynccontextmanager
async def billing_at(
    port: int, path: Path, publisher: RedisPublisher | None = None
) -> AsyncIterator[str]:
    """Billing on ``port`` over the ledger file ``path``, for the block."""
    config = make_config("http://127.0.0.1:1")
    ledger = config_ledger(config, path)
    try:
        async with serving(
            create_app(config, ledger, key_publisher=publisher), port, lifespan="off"
        ) as url:
            yield url
    finally:
        ledger.close()


async def issue(billing: str, **request: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=billing) as client:
        made = await client.post(
            "/v1/keys", json=request, headers={"authorization": f"Bearer {ADMIN}"}
        )
    assert made.status_code == 201, made.text
    body: dict[str, Any] = made.json()
    return body


async def revoke(billing: str, key_id: str) -> None:
    async with httpx.AsyncClient(base_url=billing) as client:
        gone = await client.post(
            f"/v1/keys/{key_id}/revoke", headers={"authorization": f"Bearer {ADMIN}"}
        )
    assert gone.status_code == 200, gone.text


async def status(url: str, key: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answer = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}
        )
    return answer.status_code


async def until(check: Callable[[], Any], want: int, seconds: float) -> float:
    """Seconds until ``check()`` answers ``want``; fails past ``seconds``."""
    start = time.monotonic()
    while True:
        if await check() == want:
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, f"not {want} within {seconds} s"
        await asyncio.sleep(0.05)


async def test_a_new_key_is_served_and_a_revoked_one_refused_within_the_bound(
    stack_factory, tmp_path
):
    """Polling billing: issued, the key is served within the bound; revoked, refused within it."""
    port = free_port()
    async with billing_at(port, tmp_path / "ledger.duckdb") as billing:
        stack = await stack_factory(**{"billing.url": billing})
        key = await issue(billing, team="search", member="ana")
        took = await until(lambda: status(stack.url, key["key"]), 200, BOUND_SECONDS)
        await revoke(billing, key["key_id"])
        gone = await until(lambda: status(stack.url, key["key"]), 401, BOUND_SECONDS)
    print(f"new key served after {took:.2f} s, revoked key refused after {gone:.2f} s")
    [record] = [r for r in (await stack.records()) if r["status"] == "ok"][-1:]
    assert record["team"] == "search"


async def test_a_sidecar_keeps_the_keys_it_knew_while_billing_is_down(stack_factory, tmp_path):
    """Billing stopped: the running sidecar serves the key, and a sidecar started afresh on the
    same spool directory takes it from the copy it kept."""
    port = free_port()
    async with billing_at(port, tmp_path / "ledger.duckdb") as billing:
        stack = await stack_factory(**{"billing.url": billing})
        key = await issue(billing, team="research")
        await until(lambda: status(stack.url, key["key"]), 200, BOUND_SECONDS)
    await asyncio.sleep(1.5)  # a few sync rounds against a billing that is gone
    assert await status(stack.url, key["key"]) == 200
    assert (stack.spool / "issued-keys.json").exists()
    from sidecar.app import Sidecar

    again = Sidecar(
        make_config(stack.upstream, **{"billing.url": billing}), "small-0", spool_dir=stack.spool
    )
    assert again.view.keys.team_for(key["key"]) == "research"


def shared_settings(redis_url: str) -> SharedLimitsSettings:
    """The sidecars' shared limits in the Redis at ``redis_url``, as the config gives them."""
    return make_config(
        "http://127.0.0.1:1", **{"sidecar.shared_limits.redis_url": redis_url}
    ).sidecar.shared_limits


def forged_key(team: str) -> tuple[str, IssuedKey]:
    """A key of the attacker's making for ``team``: the secret, and the entry naming its digest."""
    secret = "imk_forged000001_" + "x" * 43
    entry = IssuedKey(
        key_id="forged000001",
        role="member",
        team=team,
        digest=hashlib.sha256(secret.encode()).hexdigest(),
        created_at=time.time(),
        created_by="@admin",
    )
    return secret, entry


async def test_through_redis_a_sidecar_takes_only_the_sets_billing_signed(
    tmp_path: Path, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar learns billing's signing key from billing, then takes sets from Redis with
    billing down; a set written there by anyone else (unsigned, or signed with another key,
    with a key of the writer's making for any team) is never taken, and is said once."""
    import redis
    import redis.asyncio as aioredis

    from sidecar.keysync import KeySync

    settings = shared_settings(redis_server.url)
    publisher = RedisPublisher(settings, signing_key(b"billing's secret"))
    taken: list[IssuedKeys] = []
    port = free_port()
    client_redis = aioredis.Redis.from_url(redis_server.url)
    set_key, version_key = redis_keys(settings.key_prefix)
    caplog.set_level("ERROR", logger="infermeter.sidecar")
    try:
        async with httpx.AsyncClient() as client:
            sync = KeySync(
                taken.append,
                tmp_path,
                lambda: client,
                f"http://127.0.0.1:{port}",
                SPEND,
                client_redis,
                settings.key_prefix,
            )
            async with billing_at(port, tmp_path / "ledger.duckdb", publisher) as billing:
                first = await issue(billing, team="assistant")
                assert await sync.poll() is True  # from billing: no signing key known yet
            assert sync.signer is not None
            genuine = taken[-1]
            assert set(genuine.by_id) == {first["key_id"]}

            _, forged = forged_key("search")
            with_forged = IssuedKeys.of(genuine.version + 100, [*genuine.by_id.values(), forged])
            writer = redis.Redis.from_url(redis_server.url)
            attempts = (
                orjson.dumps(with_forged.to_json()),  # as billing wrote it before it signed
                seal(with_forged, signing_key(b"another secret")),
                seal(with_forged, publisher._signer).replace(b'"search"', b'"assistant"'),
            )
            for i, value in enumerate(attempts):
                writer.set(set_key, value)
                writer.set(version_key, with_forged.version + i)
                for _ in range(2):
                    assert await sync.poll() is False
                assert sync.current is genuine  # (the forged key's entry never taken)
            refusals = [r for r in caplog.records if "is not taken" in r.getMessage()]
            assert len(refusals) == len(attempts)  # once per attempt, not once per poll

            # Billing (its HTTP down) writes a newer set: taken from Redis, checked.
            newer = IssuedKeys.of(with_forged.version + 5, [*genuine.by_id.values()])
            publisher.publish(newer)
            assert await sync.poll() is True
            assert taken[-1].version == newer.version
            writer.close()
    finally:
        await client_redis.aclose()


async def test_a_key_written_into_redis_by_a_pod_is_refused_by_the_sidecar(
    stack_factory, tmp_path, redis_server
):
    """End to end: keys billing issues are served through Redis; a key for team search that a
    pod holding the Redis password writes there, with a higher version, is refused (401)."""
    import redis

    config = make_config(
        "http://127.0.0.1:1", **{"sidecar.shared_limits.redis_url": redis_server.url}
    )
    settings = config.sidecar.shared_limits
    publisher = RedisPublisher(settings, signing_key(b"billing's secret"))
    async with billing_at(free_port(), tmp_path / "ledger.duckdb", publisher) as billing:
        stack = await stack_factory(
            **{"billing.url": billing, "sidecar.shared_limits.redis_url": redis_server.url}
        )
        kept = await issue(billing, team="assistant")
        gone = await issue(billing, team="assistant")
        await until(lambda: status(stack.url, kept["key"]), 200, BOUND_SECONDS)
        await revoke(billing, gone["key_id"])
        await until(lambda: status(stack.url, gone["key"]), 401, BOUND_SECONDS)
        secret, forged = forged_key("search")
        current = stack.sidecar.keysync.current
        assert current is not None
        planted = IssuedKeys.of(current.version + 100, [*current.by_id.values(), forged])
        set_key, version_key = redis_keys(settings.key_prefix)
        writer = redis.Redis.from_url(redis_server.url)
        writer.set(set_key, orjson.dumps(planted.to_json()))
        writer.set(version_key, planted.version)
        writer.close()
        deadline = time.monotonic() + 3 * config.sidecar.key_sync_seconds + 1
        while time.monotonic() < deadline:
            assert await status(stack.url, secret) == 401
            await asyncio.sleep(0.2)
        assert await status(stack.url, kept["key"]) == 200


async def test_after_the_bound_no_request_with_a_revoked_key_is_admitted_under_load(
    stack_factory, tmp_path
):
    """Eight clients send with one key without pause; it is revoked mid-stream: no request sent
    later than the bound after the revocation is admitted, on either of two sidecars."""
    async with billing_at(free_port(), tmp_path / "ledger.duckdb") as billing:
        stacks = [await stack_factory(**{"billing.url": billing}) for _ in range(2)]
        key = await issue(billing, team="search", project="load")
        for s in stacks:
            await until(functools.partial(status, s.url, key["key"]), 200, BOUND_SECONDS)
        sent: list[tuple[float, int]] = []
        stop = time.monotonic() + 3 + BOUND_SECONDS + 2

        async def hammer(url: str) -> None:
            async with httpx.AsyncClient(
                base_url=url, timeout=30, headers={"authorization": f"Bearer {key['key']}"}
            ) as client:
                while time.monotonic() < stop:
                    at = time.monotonic()
                    answer = await client.post("/v1/chat/completions", json=CHAT)
                    sent.append((at, answer.status_code))

        load = [asyncio.create_task(hammer(s.url)) for s in stacks for _ in range(4)]
        await asyncio.sleep(3)
        revoked_at = time.monotonic()
        await revoke(billing, key["key_id"])
        await asyncio.gather(*load)
    before = [code for at, code in sent if at < revoked_at]
    after_bound = [code for at, code in sent if at > revoked_at + BOUND_SECONDS]
    admitted_late = [at - revoked_at for at, code in sent if at >= revoked_at and code == 200]
    assert before
    assert set(before) == {200}
    assert after_bound
    assert set(after_bound) == {401}
    print(
        f"{len(sent)} requests; the last admitted was sent {max(admitted_late, default=0):.2f} s "
        "after the revocation"
    )


async def test_billing_out_of_reach_is_said_once_and_its_return_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar that starts before billing (as the demo's do) warns once, not every round, and
    says when billing answers again, so the warning is not left standing."""
    from sidecar.keysync import KeySync

    port = free_port()
    taken: list[Any] = []
    async with httpx.AsyncClient() as client:
        sync = KeySync(
            taken.append, tmp_path, lambda: client, f"http://127.0.0.1:{port}", SPEND, None, "im"
        )
        caplog.set_level("WARNING", logger="infermeter.sidecar")
        for _ in range(3):
            assert await sync.poll() is False
        async with billing_at(port, tmp_path / "ledger.duckdb") as billing:
            await issue(billing, team="search")
            assert await sync.poll() is True
            assert await sync.poll() is False  # nothing newer
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("issued keys")]
    assert lines == [
        "issued keys: neither Redis nor billing answers; serving the configured keys only",
        "issued keys: billing answers again",
    ]
    assert len(taken) == 1


async def test_redis_without_a_way_to_ask_billing_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With Redis but no spend_reader token, no set in Redis can be checked: said once, at
    start, so an operator does not wait for keys that never come."""
    import redis.asyncio as aioredis

    from sidecar.keysync import KeySync

    client = aioredis.Redis.from_url("redis://127.0.0.1:1")
    caplog.set_level("WARNING", logger="infermeter.sidecar")
    try:
        async with httpx.AsyncClient() as http:
            KeySync(
                lambda _: None, tmp_path, lambda: http, "http://127.0.0.1:1", None, client, "im"
            )
            KeySync(
                lambda _: None, tmp_path, lambda: http, "http://127.0.0.1:1", SPEND, client, "im"
            )
    finally:
        await client.aclose()
    said = [r.getMessage() for r in caplog.records if "cannot be asked" in r.getMessage()]
    assert len(said) == 1


async def test_a_pinned_signing_key_lets_a_new_sidecar_take_the_set_while_billing_is_down(
    tmp_path: Path, redis_server: Any
) -> None:
    """With sidecar.shared_limits.key_signer, a sidecar started afresh while billing is down
    takes billing's signed set from Redis at once, and still nothing signed otherwise."""
    import redis.asyncio as aioredis

    from infermeter.key_set_seal import public_hex
    from sidecar.keysync import KeySync

    settings = shared_settings(redis_server.url)
    key = signing_key(b"billing's secret")
    publisher = RedisPublisher(settings, key)
    entry = IssuedKey("aaaaaaaaaaaa", "member", "search", "0" * 64, 1.0, "@admin")
    client_redis = aioredis.Redis.from_url(redis_server.url)
    taken: list[IssuedKeys] = []
    try:
        async with httpx.AsyncClient() as client:
            sync = KeySync(
                taken.append,
                tmp_path,
                lambda: client,
                f"http://127.0.0.1:{free_port()}",  # billing: down
                SPEND,
                client_redis,
                settings.key_prefix,
                pinned_signer=public_hex(key),
            )
            RedisPublisher(settings, signing_key(b"another")).publish(IssuedKeys.of(3, [entry]))
            assert await sync.poll() is False
            publisher.publish(IssuedKeys.of(4, [entry]))
            assert await sync.poll() is True
            assert taken[-1].version == 4
    finally:
        await client_redis.aclose()


async def test_a_pinned_signing_key_is_kept_when_billing_names_another(
    tmp_path: Path, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A billing whose writer secret does not match the pinned key is said once, as an error,
    and the sidecar goes on checking Redis's sets against the configured key only."""
    import redis.asyncio as aioredis

    from infermeter.key_set_seal import public_hex
    from sidecar.keysync import KeySync

    settings = shared_settings(redis_server.url)
    pinned = public_hex(signing_key(b"the configured secret"))
    publisher = RedisPublisher(settings, signing_key(b"billing's other secret"))
    client_redis = aioredis.Redis.from_url(redis_server.url)
    caplog.set_level("ERROR", logger="infermeter.sidecar")
    port = free_port()
    try:
        async with httpx.AsyncClient() as client:
            sync = KeySync(
                lambda _: None,
                tmp_path,
                lambda: client,
                f"http://127.0.0.1:{port}",
                SPEND,
                client_redis,
                settings.key_prefix,
                pinned_signer=pinned,
            )
            async with billing_at(port, tmp_path / "ledger.duckdb", publisher) as billing:
                await issue(billing, team="search")
                for _ in range(3):
                    await sync.poll()
    finally:
        await client_redis.aclose()
    assert sync._signer_hex == pinned
    said = [r for r in caplog.records if "the configuration" in r.getMessage()]
    assert len(said) == 1
    assert publisher.signer_hex[:16] in said[0].getMessage()


@contextlib.asynccontextmanager
async def billing_keeping_redis(path: Path, redis_url: str) -> AsyncIterator[str]:
    """Billing over the ledger file ``path``, publishing its keys into Redis and checking them
    there every two seconds, as ``infermeter billing serve`` does."""
    config = make_config("http://127.0.0.1:1", **{"sidecar.shared_limits.redis_url": redis_url})
    publisher = RedisPublisher(config.sidecar.shared_limits, signing_key(b"billing's secret"))
    ledger = config_ledger(config, path)
    app = create_app(config, ledger, key_publisher=publisher)
    keys = app.state.services.keys
    keeping = asyncio.create_task(publisher.keep(lambda: keys.issued))
    try:
        async with serving(app, free_port(), lifespan="off") as url:
            yield url
    finally:
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
        publisher.client.close()
        ledger.close()


@pytest.mark.parametrize("hold", ["version", "nothing"])
async def test_a_pod_holding_redis_cannot_keep_a_revoked_key_working(
    stack_factory: Any, tmp_path: Path, redis_server: Any, hold: str
) -> None:
    """A pod with the Redis password that keeps writing the version the sidecars already hold
    (or deletes it) over billing's own every few milliseconds: the revoked key is still refused
    by the sidecar within the bound, and the key kept is still served."""
    import redis

    async with billing_keeping_redis(tmp_path / "ledger.duckdb", redis_server.url) as billing:
        stack = await stack_factory(
            **{"billing.url": billing, "sidecar.shared_limits.redis_url": redis_server.url}
        )
        kept = await issue(billing, team="assistant")
        gone = await issue(billing, team="assistant")
        await until(lambda: status(stack.url, gone["key"]), 200, BOUND_SECONDS)
        current = stack.sidecar.keysync.current
        assert current is not None
        version_key = stack.sidecar.keysync.version_key
        stop = asyncio.Event()

        def overwrite() -> None:
            writer = redis.Redis.from_url(redis_server.url)
            while not stop.is_set():
                if hold == "version":
                    writer.set(version_key, current.version)
                else:
                    writer.delete(version_key)
                time.sleep(0.002)
            writer.close()

        pod = asyncio.create_task(asyncio.to_thread(overwrite))
        try:
            await asyncio.sleep(0.5)
            await revoke(billing, gone["key_id"])
            took = await until(lambda: status(stack.url, gone["key"]), 401, BOUND_SECONDS)
            assert await status(stack.url, kept["key"]) == 200
        finally:
            stop.set()
            await pod
    print(f"revoked key refused after {took:.2f} s with a pod holding the {hold} in Redis")
