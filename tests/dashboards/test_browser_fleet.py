"""The Fleet page in real headless Chromium: instances, the autoscaler's decisions, the first minute.

Each test feeds its own ledger file the records the fleet would ship (instance events, scaling
decisions, usage), serves it with billing and the dashboard on loopback, and reads the page as a
user would, in one browser shared by the module.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.records import UsageRecord
from tests.billing.conftest import instance_event, scaling_decision
from tests.conftest import config_ledger
from tests.dashboards.records import ADMIN_KEY, TEAM_KEYS
from tests.dashboards.stack import billing_thread, chromium, dashboard_config, dashboard_thread

_ids = itertools.count()
# The charts of requests by model: each must agree with the range's totals.
REQUEST_CHARTS = ("fleet-ttft", "fleet-tokens", "fleet-requests", "fleet-errors")


@dataclass
class Page:
    """A dashboard over its own ledger, and the module's browser."""

    ledger: Ledger
    url: str
    driver: webdriver.Chrome
    artifacts: Path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    tmp = tmp_path_factory.mktemp("fleet-browser")
    with chromium(tmp / "downloads") as driver:
        yield driver


@pytest.fixture
def config() -> Config:
    """The demo configuration; the dashboard refreshes only when asked, and scrapes no gauge."""
    return dashboard_config()


@contextlib.contextmanager
def page(config: Config, browser: webdriver.Chrome, tmp: Path) -> Iterator[Page]:
    """A fresh ledger file, billing over it and the dashboard over billing."""
    ledger = config_ledger(config, tmp / "ledger.duckdb")
    try:
        with billing_thread(config, ledger) as billing, dashboard_thread(config, billing) as url:
            yield Page(ledger, url, browser, tmp)
    finally:
        ledger.close()


def keep(ledger: Ledger, kind: str, records: list[dict[str, Any]]) -> None:
    """Ingest ``records`` as billing's ingest route would; every one must be kept."""
    result = ledger.ingest(orjson.dumps({kind: records}))
    assert (result.accepted, result.rejected) == (len(records), [])


def instances(ledger: Ledger, group: str, model: str, count: int) -> list[str]:
    """``count`` instances of ``group``, started minutes apart, each heartbeating now."""
    now = time.time()
    names, events = [], []
    for n in range(1, count + 1):
        name, started = f"vllm-{group}-{n}", now - 300 * (count + 1 - n)
        names.append(name)
        for kind, at in (("start", started), ("heartbeat", now - 1)):
            events.append(
                instance_event(name, kind, at, started, replica=group, model=model, gpus=str(n + 1))
            )
    keep(ledger, "instances", events)
    return names


def decision(model: str, ago: float, previous: int, desired: int, reasons: str) -> dict[str, Any]:
    """A change the autoscaler made ``ago`` seconds before now, as it spools it."""
    return scaling_decision(time.time() - ago, previous, desired, reasons, model)


def requests(ledger: Ledger, count: int, at: float) -> None:
    """``count`` finished requests of team search on small-0, all received at ``at``."""
    keep(
        ledger,
        "usage",
        [
            UsageRecord(
                request_id=f"req-{next(_ids)}",
                team="search",
                model="chat-small",
                served_version="llama-3.1-8b-instruct",
                replica="small-0",
                received_at=at,
                first_token_at=at + 0.05,
                finished_at=at + 0.2,
                prompt_tokens=100,
                cached_prompt_tokens=0,
                completion_tokens=20,
                status="ok",
                http_status=200,
                stream=True,
            ).to_json()
            for _ in range(count)
        ],
    )


def wait(p: Page, css: str, text: str | None = None, timeout: float = 30) -> str:
    """The text of the first element matching ``css`` once it shows (containing ``text``)."""

    def ready(driver: webdriver.Chrome) -> str | bool:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        if not found or (text is not None and text not in found[0].text):
            return False
        return found[0].text or True

    try:
        result = WebDriverWait(p.driver, timeout, poll_frequency=0.1).until(ready)
    except TimeoutException:
        found = p.driver.find_elements(By.CSS_SELECTOR, css)
        shown = repr(found[0].text) if found else "no such element"
        page_text = p.driver.find_element(By.TAG_NAME, "body").text[:2000]
        raise AssertionError(
            f"{css} never showed {text!r} in {timeout:g} s: it shows {shown}; the page:\n{page_text}"
        ) from None
    return result if isinstance(result, str) else ""


def sign_in(p: Page, key: str, path: str = "/") -> None:
    """Open ``path`` signed in with ``key`` through the sign-in form."""
    p.driver.get(p.url + "/")
    p.driver.execute_script("window.sessionStorage.clear();")
    p.driver.get(p.url + path)
    wait(p, "#login-key")
    box = p.driver.find_element(By.ID, "login-key")
    box.clear()
    box.send_keys(key)
    p.driver.find_element(By.ID, "login-button").click()
    wait(p, "#who", "admin" if key == ADMIN_KEY else "team")


def table(p: Page, table_id: str) -> list[dict[str, str]]:
    """The table's body rows, each cell by its column."""
    rows = p.driver.find_elements(By.CSS_SELECTOR, f"#{table_id} tbody tr")
    return [
        {
            td.get_attribute("data-column") or "": td.text
            for td in tr.find_elements(By.TAG_NAME, "td")
        }
        for tr in rows
    ]


# The figure Plotly drew in a graph: its title, annotations, shapes and traces.
_FIGURE_JS = """
const plot = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
if (!plot || !plot.layout) { return null; }
const title = plot.layout.title && plot.layout.title.text;
return {title: title || '',
        annotations: (plot.layout.annotations || []).map(a => a.text),
        shapes: (plot.layout.shapes || []).map(s => s.type),
        traces: plot.data.map(t => ({name: t.name || '', y: t.y || [], text: t.text || []}))};
"""


def figure(p: Page, graph_id: str, title: str) -> dict[str, Any]:
    """The figure in graph ``graph_id`` once Plotly has drawn the one titled ``title``."""

    def drawn(driver: webdriver.Chrome) -> Any:
        found = driver.execute_script(_FIGURE_JS, graph_id)
        return found if found and found["title"].startswith(title) else False

    result: dict[str, Any] = WebDriverWait(p.driver, 30, poll_frequency=0.1).until(drawn)
    return result


def finish(p: Page, name: str) -> None:
    """Save a screenshot and fail on any severe browser console message."""
    p.driver.save_screenshot(str(p.artifacts / f"{name}.png"))
    logs = p.driver.get_log("browser")  # type: ignore[no-untyped-call]
    assert [e for e in logs if e["level"] == "SEVERE"] == []


def test_a_three_instance_group_shows_three_live_the_desired_count_and_why(
    config, browser, tmp_path
):
    """The Replicas table has billing's live count and the autoscaler's last change; the
    instances are listed; the charts mark the decisions with their reasons."""
    with page(config, browser, tmp_path) as p:
        names = instances(p.ledger, "small-0", "chat-small", 3)
        keep(
            p.ledger,
            "scaling_decisions",
            [
                decision("chat-small", 900, 2, 3, "queue 12 > 10 for 35 s (>= 30 s): scale up"),
                decision("chat-large", 600, 1, 2, "raised to min_replicas 2"),
            ],
        )
        # Requests from before the decisions: the default range fits the data, so it holds both.
        requests(p.ledger, 5, time.time() - 1_000)
        requests(p.ledger, 5, time.time() - 120)
        sign_in(p, ADMIN_KEY)
        wait(p, "#fleet-replicas-table")
        rows = {r["model"]: r for r in table(p, "fleet-replicas-table")}
        small = rows["chat-small"]
        assert (small["groups"], small["configured"], small["live"], small["desired"]) == (
            "small-0, small-1",
            "2",
            "3",
            "3",
        )
        assert small["last_change"].endswith(": 2 -> 3")
        assert small["why"] == "queue 12 > 10 for 35 s (>= 30 s): scale up"
        assert (rows["chat-large"]["live"], rows["chat-large"]["desired"]) == ("0", "2")
        listed = table(p, "fleet-instances-table")
        assert [(r["replica_group"], r["instance"], r["node"], r["gpu_ids"]) for r in listed] == [
            ("small-0", name, "node-b", str(n)) for n, name in enumerate(names, start=2)
        ]
        requests_chart = figure(p, "fleet-requests", "Requests per second")
        events = next(t for t in requests_chart["traces"] if t["name"] == "scale events")
        assert len(events["text"]) == 2
        assert any(
            "chat-small: 2 -&gt; 3 replicas" in t or "chat-small: 2 -> 3 replicas" in t
            for t in events["text"]
        )
        assert requests_chart["shapes"].count("line") == 2
        finish(p, "fleet-instances-admin")

        sign_in(p, TEAM_KEYS["search"])
        wait(p, "#fleet-instances-sentence", "admin only")
        team_rows = {r["model"]: r for r in table(p, "fleet-replicas-table")}
        assert team_rows["chat-small"]["live"] == "admin only"
        # The autoscaler's decision weighs every team's load: the admin's, as the live count.
        assert team_rows["chat-small"]["desired"] == "admin only"
        finish(p, "fleet-instances-team")


def _wait_for_a_young_minute(latest_second: float = 15.0) -> float:
    """Sleep until a minute is 1 to ``latest_second`` seconds old, so the test ends within it
    and a record stamped a moment before now falls in it too."""
    into = time.time() % 60
    if not 1.0 <= into <= latest_second:
        time.sleep((1.5 - into) % 60)
    return time.time()


def test_a_fresh_ledger_in_its_first_minute_shows_the_same_requests_everywhere(
    config, browser, tmp_path
):
    """Summary, status and every chart of requests agree while no minute has closed yet."""
    with page(config, browser, tmp_path) as p:
        sign_in(p, ADMIN_KEY)  # before the clock starts: the browser's first load is the slowest
        now = _wait_for_a_young_minute()
        minute_ends = (now // 60 + 1) * 60
        requests(p.ledger, 7, now - 0.3)
        p.driver.get(p.url + "/")
        wait(p, "#summary-requests-value", "7")
        wait(p, "#fleet-requests-total", "7 requests in range")
        titles = (
            "Time to first token",
            "Output tokens per second",
            "Requests per second",
            "Error rate",
        )
        shown = {g: figure(p, g, t) for g, t in zip(REQUEST_CHARTS, titles, strict=True)}
        assert time.time() < minute_ends, "the minute closed before the page was read"
        finish(p, "fleet-first-minute")
    for graph_id, fig in shown.items():
        assert "No requests in this range." not in fig["annotations"], graph_id
        assert "partial: the last bucket so far" in fig["annotations"], graph_id
        assert "rect" in fig["shapes"], graph_id
    rates = shown["fleet-requests"]["traces"][0]["y"]
    assert len(rates) == 1
    assert rates[0] > 0
