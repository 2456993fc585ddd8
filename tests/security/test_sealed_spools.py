"""A spool line changed or written on disk is quarantined at ingest, counted, and billed to no one.

Real spool files written through ``Spool`` with the instance's seal, the real shipper, real
billing on loopback holding the writer secret. The files are changed between two runs of the
"sidecar" (closed, edited, opened again), as a pod sharing the node's spool root could do.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry

from billing.ledger import Ledger
from collectors.adopt import Adopter, AdoptionMetrics
from infermeter.months import month_of
from infermeter.shipper import Shipper, ShipperMetrics
from infermeter.spool import Spool
from infermeter.writers import Sealer, Writer, issue, open_line
from sidecar.journal import AdmissionJournal
from sidecar.stream import UsageCounts
from tests.security import writers as writer_fixtures
from tests.security.writers import (
    ADMIN,
    COLLECTOR_B,
    SECRET,
    SMALL_0,
    quarantined_total,
    usage,
)
from tests.sidecar.test_journal import die

POD = issue(SECRET, Writer.for_instance("small-0", "vllm-small-0-1", "127.0.0.1:40124"))

# The demo configuration as it ships, a ledger of its fleet and billing over it (writer secret on).
strict, ledger, url = writer_fixtures.strict, writer_fixtures.ledger, writer_fixtures.url


async def _written(directory: Path, records: list[dict[str, Any]], sealer: Sealer) -> Path:
    """Append ``records`` through a sealing spool and close it; the segment's path."""
    spool = Spool(directory, sealer=sealer)
    spool.open()
    for record in records:
        await spool.append(record)
    await spool.close()
    (segment,) = sorted(directory.glob("seg-*.jsonl"))
    return segment


async def _ship(directory: Path, url: str, registry: CollectorRegistry) -> Spool:
    """Open the spool again (as a restarted sidecar does) and ship it with small-0's credential."""
    spool = Spool(directory, roll_seconds=0.0, sealer=Sealer(SMALL_0))
    spool.open()
    async with httpx.AsyncClient() as client:
        shipper = Shipper(
            spool,
            f"{url}/v1/ingest",
            None,
            "usage",
            client,
            metrics=ShipperMetrics(registry),
            credential=SMALL_0,
        )
        await shipper.ship_once(max_wait_seconds=10)
    await spool.close()
    return spool


async def _adopt(root: Path, url: str) -> int:
    """One round of node-b's collector adopting the gone pods' spools under ``root``; how many
    records billing acknowledged."""
    async with httpx.AsyncClient() as client:
        adopter = Adopter(
            root,
            f"{url}/v1/ingest",
            None,
            client,
            AdoptionMetrics(CollectorRegistry()),
            credential=COLLECTOR_B,
        )
        return await adopter.adopt_once()


def _ids(ledger: Ledger, sql: str) -> list[str]:
    with ledger.reader() as cur:
        return sorted(str(r[0]) for r in cur.execute(sql).fetchall())


def _shipped(registry: CollectorRegistry, outcome: str) -> float:
    found = registry.get_sample_value(
        "infermeter_shipper_records_total", {"kind": "usage", "outcome": outcome}
    )
    return found or 0.0


async def test_a_line_changed_on_disk_is_quarantined_and_the_rest_billed(ledger, url, tmp_path):
    """One record's tokens raised in the file: its seal no longer verifies; the others are kept."""
    records = [usage(), usage(), usage()]
    segment = await _written(tmp_path / "spool", records, Sealer(SMALL_0))
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"completion_tokens":50', b'"completion_tokens":99000000')
    segment.write_bytes(b"".join(lines))
    registry = CollectorRegistry()
    spool = await _ship(tmp_path / "spool", url, registry)
    async with httpx.AsyncClient() as client:
        counted = await quarantined_total(client, url)
    assert _ids(ledger, "SELECT request_id FROM usage") == sorted(
        [records[0]["request_id"], records[2]["request_id"]]
    )
    assert _ids(ledger, "SELECT record_id FROM quarantine WHERE label = 'bad_seal'") == [
        records[1]["request_id"]
    ]
    assert counted == {("usage", "bad_seal"): 1.0}
    assert (_shipped(registry, "kept"), _shipped(registry, "quarantined")) == (2.0, 1.0)
    assert not (tmp_path / "spool" / "rejected.jsonl").exists()
    assert spool.backlog == 0


async def test_a_hand_written_segment_is_quarantined_and_billed_to_no_one(ledger, url, tmp_path):
    """A segment written by hand (analytics, 99M tokens each way), without a seal or with a
    made-up one, ships with the sidecar's spool and is quarantined whole, on the statement."""
    directory = tmp_path / "spool"
    genuine = await _written(directory, [usage()], Sealer(SMALL_0))
    forged = usage(team="analytics", prompt_tokens=99_000_000, completion_tokens=99_000_000)
    made_up = orjson.dumps(usage(team="analytics", completion_tokens=99_000_000))
    sealed_by_guess = made_up[:-1] + (
        f',"seal":"{SMALL_0.writer.principal}:{secrets.token_hex(16)}"}}'.encode()
    )
    (directory / "seg-00000000000000000001.jsonl").write_bytes(
        orjson.dumps(forged) + b"\n" + sealed_by_guess + b"\n"
    )
    registry = CollectorRegistry()
    await _ship(directory, url, registry)
    async with httpx.AsyncClient() as client:
        counted = await quarantined_total(client, url)
        month = month_of(time.time())
        statement = (await client.get(f"{url}/v1/chargeback/{month}", headers=ADMIN)).json()
    assert _ids(ledger, "SELECT team FROM usage") == ["search"]
    assert counted == {("usage", "unsealed"): 1.0, ("usage", "bad_seal"): 1.0}
    assert {"kind": "usage", "reason": "unsealed", "records": 1} in statement["quarantined"]
    assert all(line["team"] != "analytics" for line in statement["lines"])
    assert not genuine.exists()  # shipped and acknowledged with the rest
    with ledger.reader() as cur:
        kept = cur.execute("SELECT record FROM quarantine ORDER BY label").fetchall()
    assert [orjson.loads(r)["completion_tokens"] for (r,) in kept] == [99_000_000, 99_000_000]


async def test_a_gone_instances_spool_is_billed_under_its_seals_when_the_collector_adopts_it(
    ledger, url, tmp_path
):
    """The collector forwards a gone pod's lines: the pod's seals make them its records; a line
    changed meanwhile is quarantined; the requests the collector recovers are sealed as its own."""
    root = tmp_path / "spool-root"
    kept, changed = usage(instance="vllm-small-0-1"), usage(instance="vllm-small-0-1")
    segment = await _written(root / "pod-uid-1", [kept, changed], Sealer(POD))
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"team":"search"', b'"team":"research"')
    segment.write_bytes(b"".join(lines))
    shipped = await _adopt(root, url)
    assert shipped == 2
    assert _ids(ledger, "SELECT request_id FROM usage") == [kept["request_id"]]
    assert _ids(ledger, "SELECT record_id FROM quarantine") == [changed["request_id"]]
    assert not (root / "pod-uid-1").exists()


async def test_a_gone_sidecars_ended_request_is_billed_as_it_ended_when_the_collector_adopts_it(
    ledger, url, tmp_path
):
    """A sidecar killed after a request ended and before its record was written: the collector of
    its node recovers the ending its journal slot kept, seals it as its own, and billing bills
    the request as it ended, neither quarantined nor interrupted."""
    directory = tmp_path / "spool-root" / "pod-uid-2"
    dead = AdmissionJournal(directory / "journal", 60)
    dead.open()
    admission = usage(
        status="interrupted",
        http_status=502,
        prompt_tokens=0,
        completion_tokens=0,
        first_token_at=None,
        usage_exact=False,
    )
    dead.admit(admission, 100.0)
    slot = dead.end(admission["request_id"])
    assert slot is not None
    slot.end("ok", 200, UsageCounts(100, 50, 0), True, 100.1, 101.9, "stop", "chatcmpl-x")
    die(dead)
    shipped = await _adopt(directory.parent, url)
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT status, prompt_tokens, completion_tokens, response_id FROM usage "
            "WHERE request_id = ?",
            [admission["request_id"]],
        ).fetchall()
    assert shipped == 1
    assert rows == [("ok", 100, 50, "chatcmpl-x")]
    assert _ids(ledger, "SELECT record_id FROM quarantine") == []


def test_a_seal_covers_every_byte_of_its_record():
    """Any byte of a sealed line changed, the seal no longer verifies; the line opens unchanged."""
    sealer = Sealer(SMALL_0)
    record = orjson.dumps(usage())
    line = sealer(record)
    opened = open_line(line + b"\n")
    assert opened is not None
    assert (opened.record, opened.principal) == (record, SMALL_0.writer.principal)
    assert sealer.vouches(line) == record
    for at in range(0, len(record) - 1, 7):
        flipped = line[:at] + bytes([line[at] ^ 1]) + line[at + 1 :]
        assert sealer.vouches(flipped) is None, at
    assert Sealer(POD).vouches(line) is None  # another writer's key does not vouch for it
