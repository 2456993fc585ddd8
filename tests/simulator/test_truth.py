"""The ground-truth log: each engine request, its tokens as computed, and the boards' holders."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from infermeter.config import Config, load_config
from simulator.dcgm import node_exporters
from simulator.replica import ReplicaSim
from simulator.serve import record_boards
from simulator.truth import TruthWriter, open_truth, read_truth
from tests.ports import off_demo_ports
from tests.servers import serving
from tests.simulator.conftest import tiny_spec


def test_the_log_is_off_unless_a_directory_is_set(tmp_path: Path) -> None:
    """No directory, no writer: nothing is opened."""
    assert open_truth("", "replica-x") is None
    writer = open_truth(str(tmp_path / "truth"), "replica-x")
    assert writer is not None
    writer.write("instance", {"event": "start"})
    assert read_truth(tmp_path / "truth").instances == [{"k": "instance", "event": "start"}]


def test_a_line_cut_by_a_kill_is_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    """A half-written last line holds no fact; the whole lines before it are read."""
    writer = TruthWriter(tmp_path, "replica-x")
    writer.write("request", {"request_id": "a"})
    with writer.path.open("ab") as f:
        f.write(b'{"k":"request","request_id":"b"')
    assert [r["request_id"] for r in read_truth(tmp_path).requests] == ["a"]


async def test_each_request_is_logged_with_the_tokens_the_engine_computed(tmp_path: Path) -> None:
    """An n=2 request: one line, each choice's prompt and completion as the engine counted them."""
    sim = ReplicaSim(tiny_spec(), truth=TruthWriter(tmp_path, "replica-tiny"))
    body = {
        "model": "tiny",
        "prompt": "count the boards",
        "max_tokens": 6,
        "n": 2,
        "ignore_eos": True,
    }
    async with serving(sim) as url, httpx.AsyncClient() as client:
        reply = await client.post(
            f"{url}/v1/completions", json=body, headers={"x-request-id": "req-1"}
        )
    usage = reply.json()["usage"]
    truth = read_truth(tmp_path)
    assert [i["event"] for i in truth.instances] == ["start", "stop"]
    (line,) = truth.requests
    assert line["request_id"] == "req-1"
    assert line["response_id"] == reply.json()["id"]
    assert line["completion_tokens"] == [6, 6]
    assert line["prompt_tokens"] == [usage["prompt_tokens"]] * 2
    assert sim.scheduler.counters.prompt_tokens == 2 * usage["prompt_tokens"]
    assert not line["aborted"]
    assert line["arrived"] <= line["first_token"] <= line["ended"]


async def test_a_hang_up_logs_the_tokens_generated_until_the_abort(tmp_path: Path) -> None:
    """A client that leaves mid-stream: the line says aborted, with every token the engine made."""
    sim = ReplicaSim(tiny_spec(), truth=TruthWriter(tmp_path, "replica-tiny"))
    body = {
        "model": "tiny",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "go on"}],
    }
    async with serving(sim) as url, httpx.AsyncClient() as client:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                break
        for _ in range(100):
            if read_truth(tmp_path).requests:
                break
            await asyncio.sleep(0.02)
    (line,) = read_truth(tmp_path).requests
    assert line["aborted"]
    assert 0 < line["completion_tokens"][0] < 400
    assert line["completion_tokens"][0] == sim.scheduler.counters.generation_tokens


async def test_boards_are_logged_with_their_holder_and_counters(tmp_path: Path) -> None:
    """The dcgm stand-in's log: every board once per tick, owned boards with their replica."""
    # The replicas moved off the demo's ports: nothing answers there, as when none runs.
    config = Config.model_validate(off_demo_ports(load_config(None, environ={}).model_dump()))
    async with httpx.AsyncClient() as client:
        exporter = next(iter(node_exporters(config, client).values()))
        writer = TruthWriter(tmp_path, "dcgm")
        task = asyncio.create_task(record_boards(exporter, writer, 0.05))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    boards = read_truth(tmp_path).boards
    indices = {b["index"] for b in boards}
    assert indices == set(range(len(exporter.slots)))
    owned = {b["index"]: b["holder"] for b in boards}
    expected = {s.index: s.owner for s in exporter.slots}
    assert owned == expected
    per_board = [b["energy_j"] for b in boards if b["index"] == 0]
    assert per_board == sorted(per_board)
    assert per_board[-1] > per_board[0]
