"""Retention: raw rows of closed months leave the ledger for a Hive-partitioned Parquet archive.

Every test that writes the archive runs three times: at a directory; at an fsspec URL of an
object store that cannot rename (``norename://``: fsspec's in-memory filesystem with every move
refused); and at ``s3://`` on an S3 API served over loopback (moto's server, through s3fs,
configured as a user points at MinIO or Ceph: ``AWS_ENDPOINT_URL`` and keys in the
environment). Both ways of publishing a file whole (``billing.archive_store``) are held to the
same promises.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import duckdb
import fsspec
import httpx
import pyarrow.dataset as ds
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from billing import archive, archive_store
from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.schema import HOUR_SECONDS
from infermeter.config import Config, RetentionSettings
from infermeter.serving import free_port
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage
from tests.conftest import config_ledger
from tests.servers import serving

DAY = 86_400
# 2026-12-20: raw_days 35 reaches back to 2026-11-15; November is open, so the horizon is two
# days before it: 2026-10-30 00:00 UTC.
NOW = NOV + 49 * DAY
HORIZON = NOV - 2 * DAY
ADMIN = {"authorization": "Bearer im-demo-admin"}


def _fill(ledger: Ledger) -> None:
    """Requests every 6 hours of October and November, and an hour of GPU samples on days 1
    and 31 of October and on 2 November."""
    records = [
        usage("search" if i % 2 else "assistant", OCT + i * 6 * HOUR_SECONDS, request_id=f"r-{i}")
        for i in range(4 * 61)
    ]
    result = ledger.ingest(batch("usage", records), now=NOW)
    assert result.accepted == len(records), result.rejected
    for day in (0, 30, 32):
        samples = gpu_samples(start=OCT + day * DAY)
        assert ledger.ingest(batch("gpu_samples", samples), now=NOW).accepted == len(samples)
        readings = _engine_samples(OCT + day * DAY)
        assert ledger.ingest(batch("engine_samples", readings), now=NOW).accepted == 40


def _engine_samples(start: float) -> list[dict[str, Any]]:
    """small-0's engine read every 15 s for 10 minutes from ``start``, its counters rising."""
    return [
        {
            "sample_id": f"eng-{start:.0f}-{k}",
            "replica": "small-0",
            "model": "chat-small",
            "timestamp": start + 15 * k,
            "requests_running": 1.0,
            "requests_waiting": 2.0,
            "kv_cache_usage": 0.5,
            "prompt_tokens_total": 100.0 * k,
            "generation_tokens_total": 50.0 * k,
        }
        for k in range(40)
    ]


class NoRenameFileSystem(MemoryFileSystem):  # type: ignore[misc]
    """An object store as retention must assume one: objects written whole, never moved."""

    protocol = ("norename",)

    def mv(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("an object store has no rename")

    rename = move = mv_file = mv


fsspec.register_implementation("norename", NoRenameFileSystem, clobber=True)


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """An S3 API on loopback (moto's server, a process of its own) and its bucket; the
    environment points S3 clients at it, as it would at MinIO."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "archive-test",
        "AWS_SECRET_ACCESS_KEY": "archive-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(endpoint, timeout=1.0)
                break
            time.sleep(0.05)
        fs, _ = fsspec.core.url_to_fs("s3://archive-tests", skip_instance_cache=True)
        fs.mkdir("archive-tests")
        yield "s3://archive-tests"
    finally:
        server.terminate()
        server.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=["directory", "url", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where the archive goes: a directory, a URL of an object store without rename, or S3."""
    if request.param == "directory":
        yield str((tmp_path / "archive").resolve())
        return
    if request.param == "s3":
        bucket = request.getfixturevalue("s3")
        yield f"{bucket}/{tmp_path.name}/archive"
        return
    url = f"norename://infermeter-tests/{tmp_path.name}/archive"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def filled(config: Config, tmp_path: Path) -> Iterator[Ledger]:
    """A ledger file with October (closed) and November (open)."""
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    _fill(ledger)
    Chargeback(ledger, config).close("2026-10", now=NOV + DAY)
    yield ledger
    ledger.close()


def _duckdb(sql: str, root: str = "") -> list[tuple[Any, ...]]:
    """``sql``'s rows from DuckDB alone, not the ledger (with ``root``'s filesystem, if a URL)."""
    with duckdb.connect() as con:
        archive_store.readable(con, [root])
        return con.execute(sql).fetchall()


def _count(ledger: Ledger, sql: str) -> int:
    with ledger.reader() as cur:
        row = cur.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def test_the_horizon_is_raw_days_back_or_two_days_before_the_first_month_computed() -> None:
    """With November open the horizon stops before it; with it closed, raw_days decides."""
    assert archive.horizon(NOW, 35, ["2026-11"]) == HORIZON
    assert archive.horizon(NOW, 35, []) == NOW - 35 * DAY
    assert archive.horizon(NOW, 5, []) == NOV + 30 * DAY - 2 * DAY  # the current month's margin


def test_rows_before_the_horizon_move_and_the_statements_stay(
    filled: Ledger, config: Config, root: str
) -> None:
    """October's rows before the horizon leave the ledger; both months' statements are unchanged."""
    charge = Chargeback(filled, config)
    before = {m: charge.statement(m).lines.to_dicts() for m in ("2026-10", "2026-11")}
    total = _count(filled, "SELECT count(*) FROM usage")
    moved = _count(filled, f"SELECT count(*) FROM usage WHERE received_at < {HORIZON}")
    report = archive.retain(filled, root, 35, now=NOW)
    assert report.horizon == HORIZON
    assert report.moved == {"usage": moved, "gpu_samples": 360, "engine_samples": 40}
    assert _count(filled, "SELECT count(*) FROM usage") == total - moved
    assert _count(filled, f"SELECT count(*) FROM usage WHERE received_at < {HORIZON}") == 0
    after = {m: Chargeback(filled, config).statement(m).lines.to_dicts() for m in before}
    assert after == before
    assert _count(filled, "SELECT count(*) FROM engine_samples") == 80
    again = archive.retain(filled, root, 35, now=NOW)
    assert again.moved == {"usage": 0, "gpu_samples": 0, "engine_samples": 0}


def test_other_engines_read_the_archive_as_hive_partitioned_parquet(
    filled: Ledger, root: str
) -> None:
    """pyarrow.dataset and DuckDB alone find each kind, cluster and month, with every moved row
    once."""
    with filled.reader() as cur:
        ids = {
            r[0]
            for r in cur.execute(
                f"SELECT request_id FROM usage WHERE received_at < {HORIZON}"
            ).fetchall()
        }
    archive.retain(filled, root, 35, now=NOW, cluster="eu-west")
    fs, path = fsspec.core.url_to_fs(root)
    # One dataset per kind: each kind is a table of its own, with its own columns.
    table = ds.dataset(
        f"{path}/kind=usage", filesystem=fs, format="parquet", partitioning="hive"
    ).to_table(columns=["request_id", "cluster", "month"])
    assert sorted(table.column("request_id").to_pylist()) == sorted(ids)
    assert set(table.column("month").to_pylist()) == {"2026-10"}
    assert set(table.column("cluster").to_pylist()) == {"eu-west"}
    rows = _duckdb(
        f"SELECT kind, cluster, month, count(*), count(DISTINCT coalesce(request_id, sample_id)) "
        f"FROM read_parquet('{root}/**/*.parquet', hive_partitioning = true, union_by_name = true) "
        "GROUP BY ALL ORDER BY ALL",
        root,
    )
    assert rows == [
        ("engine_samples", "eu-west", "2026-10", 40, 40),
        ("gpu_samples", "eu-west", "2026-10", 360, 360),
        ("usage", "eu-west", "2026-10", len(ids), len(ids)),
    ]


def test_a_record_before_the_archived_month_is_refused(filled: Ledger, root: str) -> None:
    """After a run, ingest refuses a record of the archived month, even one never seen, by name."""
    archive.retain(filled, root, 35, now=NOW)
    late = usage("search", OCT + 30 * DAY + 7200)  # 2026-10-31: after the horizon, same month
    result = filled.ingest(batch("usage", [late]), now=NOW)
    assert result.accepted == 0
    assert [r.reason for r in result.rejected] == [
        "received_at: in a month the ledger has archived (before 2026-11-01 UTC)"
    ]
    fresh = usage("search", NOV + 40 * DAY)
    assert filled.ingest(batch("usage", [fresh]), now=NOW).accepted == 1


def test_a_run_that_stopped_after_its_manifest_is_completed(filled: Ledger, root: str) -> None:
    """Files and manifest written, ledger untouched: the next run deletes those rows, once."""
    total = _count(filled, "SELECT count(*) FROM usage")
    manifest = archive._export(
        filled, archive.open_store(root), archive.RAW_KINDS[0], "crashed", HORIZON, "default"
    )
    assert manifest is not None
    archive.open_store(root).write_bytes(
        archive.manifest_path("crashed", "usage", "default"), manifest.to_bytes()
    )
    report = archive.retain(filled, root, 35, now=NOW)
    assert report.completed == ["crashed-usage"]
    assert report.moved["usage"] == 0  # the crashed run's files hold them all
    kept = _count(filled, "SELECT count(*) FROM usage")
    on_file = _duckdb(f"SELECT count(*) FROM '{root}/kind=usage/**/*.parquet'", root)[0][0]
    assert (kept + on_file, kept) == (total, total - manifest.rows)


def test_a_run_that_stopped_before_its_manifest_leaves_nothing_behind(
    filled: Ledger, root: str
) -> None:
    """Files without a manifest are removed and written again; no row is in two files."""
    store = archive.open_store(root)
    total = _count(filled, "SELECT count(*) FROM usage")
    assert (
        archive._export(filled, store, archive.RAW_KINDS[0], "crashed", HORIZON, "default")
        is not None
    )
    left = ["kind=usage/cluster=default/month=2026-10/part-crashed.parquet"]
    if isinstance(store, archive_store.DirectoryStore):  # only a directory has temp names
        store.write_bytes("kind=usage/cluster=default/month=2026-10/.part-x.parquet.tmp", b"half")
        left.insert(0, "kind=usage/cluster=default/month=2026-10/.part-x.parquet.tmp")
    report = archive.retain(filled, root, 35, now=NOW)
    assert report.removed == left
    on_file = _duckdb(
        f"SELECT count(*), count(DISTINCT request_id) FROM '{root}/kind=usage/**/*.parquet'", root
    )[0]
    assert on_file == (report.moved["usage"],) * 2
    assert _count(filled, "SELECT count(*) FROM usage") + on_file[0] == total


def test_an_altered_file_stops_the_run_and_deletes_nothing(filled: Ledger, root: str) -> None:
    """A manifest's file whose checksum differs is an error, and the ledger keeps its rows."""
    store = archive.open_store(root)
    total = _count(filled, "SELECT count(*) FROM usage")
    manifest = archive._export(filled, store, archive.RAW_KINDS[0], "crashed", HORIZON, "default")
    assert manifest is not None
    store.write_bytes(archive.manifest_path("crashed", "usage", "default"), manifest.to_bytes())
    store.remove(manifest.files[0]["path"])
    store.write_bytes(manifest.files[0]["path"], b"not parquet")
    with pytest.raises(archive.ArchiveError, match="missing or not what manifest crashed-usage"):
        archive.retain(filled, root, 35, now=NOW)
    assert _count(filled, "SELECT count(*) FROM usage") == total


def test_clusters_sharing_a_root_leave_each_other_alone(
    filled: Ledger, root: str, config: Config, tmp_path: Path
) -> None:
    """Another cluster's run, stopped before or after its manifest, is neither removed nor
    completed by this cluster's retention: only its own ledger may do either."""
    store = archive.open_store(root)
    other = config_ledger(config, tmp_path / "other.duckdb")
    try:
        _fill(other)
        Chargeback(other, config).close("2026-10", now=NOV + DAY)
        kind = archive.RAW_KINDS[0]
        half = archive._export(other, store, kind, "other-half", HORIZON, "us-east")
        whole = archive._export(other, store, kind, "other-whole", HORIZON, "us-east")
        assert half is not None
        assert whole is not None
        store.write_bytes(
            archive.manifest_path("other-whole", "usage", "us-east"), whole.to_bytes()
        )
        report = archive.retain(filled, root, 35, now=NOW, cluster="eu-west")
        assert report.removed == []
        assert report.completed == []
        assert {k for _, k in archive.runs(filled)} == {"usage", "gpu_samples", "engine_samples"}
        assert not any("other" in run for run, _ in archive.runs(filled))
        theirs = store.files("kind=usage/cluster=us-east")
        assert [p.rsplit("/", 1)[1] for p in theirs] == [
            "part-other-half.parquet",
            "part-other-whole.parquet",
        ]
        # The other ledger's own next run completes its manifest and removes its orphan.
        again = archive.retain(other, root, 35, now=NOW, cluster="us-east")
        assert again.completed == ["other-whole-usage"]
        assert again.removed == [theirs[0]]
    finally:
        other.close()


def test_an_unknown_url_scheme_is_a_configuration_error() -> None:
    """An archive URL whose filesystem cannot be opened here is refused when the file is read,
    naming the scheme, not when the first retention runs a month later."""
    with pytest.raises(ValueError, match="nope:// is not a filesystem this installation can open"):
        RetentionSettings(archive="nope://bucket/archive")
    assert RetentionSettings(archive="memory://bucket/archive").archive == "memory://bucket/archive"


@pytest.fixture
async def served(filled: Ledger, config: Config, root: str) -> AsyncIterator[str]:
    """The billing API over the ledger after a retention run."""
    archive.retain(filled, root, 35, now=NOW)
    async with serving(create_app(config, filled), lifespan="off") as url:
        yield url


async def test_the_records_route_reads_the_archive(served: str, filled: Ledger) -> None:
    """``GET /v1/usage/records`` finds a record that left for the archive, whole."""
    async with httpx.AsyncClient(base_url=served, headers=ADMIN) as c:
        found = (await c.get("/v1/usage/records", params={"id": "r-0"})).json()["records"]
    assert _count(filled, "SELECT count(*) FROM usage WHERE request_id = 'r-0'") == 0
    assert [(r["request_id"], r["team"], r["received_at"]) for r in found] == [
        ("r-0", "assistant", OCT)
    ]


async def test_the_query_api_reads_archived_samples(served: str, filled: Ledger) -> None:
    """``GET /v1/query/engine`` over an archived hour answers from the archive's samples."""
    assert _count(filled, f"SELECT count(*) FROM engine_samples WHERE timestamp < {HORIZON}") == 0
    params = {"from": OCT, "to": OCT + 3600, "step": 600}
    async with httpx.AsyncClient(base_url=served, headers=ADMIN) as c:
        answer = (await c.get("/v1/query/engine", params=params)).json()
    rows = [dict(zip(answer["columns"], row, strict=True)) for row in answer["rows"]]
    assert [(r["replica"], r["requests_waiting"]) for r in rows] == [("small-0", 2.0)]


async def test_the_timer_runs_retention(filled: Ledger, root: str) -> None:
    """``retaining`` runs a retention every interval in the service, until cancelled, writing
    under the cluster it is given."""
    settings = RetentionSettings(archive=root, interval_seconds=0.05)
    task = asyncio.create_task(archive.retaining(filled, settings, "eu-west"))
    try:
        for _ in range(200):
            if len(archive.runs(filled)) == len(archive.RAW_KINDS):  # one run, every table
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # Today, November is still open: the horizon is two days before it, as at NOW.
    assert {kind for _, kind in archive.runs(filled)} == {"usage", "gpu_samples", "engine_samples"}
    assert _count(filled, f"SELECT count(*) FROM usage WHERE received_at < {HORIZON}") == 0
    written = archive.open_store(root).files("kind=usage")
    assert written
    assert all(path.startswith("kind=usage/cluster=eu-west/month=") for path in written)
