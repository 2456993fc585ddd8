"""The reference model gives the numbers docs/billing.md works out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.truth import Truth
from tests.truth.reference import Book, Group, expected

BOOK = Book(usd_per_gpu_hour={"H100": 6.0}, usd_per_kwh=0.20, pue=1.5)


def board(
    index: int, seconds: range, holder: str | None, replica: str | None, watts: float = 600.0
) -> list[dict[str, Any]]:
    """One board's readings once a second, drawing ``watts``."""
    return [
        {
            "node": "n",
            "index": index,
            "gpu_model": "H100",
            "holder": holder,
            "replica": replica,
            "t": float(t),
            "energy_j": watts * (t - seconds.start),
            "busy_s": 0.0,
        }
        for t in seconds
    ]


def request(
    rid: str,
    instance: str,
    replica: str,
    arrived: float,
    ended: float,
    prompt: int = 10,
    completion: int = 5,
    n: int = 1,
    aborted: bool = False,
) -> dict[str, Any]:
    """An engine's request line."""
    return {
        "request_id": rid,
        "response_id": f"chatcmpl-{rid}",
        "instance": instance,
        "replica": replica,
        "n": n,
        "arrived": arrived,
        "first_token": arrived,
        "ended": ended,
        "prompt_tokens": [prompt] * n,
        "cached_tokens": [0] * n,
        "completion_tokens": [completion] * n,
        "aborted": aborted,
    }


def client(rid: str, team: str, received: int = 5, sent: float = 0.0) -> dict[str, Any]:
    """A client's line (sent at 0 s: before any engine saw it)."""
    return {
        "request_id": rid,
        "team": team,
        "status": 200,
        "received_tokens": received,
        "sent": sent,
    }


def test_worked_example_in_flight_share_with_idle_spread() -> None:
    """One H100 for three minutes: search $0.206, assistant $0.103, fleet $0.309."""
    truth = Truth(
        boards=board(0, range(181), "r1", "r1"),
        requests=[
            request("a", "r1", "r1", 0, 60),
            request("b", "r1", "r1", 0, 60),
            request("c", "r1", "r1", 60, 90),
        ],
        clients=[client("a", "search"), client("b", "assistant"), client("c", "search", sent=60.0)],
    )
    got = expected(truth, {"r1": Group("r1", "m")}, BOOK, 0.0, 180.0)
    assert got.fleet_usd == pytest.approx(0.309)
    assert got.lines[("search", "m")].total_usd == pytest.approx(0.206)
    assert got.lines[("assistant", "m")].total_usd == pytest.approx(0.103)
    assert got.lines[("search", "m")].busy_usd == pytest.approx(0.103)


def test_each_instance_of_a_group_is_split_on_its_own() -> None:
    """Two instances of one group: a team alone on one pays its minute; the other is all idle."""
    truth = Truth(
        boards=board(0, range(61), "g-a", "g") + board(1, range(61), "g-b", "g"),
        requests=[request("a", "g-a", "g", 0, 60)],
        clients=[client("a", "search")],
    )
    groups = {"g": Group("g", "m", "platform")}
    got = expected(truth, groups, BOOK, 0.0, 61.0)
    minute = 0.103
    assert got.lines[("search", "m")].busy_usd == pytest.approx(minute)
    assert got.lines[("platform", "m")].idle_usd == pytest.approx(minute)
    assert got.instances["g-a"].idle_share == pytest.approx(0.0)
    assert got.instances["g-b"].idle_share == pytest.approx(1.0)


def test_spare_boards_are_the_platforms_unallocated_capacity() -> None:
    """A board nobody holds costs the platform, model (unallocated)."""
    truth = Truth(boards=board(0, range(61), None, None))
    got = expected(truth, {}, BOOK, 0.0, 60.0)
    assert got.lines[("platform", "(unallocated)")].idle_usd == pytest.approx(0.103)


def test_n_gt_1_prompts_count_once_on_the_line_and_per_choice_on_the_engine() -> None:
    """An n=2 request bills its prompt once; the engine's counter holds it twice."""
    truth = Truth(
        boards=board(0, range(61), "r1", "r1"),
        requests=[request("a", "r1", "r1", 0, 10, prompt=7, completion=3, n=2)],
        clients=[client("a", "search")],
    )
    got = expected(truth, {"r1": Group("r1", "m")}, BOOK, 0.0, 60.0)
    line = got.lines[("search", "m")]
    assert (line.prompt_tokens, line.completion_tokens) == (7, 6)
    assert got.engine_tokens("m", {"r1": Group("r1", "m")}) == (14, 6)


def test_a_cut_off_request_is_bounded_by_what_the_client_got_and_the_engine_made() -> None:
    """An aborted request's tokens lie between the client's and the engine's."""
    truth = Truth(
        boards=board(0, range(61), "r1", "r1"),
        requests=[request("a", "r1", "r1", 0, 10, prompt=7, completion=9, aborted=True)],
        clients=[client("a", "search", received=4)],
    )
    line = expected(truth, {"r1": Group("r1", "m")}, BOOK, 0.0, 60.0).lines[("search", "m")]
    assert (line.prompt_tokens, line.completion_tokens) == (0, 0)
    assert (line.cut_prompt_min, line.cut_prompt_max) == (7, 7)
    assert (line.cut_completion_min, line.cut_completion_max) == (4, 9)


def test_time_waiting_before_the_engine_counts_as_in_flight() -> None:
    """Sent at 0, queued in the sidecar, on the engine from 30 to 60: in flight all minute."""
    truth = Truth(
        boards=board(0, range(61), "r1", "r1"),
        requests=[request("a", "r1", "r1", 30, 60)],
        clients=[client("a", "search", sent=0.0)],
    )
    got = expected(truth, {"r1": Group("r1", "m", "platform")}, BOOK, 0.0, 61.0)
    assert got.lines[("search", "m")].busy_usd == pytest.approx(0.103)
    assert got.instances["r1"].idle_share == pytest.approx(0.0)
