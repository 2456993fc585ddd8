"""Billing at scale: a month of N usage records, its chargeback, and ingest through the API.

Three measurements, each printed as a table row:

``generate``  N usage records of one month (20 teams, 16 replicas, 4 models, request times
              spread over the month, 1-60 s long) written straight into a ledger file with SQL,
              64 GPUs sampled every 10 s, each replica's engine counters every 15 s (so the
              statement reconciles every hour); then the rollups built with the same SQL that
              ingest runs per batch. This is set-up, reported for completeness.
``chargeback``the month's statement (``Chargeback.statement``: rollups -> allocation -> cents),
              against a bare ``GROUP BY team, model`` over the same raw table: once with the
              hourly cost rows and reconciliation kept (after the upkeep), once with the last
              ``STALE_HOURS`` hours' reconciliation stale, as batches leave it between upkeeps,
              and once with all of it stale (the month reconciled whole, as before it was kept).
``ingest``    records/s through the HTTP API: ``infermeter billing`` as its own process, batches
              of ``--batch`` records POSTed by ``--clients`` concurrent clients, as shippers
              do: ``--format arrow`` (the default, what shippers send), ``ndjson`` (a spool
              segment's lines) or ``json`` (one object to ``/v1/ingest``). Bodies are built
              before the clock starts; the CPU the shippers' Arrow conversion takes is reported
              separately, and so is the CPU of the service and of the clients.

DuckDB runs with ``--memory-limit`` (the ``billing.memory_limit`` setting); the peak RSS of this
process and of the service is reported beside it.

    .venv/bin/python -m bench.billing_scale --records 100000000
    .venv/bin/python -m bench.billing_scale --records 2000000 --skip-ingest
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from billing import allocation_runs, hourly, ingest_sql, reconciliation_hours
from billing.chargeback import Chargeback
from billing.fastpath import arrow_frame, ndjson_frame
from billing.ledger import Ledger
from infermeter import wire, writers
from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.records import USAGE, UsageRecord
from infermeter.statement import Statement

MONTH = "2026-10"
START = 1790812800  # 2026-10-01T00:00:00Z
SECONDS = 31 * 86400
TEAMS = [f"team-{i:02d}" for i in range(20)]
REPLICAS = [f"rep-{i:02d}" for i in range(16)]
WRITER_SECRET = b"bench writer secret"
# Hours at the end of the month whose reconciliation is stale in the second statement timed:
# what ingest leaves between two upkeeps (the hour before the newest records and readings, and
# the one before that when the fleet's newest reading less the stale wait falls in it), and one more.
STALE_HOURS = 3


def bench_config(database: Path, memory_limit: str, port: int) -> tuple[dict[str, Any], Config]:
    """The embedded defaults with 20 teams, 16 replicas on H100s and the ledger at ``database``."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["teams"] = [{"name": t, "budget_usd_per_month": 10000} for t in TEAMS]
    data["replicas"] = [
        {
            "id": r,
            "model": ("chat-large", "chat-small")[i % 2],
            "upstream_url": f"http://127.0.0.1:{30000 + i}",
            "node": f"node-{i // 4}",
            "gpu_model": "H100",
            "gpu_count": 4,
        }
        for i, r in enumerate(REPLICAS)
    ]
    data["nodes"] = []
    data["billing"].update(
        database=str(database),
        memory_limit=memory_limit,
        listen=f"127.0.0.1:{port}",
        url=f"http://127.0.0.1:{port}",
    )
    return data, Config.model_validate(data)


def generate(ledger: Ledger, records: int) -> None:
    """Fill the raw tables with SQL, then build the rollups with ingest's own statements."""
    con = ledger._con  # the benchmark is the one writer here
    teams = "[" + ", ".join(f"'{t}'" for t in TEAMS) + "]"
    replicas = "[" + ", ".join(f"'{r}'" for r in REPLICAS) + "]"
    con.execute(f"""
        INSERT INTO usage (request_id, team, model, served_version, replica, received_at,
            first_token_at, finished_at, prompt_tokens, cached_prompt_tokens, completion_tokens,
            status, http_status, stream, endpoint, finish_reason, usage_exact, ingested_at)
        SELECT 'req-' || i, {teams}[1 + (hash(i) % 20)::INT], ['chat-large', 'chat-small'][1 + (i % 2)::INT],
            'v1', {replicas}[1 + (hash(i * 7) % 16)::INT],
            {START} + (i * {SECONDS}.0 / {records}) AS received_at,
            {START} + (i * {SECONDS}.0 / {records}) + 0.05 + (hash(i * 3) % 1000) / 2000.0,
            {START} + (i * {SECONDS}.0 / {records}) + 1 + (hash(i * 5) % 60),
            50 + hash(i * 11) % 2000, 0, 10 + hash(i * 13) % 500, 'ok', 200, true,
            '/v1/chat/completions', 'stop', true, {START + SECONDS}
        FROM range({records}) t(i)
    """)
    gpus = "[" + ", ".join(f"'{g}'" for g in range(4)) + "]"
    con.execute(f"""
        INSERT INTO gpu_samples (sample_id, node, gpu, uuid, gpu_model, replica, model, "timestamp",
            interval_seconds, utilization, power_watts, energy_joules, memory_used_mib,
            memory_free_mib, xid_errors, mig_profile, gap, ingested_at)
        SELECT 'gpu-' || r || '-' || g || '-' || k, 'node-' || r // 4, g, 'GPU-' || r || '-' || g, 'H100',
            {replicas}[r + 1], 'm', {START} + (k + 1) * 10.0, 10.0, 0.6, 420.0, 4200.0, 1.0, 1.0, 0, NULL,
            false, {START + SECONDS}
        FROM range(16) a(r), unnest({gpus}) b(g), range({SECONDS // 10}) c(k)
    """)
    engine_samples(con)
    con.execute("CREATE OR REPLACE TEMP VIEW fresh AS SELECT * EXCLUDE (ingested_at) FROM usage")
    ledger._set_teams(TEAMS)
    con.execute(ingest_sql.usage_rollup_sql())
    con.execute(ingest_sql.occupancy_rollup_sql())
    con.execute(ingest_sql.statement_rollup_sql())
    con.execute(ingest_sql.token_rollup_sql())
    con.execute(ingest_sql.ttft_rollup_sql())
    con.execute(
        "CREATE OR REPLACE TEMP VIEW fresh AS SELECT * EXCLUDE (ingested_at) FROM gpu_samples"
    )
    con.execute(ingest_sql.gpu_rollup_sql())
    con.execute(hourly.dirty_samples_sql())  # as ingest marks them; refresh_hours builds them
    engine_hours(con)
    con.execute("DROP VIEW fresh")
    con.execute("INSERT INTO months VALUES (?, NULL, false) ON CONFLICT DO NOTHING", [MONTH])
    con.execute("CHECKPOINT")


def engine_hours(con: Any) -> None:
    """``engine_hours`` from the engine samples, as ingest keeps it: the reconciliation's windows."""
    con.execute(
        "CREATE OR REPLACE TEMP VIEW fresh AS SELECT * EXCLUDE (ingested_at) FROM engine_samples"
    )
    con.execute(ingest_sql.engine_rollup_sql(bounded=False))


def engine_samples(con: Any) -> None:
    """Each replica's vLLM counters every 15 s, as the collector stores them.

    The counters run 1% ahead of the ledger's tokens plus 3 a sample (requests the ledger never
    saw), so every instance-hour reconciles to a small unattributed remainder.
    """
    models = "[" + ", ".join(f"'{('chat-large', 'chat-small')[i % 2]}'" for i in range(16)) + "]"
    replicas = "[" + ", ".join(f"'{r}'" for r in REPLICAS) + "]"
    tp = "least(coalesce(first_token_at, finished_at), finished_at)"
    con.execute(f"""
        INSERT INTO engine_samples (sample_id, replica, model, "timestamp", requests_running,
            requests_waiting, kv_cache_usage, prompt_tokens_total, generation_tokens_total,
            prefix_cache_queries_total, prefix_cache_hits_total, preemptions_total, ingested_at)
        WITH grid AS (
            SELECT r, {replicas}[r + 1] AS replica, {models}[r + 1] AS model, k
            FROM range(16) a(r), range({SECONDS // 15}) b(k)
        ),
        prompt AS (
            SELECT replica, CAST(ceil(({tp} - {START}) / 15) AS BIGINT) AS k, sum(prompt_tokens) AS n
            FROM usage GROUP BY ALL
        ),
        completion AS (
            SELECT replica, CAST(ceil((finished_at - {START}) / 15) AS BIGINT) AS k, sum(completion_tokens) AS n
            FROM usage GROUP BY ALL
        )
        SELECT 'eng-' || g.replica || '-' || g.k, g.replica, g.model, {START} + g.k * 15.0, 4, 0, 0.5,
            floor(1.01 * sum(coalesce(p.n, 0)) OVER w) + 3 * g.k,
            floor(1.01 * sum(coalesce(c.n, 0)) OVER w) + 3 * g.k,
            0, 0, 0, {START + SECONDS}
        FROM grid g LEFT JOIN prompt p USING (replica, k) LEFT JOIN completion c USING (replica, k)
        WINDOW w AS (PARTITION BY g.replica ORDER BY g.k)
    """)


def timed(fn: Any, repeat: int) -> tuple[float, float, Any]:
    """Median and min seconds of ``repeat`` runs, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), result


def print_split(chargeback: Chargeback, statement: Statement, repeat: int) -> None:
    """The files' split by instance: from the lines per instance the statement carries (what the
    CSV and FOCUS routes do), against a by-instance allocation run again (what they did before)."""
    carried, _, _ = timed(lambda: chargeback.by_instance(statement), repeat)
    bare = replace(statement, instance_parts=None)
    again, _, _ = timed(lambda: chargeback.by_instance(bare), repeat)
    print(
        f"files' split by instance: median {carried * 1000:.0f} ms from the statement's own "
        f"allocation; {again * 1000:.0f} ms with the allocation run again"
    )


def print_marks(ledger: Ledger, repeat: int) -> None:
    """What marking the kept reconciliation stale costs an engine batch: the mark's query over
    the newest reading of each instance as the batch (``reconciliation_hours.mark_samples_sql``),
    in a snapshot, whose end rolls the marks back."""
    sql = reconciliation_hours.mark_samples_sql()
    with ledger.snapshot() as cur:
        cur.execute(
            "CREATE OR REPLACE TEMP TABLE fresh AS SELECT * FROM engine_samples QUALIFY row_number() "
            'OVER (PARTITION BY coalesce(instance, replica) ORDER BY "timestamp" DESC) = 1'
        )
        readings = cur.execute("SELECT count(*) FROM fresh").fetchone()
        med, _, _ = timed(lambda: cur.execute(sql), repeat)  # (the snapshot rolls it back)
    print(
        f"marking an engine batch of {readings[0] if readings else 0} readings stale for the "
        f"kept reconciliation: median {med * 1000:.1f} ms"
    )


def ingest_rate(
    path: Path, port: int, batch: int, clients: int, batches: int, fmt: str = "arrow"
) -> dict[str, float]:
    """Records/s through ``infermeter billing`` (its own process) over HTTP, and CPU used."""
    bodies = [_usage_batch(b, batch, ndjson=fmt != "json") for b in range(batches)]
    encode_cpu = time.process_time()
    if fmt == "arrow":
        bodies = [wire.encode_arrow(USAGE, b) or b"" for b in bodies]
    encode_cpu = time.process_time() - encode_cpu
    route = "/v1/ingest" if fmt == "json" else "/v1/ingest/usage"
    ctype = {"arrow": wire.ARROW_STREAM, "ndjson": wire.NDJSON, "json": "application/json"}[fmt]
    # Each batch is one instance's, sent with its credential, as a sidecar's shipper sends it.
    tokens = [_credential(b) for b in range(batches)]
    env = {**os.environ, "INFERMETER_WRITER_SECRET": WRITER_SECRET.decode()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "billing", "--config", str(path)], env=env
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        server_cpu = _cpu_seconds(proc.pid)
        client_cpu = time.process_time()
        accepted, elapsed = asyncio.run(_post_all(url, route, ctype, bodies, clients, tokens))
        client_cpu = time.process_time() - client_cpu
        server_cpu = _cpu_seconds(proc.pid) - server_cpu
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "records_per_s": accepted / elapsed,
        "server_cpu_us": 1e6 * server_cpu / accepted,
        "client_cpu_us": 1e6 * client_cpu / accepted,
        "seconds": elapsed,
        "encode_cpu_us": 1e6 * encode_cpu / (batch * batches),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _credential(b: int) -> str:
    """The writer credential of batch ``b``'s instance (a replica, its own one instance)."""
    replica = REPLICAS[b % len(REPLICAS)]
    return writers.issue(WRITER_SECRET, writers.Writer.for_instance(replica, replica)).token


def _usage_batch(b: int, n: int, bad_record: bool = False, ndjson: bool = False) -> bytes:
    """Batch ``b``: ``n`` records of one replica (as one sidecar ships them), of its model."""
    t0 = START + 40 * 86400 + b * 60.0
    r = b % len(REPLICAS)
    model = ("chat-large", "chat-small")[r % 2]
    # Every field, defaults included, as the sidecar writes a record (``UsageRecord.to_json``):
    # a shipper converts a segment to Arrow only when every record has every field.
    template = UsageRecord(
        request_id="",
        team=TEAMS[0],
        model=model,
        served_version="v1",
        replica=REPLICAS[r],
        received_at=t0,
        first_token_at=t0 + 0.1,
        finished_at=t0 + 4.0,
        prompt_tokens=300,
        cached_prompt_tokens=0,
        completion_tokens=120,
        status="ok",
        http_status=200,
        stream=True,
        endpoint="/v1/chat/completions",
        finish_reason="stop",
        usage_exact=True,
    ).to_json()
    records = [
        {
            **template,
            "request_id": f"live-{b}-{i}",
            "team": TEAMS[i % 20],
            "received_at": t0 + i * 0.001,
            "first_token_at": t0 + i * 0.001 + 0.1,
            "finished_at": t0 + i * 0.001 + 4.0,
        }
        for i in range(n)
    ]
    if bad_record:  # one wrong type sends the whole batch to the per-record checks
        records[0]["prompt_tokens"] = "300"
    if ndjson:  # a spool segment's lines
        return b"".join(orjson.dumps(r) + b"\n" for r in records)
    return orjson.dumps({"usage": records})


def ingest_breakdown(work: Path, batch: int, batches: int, fmt: str) -> dict[str, float]:
    """In-process ingest, split into reading the body (outside the writer lock) and the transaction.

    ``fmt``: ``arrow`` (what shippers send), ``ndjson`` (typed by Arrow's JSON reader), or
    ``per-record`` (NDJSON with one record of the wrong type a batch, so every record is
    checked inside DuckDB instead of taking the typed-columns path).
    """
    ledger = Ledger.open(work / f"breakdown-{fmt}.duckdb", TEAMS, {"chat-small": 0.5})
    parse = total = 0.0
    try:
        for b in range(batches):
            body = _usage_batch(b, batch, fmt == "per-record", ndjson=True)
            if fmt == "arrow":
                body = wire.encode_arrow(USAGE, body) or b""
            keep = ledger.ingest_arrow if fmt == "arrow" else ledger.ingest_lines
            read = arrow_frame if fmt == "arrow" else ndjson_frame
            t0 = time.perf_counter()
            read(USAGE, body)
            t1 = time.perf_counter()
            keep("usage", body, now=START + 50 * 86400)
            t2 = time.perf_counter()
            parse, total = parse + (t1 - t0), total + (t2 - t1)
    finally:
        ledger.close()
    return {
        "records_per_s": batch * batches / total,
        "parse_ms": 1000 * parse / batches,
        "transaction_ms": 1000 * (total - parse) / batches,
    }


async def _post_all(
    url: str, route: str, ctype: str, bodies: list[bytes], clients: int, tokens: list[str]
) -> tuple[int, float]:
    queue: asyncio.Queue[tuple[bytes, str]] = asyncio.Queue()
    for body, token in zip(bodies, tokens, strict=True):
        queue.put_nowait((body, token))
    accepted = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal accepted
        while not queue.empty():
            body, token = queue.get_nowait()
            headers = {"authorization": f"Bearer {token}", "content-type": ctype}
            response = await client.post(route, content=body, headers=headers)
            response.raise_for_status()
            accepted += response.json()["accepted"]

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        t = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        elapsed = time.perf_counter() - t
    return accepted, elapsed


def print_ingest(args: argparse.Namespace, r: dict[str, float]) -> None:
    """One line: the rate and where the CPU went."""
    shippers = (
        f", shippers' Arrow conversion {r['encode_cpu_us']:.2f} us"
        if args.format == "arrow"
        else ""
    )
    print(
        f"ingest     {args.batches} batches x {args.batch:,} records, {args.clients} clients, {args.format}: "
        f"{r['records_per_s']:,.0f} records/s in {r['seconds']:.1f} s; CPU per record: service "
        f"{r['server_cpu_us']:.2f} us, clients {r['client_cpu_us']:.2f} us{shippers}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000_000)
    parser.add_argument("--memory-limit", default="4GB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--skip-ingest", action="store_true")
    parser.add_argument(
        "--format",
        choices=("arrow", "ndjson", "json"),
        default="arrow",
        help="what the clients send (default: Arrow, as shippers do)",
    )
    parser.add_argument("--ingest-only", action="store_true", help="only the ingest measurement")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="only in-process ingest: reading vs transaction, for each path",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="keep the ledger already in --dir (skip generate)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a temp dir)"
    )
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="infermeter-billing-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    port = 39600
    data, config = bench_config(work / "ledger.duckdb", args.memory_limit, port)
    path = work / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        if args.breakdown:
            for fmt in ("arrow", "ndjson", "per-record"):
                r = ingest_breakdown(work, args.batch, args.batches, fmt)
                print(
                    f"ingest in-process, {fmt}: {r['records_per_s']:,.0f} records/s; per "
                    f"{args.batch:,}-record batch: reading {r['parse_ms']:.0f} ms, "
                    f"transaction {r['transaction_ms']:.0f} ms"
                )
            return 0
        if args.ingest_only:
            print_ingest(
                args, ingest_rate(path, port, args.batch, args.clients, args.batches, args.format)
            )
            return 0
        ledger = Ledger.open(
            work / "ledger.duckdb",
            TEAMS,
            {"chat-small": 0.5, "chat-large": 1.5},
            memory_limit=args.memory_limit,
        )
        if not args.reuse:
            t = time.perf_counter()
            generate(ledger, args.records)
            print(f"generate   {args.records:,} records + rollups: {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        rebuilt = allocation_runs.refresh_hours(ledger)
        print(
            f"hourly cost rows: {rebuilt:,} stale hours rebuilt in {time.perf_counter() - t:.1f} s"
        )
        t = time.perf_counter()
        kept = reconciliation_hours.refresh(ledger)
        print(f"kept reconciliation: {kept} month(s) reconciled in {time.perf_counter() - t:.1f} s")
        chargeback = Chargeback(ledger, config)
        cb_med, cb_min, statement = timed(lambda: chargeback.statement(MONTH), args.repeat)

        def group_by() -> Any:
            with ledger.reader() as cur:
                return cur.execute(
                    "SELECT team, model, count(*), sum(prompt_tokens), sum(completion_tokens) FROM usage GROUP BY ALL"
                ).fetchall()

        gb_med, gb_min, _ = timed(group_by, args.repeat)
        with ledger.reader() as cur:
            slots = cur.execute("SELECT count(*) FROM usage_slots").fetchone()
        print(
            f"chargeback {MONTH}: median {cb_med:.2f} s (min {cb_min:.2f}); bare GROUP BY: median {gb_med:.2f} s "
            f"(min {gb_min:.2f}); ratio {cb_med / gb_med:.2f}x; {statement.lines.height} lines, "
            f"reconciles={statement.reconciles}, usage_slots rows={slots[0] if slots else 0:,}"
        )
        print_split(chargeback, statement, args.repeat)
        # Between two upkeeps while batches arrive, the last hours are stale: the statement
        # reconciles them itself (``billing.reconciliation_hours``). With the whole month
        # stale, it reconciles all of it, as before the reconciliation was kept.
        for stale, name in (
            (f"end_hour - {STALE_HOURS}", f"its last {STALE_HOURS} hours'"),
            ("first_hour", "all its"),
        ):
            with ledger.writing() as cur:
                cur.execute(f"UPDATE reconciliation_built SET clean_before = {stale}")
            st_med, st_min, _ = timed(lambda: chargeback.statement(MONTH), args.repeat)
            print(
                f"chargeback {MONTH} with {name} reconciliation stale: median "
                f"{st_med:.2f} s (min {st_min:.2f}); ratio {st_med / gb_med:.2f}x"
            )
        reconciliation_hours.refresh(ledger)
        print_marks(ledger, args.repeat)
        ledger.close()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak RSS of this process: {rss:.0f} MB (DuckDB memory_limit {args.memory_limit})")
        if not args.skip_ingest:
            print_ingest(
                args, ingest_rate(path, port, args.batch, args.clients, args.batches, args.format)
            )
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
