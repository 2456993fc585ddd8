"""The hot-path Redis client against a real redis-server: pipelining, scripts, failures."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from infermeter.serving import free_port
from sidecar.resp import Endpoint, NoScriptError, ReplyError, RespClient, Script, parse_url
from tests.redis_server import RedisServer

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

ECHO = Script("return ARGV[1]")


def client_of(redis: RedisServer, timeout_seconds: float = 2.0, **backoff: float) -> RespClient:
    """A client of the test's redis-server."""
    return RespClient(Endpoint(port=redis.port), timeout_seconds, **backoff)


async def test_concurrent_calls_pipeline_on_one_connection_and_get_their_own_replies(
    redis_server,
):
    """A thousand calls at once each get the reply to their own command, over one connection."""
    client = client_of(redis_server)
    replies = await asyncio.gather(*(client.call("ECHO", f"v{i}") for i in range(1000)))
    assert replies == [f"v{i}".encode() for i in range(1000)]
    ids = await asyncio.gather(*(client.call("CLIENT", "ID") for _ in range(20)))
    assert len(set(ids)) == 1
    await client.close()


async def test_a_pipeline_returns_replies_in_order_with_errors_in_place(redis_server):
    """One write of three commands gives three replies in order; an error reply takes its slot."""
    client = client_of(redis_server)
    replies = await client.pipeline([("SET", "k", 1), ("LPUSH", "k", "x"), ("INCR", "k")])
    assert replies[0] == b"OK"
    assert isinstance(replies[1], ReplyError)
    assert str(replies[1]).startswith("WRONGTYPE")
    assert replies[2] == 2
    await client.close()


async def test_a_reply_error_surfaces_as_an_error_and_the_connection_goes_on(redis_server):
    """An error reply raises ReplyError with Redis's message; the next call is answered."""
    client = client_of(redis_server)
    await client.call("SET", "k", "not a number")
    with pytest.raises(ReplyError, match="ERR value is not an integer"):
        await client.call("INCR", "k")
    assert await client.call("GET", "k") == b"not a number"
    assert (await client.call("CLIENT", "ID")) == (await client.call("CLIENT", "ID"))
    await client.close()


async def test_a_cancelled_call_does_not_shift_the_replies_of_the_next(redis_server):
    """The reply to a call whose caller gave up is dropped, not handed to the next caller."""
    client = client_of(redis_server)
    await client.call("PING")
    abandoned = asyncio.get_running_loop().create_task(client.call("ECHO", "first"))
    await asyncio.sleep(0)  # it is written and waiting for its reply
    abandoned.cancel()
    assert await client.call("ECHO", "second") == b"second"
    await client.close()


async def test_evalsha_loads_the_script_again_after_script_flush(redis_server):
    """After SCRIPT FLUSH, EVALSHA answers NOSCRIPT and evalsha loads the script and runs it."""
    client = client_of(redis_server)
    assert await client.evalsha(ECHO, [], ["before"]) == b"before"
    await client.call("SCRIPT", "FLUSH")
    with pytest.raises(NoScriptError):
        await client.call("EVALSHA", ECHO.sha, 0, "x")
    assert await client.evalsha(ECHO, [], ["after"]) == b"after"
    await client.call("SCRIPT", "FLUSH")
    replies = await asyncio.gather(*(client.evalsha(ECHO, [], [str(i)]) for i in range(50)))
    assert replies == [str(i).encode() for i in range(50)]
    await client.close()


async def test_server_killed_and_restarted_mid_traffic(redis_server):
    """Calls sent while Redis is down fail, later ones succeed, and each answer is its own."""
    client = client_of(redis_server, max_backoff_seconds=0.1)
    phase = "before"
    counts = {("before", True): 0, ("down", False): 0, ("after", True): 0}
    stop = False

    async def traffic(n: int) -> None:
        i = 0
        while not stop:
            i += 1
            value, sent_in = f"{n}:{i}", phase
            try:
                assert await client.call("ECHO", value) == value.encode()
                ok = True
            except (ConnectionError, TimeoutError):
                ok = False
                await asyncio.sleep(0.005)
            counts[sent_in, ok] = counts.get((sent_in, ok), 0) + 1

    tasks = [asyncio.get_running_loop().create_task(traffic(n)) for n in range(16)]
    await asyncio.sleep(0.3)
    redis_server.kill()
    phase = "down"
    await asyncio.sleep(0.3)
    redis_server.start()
    phase = "restarted"
    await asyncio.sleep(0.3)  # the last failed attempt's backoff (at most 0.1 s), then back
    phase = "after"
    await asyncio.sleep(0.3)
    stop = True
    await asyncio.gather(*tasks)
    assert counts["before", True] > 0
    assert counts["down", False] > 0
    assert counts.get(("down", True), 0) == 0
    assert counts["after", True] > 0
    assert counts.get(("after", False), 0) == 0
    await client.close()


async def test_a_paused_server_times_out_every_waiting_call_then_answers_again(redis_server):
    """Calls to a server that stopped answering raise TimeoutError at the deadline, not later."""
    client = client_of(redis_server, timeout_seconds=0.2)
    await client.call("PING")
    redis_server.pause()
    try:
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(client.call("ECHO", str(i)) for i in range(5)), return_exceptions=True
        )
        elapsed = time.monotonic() - started
    finally:
        redis_server.resume()
    assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
    # The deadline (less the loop's clock granularity: libuv's timers count whole milliseconds
    # from the start of the loop's turn), plus what a loaded machine adds.
    assert 0.2 - 0.005 <= elapsed < 1.0
    assert await client.call("ECHO", "back") == b"back"
    await client.close()


async def test_a_connection_answering_steadily_never_times_out(redis_server):
    """Calls answered in time keep the connection however long the traffic lasts past the timeout."""
    client = client_of(redis_server, timeout_seconds=0.1)
    first = await client.call("CLIENT", "ID")
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        await asyncio.gather(*(client.call("PING") for _ in range(8)))
        await asyncio.sleep(0.01)
    assert await client.call("CLIENT", "ID") == first
    await client.close()


async def test_failed_connection_attempts_back_off(tmp_path):
    """After a refused connection the next attempt waits its backoff; calls meanwhile fail fast."""
    server = RedisServer(tmp_path, port=free_port())
    client = client_of(server, min_backoff_seconds=1.0, max_backoff_seconds=2.0)
    with pytest.raises(ConnectionError, match="cannot connect"):
        await client.call("PING")
    refused = time.monotonic()
    with pytest.raises(ConnectionError, match="next attempt in"):
        await client.call("PING")
    server.start()
    try:
        if time.monotonic() - refused < 0.9:  # a slow start may already have used the backoff
            with pytest.raises(ConnectionError, match="next attempt in"):
                await client.call("PING")
        await asyncio.sleep(max(0.0, refused + 1.05 - time.monotonic()))
        assert await client.call("PING") == b"PONG"
    finally:
        await client.close()
        server.kill()


async def test_password_and_database_come_from_the_endpoint(redis_server):
    """The client logs in with the password and selects the database of its endpoint."""
    admin = client_of(redis_server)
    await admin.call("CONFIG", "SET", "requirepass", "s3cret")
    try:
        url = f"redis://127.0.0.1:{redis_server.port}/3"
        denied = RespClient(parse_url(url), 2.0)
        with pytest.raises(ConnectionError, match=r"NOAUTH|Authentication required"):
            await denied.call("PING")
        await denied.close()
        client = RespClient(parse_url(url, password="s3cret"), 2.0)
        await client.call("SET", "where", "db3")
        assert await client.call("SELECT", 3) == b"OK"
        assert await client.call("GET", "where") == b"db3"
        assert await admin.call("GET", "where") is None
        await client.close()
    finally:
        await admin.call("CONFIG", "SET", "requirepass", "")
        await admin.close()


@pytest.mark.parametrize(
    ("url", "password", "expected"),
    [
        ("redis://127.0.0.1:6380/2", None, Endpoint("127.0.0.1", 6380, 2)),
        ("redis://redis", None, Endpoint("redis", 6379, 0)),
        ("redis://:pw@redis:1/0", None, Endpoint("redis", 1, 0, None, "pw")),
        ("redis://u:pw@redis:1", "env", Endpoint("redis", 1, 0, "u", "env")),
        ("rediss://redis:6380/1", None, Endpoint("redis", 6380, 1, tls=True)),
        ("unix:///run/redis.sock?db=4", None, Endpoint(db=4, unix_path="/run/redis.sock")),
        ("unix://:pw@/run/redis.sock", None, Endpoint(password="pw", unix_path="/run/redis.sock")),
    ],
)
def test_parse_url_reads_host_port_database_and_login(url, password, expected):
    """A redis:// URL becomes an Endpoint; a password passed in wins over the URL's."""
    assert parse_url(url, password) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "http://u:hunter2@redis:6379",
            "scheme 'http': the scheme must be redis://, rediss:// or unix://",
        ),
        ("redis://:hunter2@redis:6379/cache", "the path must be a database number, not 'cache'"),
        ("unix://:hunter2@/run/redis.sock?db=x", "db must be a database number, not 'x'"),
    ],
)
def test_parse_url_names_what_is_wrong_and_not_the_password(url, message):
    """A URL the client cannot use is refused with the reason, without repeating the URL."""
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        parse_url(url)
    assert "hunter2" not in str(refused.value)


async def test_a_unix_socket_endpoint_is_served(tmp_path):
    """A unix:// URL reaches Redis over its Unix socket."""
    server = RedisServer(tmp_path, unix_socket=True)
    server.start()
    try:
        client = RespClient(parse_url(f"unix://{server.unix_socket}?db=2"), 2.0)
        info = (await client.call("CLIENT", "INFO")).decode().split()
        assert "flags=U" in info  # Redis's mark of a client on its Unix socket
        assert "db=2" in info
        await client.close()
    finally:
        server.kill()
