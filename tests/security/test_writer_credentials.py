"""Every writer proves which instance it is, and billing takes its records only as that writer's.

Real billing on loopback, holding the writer secret, over a ledger that knows the demo fleet; the
credentials are issued as a cluster would hand them out. What a credential may not write, and
what names a team, model, group or node the configuration does not know, is quarantined: kept,
counted on /metrics, shown on the statement, billed to no one.
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from billing.ledger import Ledger
from billing.serve import serve_billing
from infermeter.config import load_config
from infermeter.ids import sample_id
from infermeter.months import month_of
from infermeter.serving import free_port
from infermeter.writers import DEMO_SECRET, Credential, Writer, WriterError, issue
from tests.security import writers as writer_fixtures
from tests.security.writers import (
    ADMIN,
    COLLECTOR_A,
    COLLECTOR_B,
    METRICS,
    SECRET,
    SMALL_0,
    billing,
    engine,
    event,
    gpu,
    lines,
    post,
    quarantined_total,
    usage,
)

# The demo configuration as it ships, a ledger of its fleet and billing over it (writer secret on).
strict, ledger, url = writer_fixtures.strict, writer_fixtures.ledger, writer_fixtures.url


def _count(ledger: Ledger, table: str) -> int:
    with ledger.reader() as cur:
        row = cur.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def test_the_demo_configuration_takes_no_shared_ingest_token(strict):
    """A new installation (the embedded configuration is one) leaves the shared token off."""
    assert strict.billing.shared_ingest_token is False


async def test_the_shared_ingest_token_is_refused_unless_the_configuration_allows_it(
    strict, ledger, url
):
    """403 naming the setting, nothing kept; with the setting on, the same batch is kept."""
    async with httpx.AsyncClient() as client:
        refused = await post(client, url, "usage", [usage()], "im-demo-ingest")
        assert refused.status_code == 403
        assert "billing.shared_ingest_token" in refused.json()["error"]["message"]
        assert _count(ledger, "usage") == 0
        allowed = load_config(None, environ={"INFERMETER__BILLING__SHARED_INGEST_TOKEN": "true"})
        async with billing(allowed, ledger) as legacy:
            taken = await post(client, legacy, "usage", [usage()], "im-demo-ingest")
    assert taken.status_code == 200, taken.text
    assert taken.json()["accepted"] == 1


@pytest.mark.parametrize(
    "token",
    [
        issue(b"another secret", Writer.for_instance("small-0", "small-0")).token,
        SMALL_0.token[:-1] + ("0" if SMALL_0.token[-1] != "0" else "1"),
        "imw1:instance:small-0/small-0:not-a-key",
        "im-demo-search",
    ],
    ids=["other secret", "one digit changed", "malformed", "a team key"],
)
async def test_a_credential_billing_did_not_issue_writes_nothing(ledger, url, token):
    """401 for a key not derived from billing's secret (403 for a team's key); nothing kept."""
    async with httpx.AsyncClient() as client:
        answer = await post(client, url, "usage", [usage()], token)
    assert answer.status_code in (401, 403)
    assert _count(ledger, "usage") == 0


async def test_without_a_writer_secret_billing_takes_no_writer_credential(strict, ledger):
    """A billing service with no secret cannot check a credential, so it takes none."""
    async with billing(strict, ledger, secret=None) as base, httpx.AsyncClient() as client:
        answer = await post(client, base, "usage", [usage()], SMALL_0)
    assert answer.status_code == 401
    assert "billing.writer_secret_env" in answer.json()["error"]["message"]


async def test_an_instance_writes_usage_only_as_itself(strict, ledger, url):
    """Its own record is kept; one for a ghost instance or another group is quarantined, counted,
    on the statement, and billed to no one."""
    own, ghost, other_group = (
        usage(),
        usage(instance="ghost-9", team="analytics", completion_tokens=99_000_000),
        usage(replica="large-0", model="chat-large", team="analytics"),
    )
    async with httpx.AsyncClient() as client:
        answer = await post(client, url, "usage", [own, ghost, other_group], SMALL_0)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        counted = await quarantined_total(client, url)
        month = month_of(time.time())
        statement = (await client.get(f"{url}/v1/chargeback/{month}", headers=ADMIN)).json()
    assert (body["accepted"], body["rejected"]) == (1, [])
    assert [q["id"] for q in body["quarantined"]] == [
        ghost["request_id"],
        other_group["request_id"],
    ]
    assert all("is not the credential's" in q["reason"] for q in body["quarantined"])
    assert counted == {("usage", "foreign_writer"): 2.0}
    assert {"kind": "usage", "reason": "foreign_writer", "records": 2} in statement["quarantined"]
    assert all(line["team"] != "analytics" for line in statement["lines"])
    with ledger.reader() as cur:
        assert cur.execute("SELECT request_id FROM usage").fetchall() == [(own["request_id"],)]
        kept = cur.execute("SELECT writer, record FROM quarantine ORDER BY record_id").fetchall()
    assert {w for w, _ in kept} == {SMALL_0.writer.principal}
    assert sorted(orjson.loads(r)["request_id"] for _, r in kept) == sorted(
        [ghost["request_id"], other_group["request_id"]]
    )


async def test_records_for_what_the_configuration_does_not_know_are_quarantined(ledger, url):
    """A forged team, an unknown model, an unknown node: each kept in quarantine with its reason."""
    nobody = usage(team="nobody")
    huge = usage(model="chat-huge")
    unknown_node = issue(SECRET, Writer.for_collector(["node-z"]))
    async with httpx.AsyncClient() as client:
        people = (await post(client, url, "usage", [usage(), nobody, huge], SMALL_0)).json()
        boards = (await post(client, url, "gpu_samples", [gpu("node-z")], unknown_node)).json()
        counted = await quarantined_total(client, url)
    assert [(q["id"], q["reason"]) for q in people["quarantined"]] == [
        (nobody["request_id"], 'unknown team "nobody"'),
        (huge["request_id"], 'unknown model "chat-huge"'),
    ]
    assert [q["reason"] for q in boards["quarantined"]] == ['unknown node "node-z"']
    assert counted == {
        ("usage", "unknown_team"): 1.0,
        ("usage", "unknown_model"): 1.0,
        ("gpu_samples", "unknown_node"): 1.0,
    }
    assert (_count(ledger, "usage"), _count(ledger, "gpu_samples")) == (1, 0)


async def test_fifty_fake_instances_are_quarantined_and_none_is_live(ledger, url):
    """One instance's credential announcing 50 others: all quarantined, the registry lists none,
    so no collector scrapes them and no limit is split by them."""
    fakes = [event(instance=f"fake-{n}") for n in range(50)]
    async with httpx.AsyncClient() as client:
        answer = (await post(client, url, "instances", fakes, SMALL_0)).json()
        live = (await client.get(f"{url}/v1/instances?state=live", headers=METRICS)).json()
        counted = await quarantined_total(client, url)
    assert (answer["accepted"], len(answer["quarantined"])) == (0, 50)
    assert [i["instance"] for i in live["instances"]] == []
    assert counted == {("instances", "foreign_writer"): 50.0}


async def test_an_instance_announces_no_engine_address_but_its_own(ledger, url):
    """The address in its credential is kept; any other one is quarantined (foreign_address)."""
    own = event(engine_metrics_url="http://127.0.0.1:18102/engine/metrics")
    elsewhere = event(engine_metrics_url="http://127.0.0.1:9/engine/metrics")
    bare = issue(SECRET, Writer.for_instance("small-0", "small-0"))
    async with httpx.AsyncClient() as client:
        steered = (await post(client, url, "instances", [elsewhere], SMALL_0)).json()
        unaddressed = (await post(client, url, "instances", [own], bare)).json()
        kept = (await post(client, url, "instances", [own], SMALL_0)).json()
        live = (await client.get(f"{url}/v1/instances?state=live", headers=METRICS)).json()
    assert (
        "is not the instance's own address (127.0.0.1:18102)" in steered["quarantined"][0]["reason"]
    )
    assert "none in its credential" in unaddressed["quarantined"][0]["reason"]
    assert kept["accepted"] == 1
    assert [i["engine_metrics_url"] for i in live["instances"]] == [own["engine_metrics_url"]]


async def test_a_collector_writes_only_for_its_nodes(ledger, url):
    """GPU and engine samples of node-b are node-b's collector's, not node-a's."""
    async with httpx.AsyncClient() as client:
        ours = (await post(client, url, "gpu_samples", [gpu("node-b")], COLLECTOR_B)).json()
        theirs = (await post(client, url, "gpu_samples", [gpu("node-b")], COLLECTOR_A)).json()
        engines = (
            await post(client, url, "engine_samples", [engine("node-b"), engine(None)], COLLECTOR_A)
        ).json()
        own_engine = (
            await post(client, url, "engine_samples", [engine("node-b")], COLLECTOR_B)
        ).json()
    assert (ours["accepted"], theirs["accepted"], len(theirs["quarantined"])) == (1, 0, 1)
    assert "is not the collector's" in theirs["quarantined"][0]["reason"]
    assert (engines["accepted"], len(engines["quarantined"])) == (0, 2)
    assert own_engine["accepted"] == 1


async def test_a_collector_does_not_write_an_engine_on_another_node_than_its_lifetime(ledger, url):
    """An engine whose lifetime says node-b cannot be written as node-a's by node-a's collector."""
    async with httpx.AsyncClient() as client:
        await post(
            client,
            url,
            "instances",
            [event(instance="vllm-small-0-1")],
            issue(SECRET, Writer.for_instance("small-0", "vllm-small-0-1")),
        )
        moved = (
            await post(
                client,
                url,
                "engine_samples",
                [engine("node-a", instance="vllm-small-0-1")],
                COLLECTOR_A,
            )
        ).json()
    assert moved["accepted"] == 0
    assert "does not run on node" in moved["quarantined"][0]["reason"]


@pytest.mark.parametrize(
    ("credential", "kind", "record"),
    [
        (issue(SECRET, Writer.for_autoscaler()), "usage", usage()),
        (SMALL_0, "gpu_samples", gpu()),
    ],
    ids=["autoscaler usage", "instance gpu samples"],
)
async def test_a_writer_writes_only_its_own_kinds(ledger, url, credential, kind, record):
    """Each role has its kinds: anything else it sends is quarantined as a foreign writer's."""
    async with httpx.AsyncClient() as client:
        answer = (await post(client, url, kind, [record], credential)).json()
    assert answer["accepted"] == 0
    assert len(answer["quarantined"]) == 1


@pytest.mark.parametrize("status", ["ok", "client_aborted", "upstream_error", "interrupted"])
async def test_a_collector_writes_the_ending_a_gone_sidecars_journal_kept(ledger, url, status):
    """A sidecar killed after a request ended and before its record was written leaves the
    ending in its journal; the collector of its node that adopts the spool writes that record as
    it is, and billing takes it. The collector of another node may not."""
    async with httpx.AsyncClient() as client:
        own = (await post(client, url, "usage", [usage(status=status)], COLLECTOR_B)).json()
        other = (await post(client, url, "usage", [usage(status=status)], COLLECTOR_A)).json()
    assert (own["accepted"], own["quarantined"]) == (1, [])
    assert (other["accepted"], len(other["quarantined"])) == (0, 1)
    assert "is not on the collector's nodes" in other["quarantined"][0]["reason"]


async def test_a_quarantined_batch_sent_again_is_kept_and_counted_once(ledger, url):
    """The shipper resends what it has no answer for: the quarantine does not grow with it."""
    forged = [usage(instance="ghost-9") for _ in range(3)]
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            answer = await post(client, url, "usage", forged, SMALL_0)
            assert len(answer.json()["quarantined"]) == 3
        counted = await quarantined_total(client, url)
    assert counted == {("usage", "foreign_writer"): 3.0}
    assert _count(ledger, "quarantine") == 3


async def test_a_collector_cannot_take_the_sample_ids_of_another_node(ledger, url):
    """node-a's collector sends free samples of its own node under node-b's coming ids: they are
    quarantined, and node-b's real samples under those ids are kept and billed."""
    t = round(time.time() - 60, 3)
    theirs = [sample_id(t + 10 * k, "node-b", "GPU-node-b-0", "-") for k in range(3)]
    squat = [
        gpu("node-a", sample_id=i, uuid="GPU-node-a-0", timestamp=t + 10 * k, interval_seconds=0.0)
        for k, i in enumerate(theirs)
    ]
    real = [gpu("node-b", sample_id=i, timestamp=t + 10 * k) for k, i in enumerate(theirs)]
    async with httpx.AsyncClient() as client:
        forged = (await post(client, url, "gpu_samples", squat, COLLECTOR_A)).json()
        kept = (await post(client, url, "gpu_samples", real, COLLECTOR_B)).json()
    assert (forged["accepted"], len(forged["quarantined"])) == (0, 3)
    assert "sample_id: not the id its own fields give" in forged["quarantined"][0]["reason"]
    assert (kept["accepted"], kept["duplicates"]) == (3, 0)
    assert _count(ledger, "gpu_samples") == 3


@pytest.mark.parametrize(
    ("credential", "kind", "record"),
    [
        (COLLECTOR_B, "engine_samples", engine(sample_id="0000000000001/small-0")),
        (SMALL_0, "instances", event(event_id=sample_id(time.time() - 5, "small-1", "start"))),
        (COLLECTOR_B, "gpu_samples", gpu(sample_id="gpu-1")),
    ],
    ids=["engine at another time", "instance event of another instance", "gpu made-up"],
)
async def test_a_record_whose_id_is_not_its_own_is_quarantined(
    ledger, url, credential, kind, record
):
    """Each kind's id is its time and what was read; any other id is quarantined, not kept."""
    async with httpx.AsyncClient() as client:
        answer = (await post(client, url, kind, [record], credential)).json()
    assert answer["accepted"] == 0
    assert "not the id its own fields give" in answer["quarantined"][0]["reason"]


async def test_an_id_minted_at_half_a_millisecond_is_the_records_own(ledger, url):
    """Python rounds a half millisecond to even where SQL rounds it up: either is the record's."""
    base = int((time.time() - 10) * 1000)
    t = next(
        t
        for t in ((base - k + 0.5) / 1000 for k in range(1000))
        if (t * 1000) % 1 == 0.5 and round(t * 1000) % 2 == 0
    )
    record = gpu("node-b", timestamp=t) | {"sample_id": sample_id(t, "node-b", "GPU-node-b-0", "-")}
    async with httpx.AsyncClient() as client:
        answer = (await post(client, url, "gpu_samples", [record], COLLECTOR_B)).json()
    assert (answer["accepted"], answer["quarantined"]) == (1, [])


async def test_a_refused_or_quarantined_first_copy_does_not_shadow_a_good_one(ledger, url):
    """In one batch, a bad copy of an id and then a good one: the good one is kept, not taken
    for a repeat of a record that was never kept."""
    good, trusted = usage(), usage()
    bad = good | {"prompt_tokens": -1}
    forged = trusted | {"instance": "ghost-9"}
    async with httpx.AsyncClient() as client:
        refused = (await post(client, url, "usage", [bad, good], SMALL_0)).json()
        shadowed = (await post(client, url, "usage", [forged, trusted], SMALL_0)).json()
    assert (refused["accepted"], refused["duplicates"], len(refused["rejected"])) == (1, 0, 1)
    assert (shadowed["accepted"], shadowed["duplicates"], len(shadowed["quarantined"])) == (1, 0, 1)
    assert _count(ledger, "usage") == 2


def test_another_writers_quarantined_copy_in_the_same_transaction_does_not_shadow_a_good_one(
    ledger,
):
    """node-a's collector forges node-b's sample, and both batches commit in one transaction
    (group commit): node-b's real sample is kept, the forgery quarantined."""
    real = gpu("node-b")
    forged = real | {"power_watts": 201.0}
    answers = {}

    def send(name: str, credential: Credential, record: dict[str, object]) -> None:
        answers[name] = ledger.ingest_lines(
            "gpu_samples", lines([record]), writer=credential.writer
        )

    senders = [
        threading.Thread(target=send, args=("forged", COLLECTOR_A, forged)),
        threading.Thread(target=send, args=("real", COLLECTOR_B, real)),
    ]
    with ledger.writing():  # both batches queue behind the lock, then commit as one group
        for thread in senders:
            thread.start()
            deadline = time.monotonic() + 30
            while ledger.waiting_batches < senders.index(thread) + 1:
                assert time.monotonic() < deadline, "the batch never queued"
                time.sleep(0.01)
    for thread in senders:
        thread.join(30)
    assert ledger.ingest_transactions == 1
    assert (answers["forged"].accepted, len(answers["forged"].quarantined)) == (0, 1)
    assert (answers["real"].accepted, answers["real"].duplicates) == (1, 0)
    assert _count(ledger, "gpu_samples") == 1


def test_a_credential_names_its_writer_and_nothing_else():
    """Parsing takes exactly what issuing wrote, and refuses what is not a credential."""
    writer = Writer.for_instance("large-0", "vllm-large-0-7", "[fd00::1]:9000")
    credential = issue(SECRET, writer)
    assert Credential.parse(credential.token) == credential
    assert writer.engine_metrics_url == "http://[fd00::1]:9000/engine/metrics"
    assert Writer.for_collector(["node-b", "node-a"]).principal == "collector:node-a,node-b"
    for bad in ("instance:g/", "instance:g/i@host", "collector:", "root:x", "instance:g/i j"):
        with pytest.raises(WriterError):
            Writer.parse(bad)
    assert "key" not in repr(credential).replace("writer", "")


async def test_billing_refuses_the_public_demo_secret_beyond_loopback(
    strict, monkeypatch, tmp_path
):
    """Anyone could issue credentials from the demo's secret: billing will not serve the network
    with it, and says what to do instead."""
    monkeypatch.setenv(strict.billing.writer_secret_env, DEMO_SECRET.decode())
    with pytest.raises(WriterError, match="public demo writer secret"):
        await serve_billing(strict, f"0.0.0.0:{free_port()}", str(tmp_path / "ledger.duckdb"))
    assert not (tmp_path / "ledger.duckdb").exists()
