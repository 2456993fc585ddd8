"""The sidecar's own memory of gateway nonces: kept on disk across restarts, and bounded."""

from __future__ import annotations

from sidecar.nonces import NonceFile

NOW = 1_800_000_000
WINDOW = 300.0


def _nonce(i: int) -> str:
    return f"nonce-{i:016d}"


async def test_a_nonce_served_before_a_restart_is_refused_after_it(tmp_path):
    """Another NonceFile on the same directory (a restarted sidecar) refuses what was served."""
    first = NonceFile(tmp_path, WINDOW, 1000)
    assert await first.admit(_nonce(1), NOW, NOW) is None
    await first.close()
    second = NonceFile(tmp_path, WINDOW, 1000)
    assert await second.admit(_nonce(1), NOW, NOW + 5) == "replayed"
    assert await second.admit(_nonce(2), NOW, NOW + 5) is None
    await second.close()


async def test_a_nonce_is_on_disk_before_admit_returns(tmp_path):
    """Nothing waits for close or fsync: a kill right after admit still leaves the line."""
    store = NonceFile(tmp_path, WINDOW, 1000)
    assert await store.admit(_nonce(7), NOW, NOW) is None
    lines = b"".join(p.read_bytes() for p in tmp_path.glob("nonces-*.log"))
    assert f"{NOW} {_nonce(7)}\n".encode() in lines
    await store.close()


async def test_the_file_stays_bounded_and_what_the_memory_forgot_stays_refused(tmp_path):
    """10,000 nonces into a memory of 100: the file never holds more than 2 x 100 lines past a
    rewrite, and after a restart the oldest nonces are refused as stale, the newest as replayed."""
    store = NonceFile(tmp_path, WINDOW, 100)
    most = 0
    for i in range(10_000):
        assert await store.admit(_nonce(i), NOW + i // 100, NOW + 100) is None
        most = max(most, sum(len(p.read_bytes().splitlines()) for p in tmp_path.iterdir()))
    await store.close()
    assert most <= 2 * 100 + 1
    assert len(list(tmp_path.iterdir())) == 1
    again = NonceFile(tmp_path, WINDOW, 100)
    assert await again.admit(_nonce(0), NOW, NOW + 100) == "stale"
    assert await again.admit(_nonce(9_999), NOW + 99, NOW + 100) == "replayed"
    assert await again.admit(_nonce(10_000), NOW + 100, NOW + 100) is None
    await again.close()


async def test_nonces_past_the_window_are_dropped_when_the_file_is_rewritten(tmp_path):
    """A rewrite keeps only what the memory holds: nonces the clock refuses anyway are gone."""
    store = NonceFile(tmp_path, WINDOW, 4)  # rewritten every 8 lines
    for i in range(2):
        assert await store.admit(_nonce(i), NOW, NOW) is None
    later = NOW + int(WINDOW) + 10
    for i in range(2, 8):
        assert await store.admit(_nonce(i), later + i, later + i) is None
    await store.close()
    kept = b"".join(p.read_bytes() for p in tmp_path.glob("nonces-*.log"))
    assert _nonce(0).encode() not in kept
    assert _nonce(7).encode() in kept


async def test_a_torn_last_line_is_skipped(tmp_path):
    """The cut end of a line written when the process died is ignored; whole lines are kept."""
    (tmp_path / "nonces-000000000000.log").write_bytes(
        f"{NOW} {_nonce(1)}\n{NOW} nonce-00".encode()
    )
    store = NonceFile(tmp_path, WINDOW, 1000)
    assert await store.admit(_nonce(1), NOW, NOW + 1) == "replayed"
    assert await store.admit(_nonce(2), NOW, NOW + 1) is None
    await store.close()
