"""The autoscaler loop over real loopback HTTP: pages in, gauges and hooks out."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, ClassVar

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from alerts.autoscale.hooks import Hook, HookError, KubernetesScaleHook, ScalingGauges, WebhookHook
from alerts.autoscale.policy import Decision, Observation, model_limits, params_from_config
from alerts.autoscale.service import Autoscaler, PageReader, build_hooks, build_reader, create_app
from infermeter.config import Config
from infermeter.serving import free_port
from tests.alerts_autoscale.test_inputs import COLLECTOR_PAGE
from tests.servers import serving


class Fleet:
    """The collector's page (queue depth can be changed), and a recorder for both hooks."""

    def __init__(self) -> None:
        self.queue = 7.0
        self.webhooks: list[dict[str, Any]] = []
        self.patches: list[dict[str, Any]] = []

    async def metrics(self, request: Request) -> Response:
        page = COLLECTOR_PAGE.replace('replica="small-1"} 7.0', f'replica="small-1"}} {self.queue}')
        return PlainTextResponse(page)

    async def hook(self, request: Request) -> Response:
        self.webhooks.append(json.loads(await request.body()))
        return Response()

    async def scale(self, request: Request) -> Response:
        self.patches.append({"path": request.url.path, "body": json.loads(await request.body())})
        return Response("{}", media_type="application/json")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/metrics", self.metrics),
                Route("/hook", self.hook, methods=["POST"]),
                Route(
                    "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
                    self.scale,
                    methods=["PATCH"],
                ),
            ]
        )


async def test_ticks_set_gauges_and_deliver_each_change_once(config: Config) -> None:
    """A sustained queue raises desired replicas; hooks hear each new value exactly once."""
    fleet = Fleet()
    now = [1000.0]
    gauges = ScalingGauges()
    async with serving(fleet.app()) as url, httpx.AsyncClient() as client:
        reader = PageReader(
            f"{url}/metrics", [], ["chat-small", "chat-large"], client, clock=lambda: now[0]
        )
        hooks: list[Hook] = [
            WebhookHook(f"{url}/hook", b"s", client, 5),
            KubernetesScaleHook(url, "infermeter", {"chat-small": "vllm-chat-small"}, client),
        ]
        limits = {m.name: model_limits(config, m.name) for m in config.models}
        scaler = Autoscaler(params_from_config(config), limits, reader, gauges, hooks)
        first = await scaler.tick()
        await scaler.settle()
        assert first["chat-small"].desired == 2
        now[0] += 15
        await scaler.tick()
        await scaler.settle()
        now[0] += 20  # queue 12 > 10 for 35 s
        third = await scaler.tick()
        await scaler.settle()
        assert third["chat-small"].desired == 3
    get = gauges.registry.get_sample_value
    assert get("infermeter_desired_replicas", {"model": "chat-small"}) == 3
    assert get("infermeter_current_replicas", {"model": "chat-small"}) == 2
    assert [(w["model"], w["desired"]) for w in fleet.webhooks] == [
        ("chat-small", 2),
        ("chat-large", 2),
        ("chat-small", 3),
    ]
    assert [p["body"] for p in fleet.patches] == [
        {"spec": {"replicas": 2}},
        {"spec": {"replicas": 3}},
    ]


async def test_each_change_of_desired_replicas_is_logged_in_one_line(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """A change logs model, from -> to and the reasons at INFO, once; a tick that holds logs none."""
    fleet = Fleet()
    now = [1000.0]
    async with serving(fleet.app()) as url, httpx.AsyncClient() as client:
        reader = PageReader(
            f"{url}/metrics", [], ["chat-small", "chat-large"], client, clock=lambda: now[0]
        )
        limits = {m.name: model_limits(config, m.name) for m in config.models}
        scaler = Autoscaler(params_from_config(config), limits, reader, ScalingGauges())

        async def tick(seconds: float) -> tuple[dict[str, Decision], list[tuple[int, str]]]:
            now[0] += seconds
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="infermeter.autoscale"):
                decisions = await scaler.tick()
            return decisions, [(r.levelno, r.getMessage()) for r in caplog.records]

        _, first = await tick(0)
        _, holding = await tick(15)
        decided, raised = await tick(20)  # queue 12 > 10 for 35 s
        _, still = await tick(5)
    assert first == [
        (logging.INFO, "autoscale: chat-large: 1 -> 2 replicas: raised to min_replicas 2")
    ]
    assert holding == []
    reasons = "; ".join(decided["chat-small"].reasons)
    assert "queue" in reasons
    assert raised == [(logging.INFO, f"autoscale: chat-small: 2 -> 3 replicas: {reasons}")]
    assert still == []  # asked for 3 already: nothing new to say


async def test_an_unreachable_collector_skips_the_tick(config: Config) -> None:
    """No inputs, no decisions: the gauges keep their last values."""
    gauges = ScalingGauges()
    gauges.desired.labels(model="chat-small").set(5)
    async with httpx.AsyncClient() as client:
        reader = PageReader(f"http://127.0.0.1:{free_port()}/metrics", [], ["chat-small"], client)
        limits = {"chat-small": model_limits(config, "chat-small")}
        scaler = Autoscaler(params_from_config(config), limits, reader, gauges)
        assert await scaler.tick() == {}
    assert (
        gauges.registry.get_sample_value("infermeter_desired_replicas", {"model": "chat-small"})
        == 5
    )


def _pages(sidecar: str, collector: str = COLLECTOR_PAGE) -> Starlette:
    """The collector's page at /metrics and one sidecar's at /sidecar."""

    async def page(request: Request) -> Response:
        return PlainTextResponse(collector if request.url.path == "/metrics" else sidecar)

    return Starlette(routes=[Route("/metrics", page), Route("/sidecar", page)])


NOT_THE_FORMAT = {
    "an HTML error page": "<html><body>502 Bad Gateway</body></html>\n",
    "a TTFT bucket without le": 'infermeter_time_to_first_token_seconds_bucket{model="chat-small"} 3\n',
    "a TTFT bucket whose le is no number": (
        'infermeter_time_to_first_token_seconds_bucket{model="chat-small",le="abc"} 3\n'
    ),
}


@pytest.mark.parametrize("page", NOT_THE_FORMAT.values(), ids=list(NOT_THE_FORMAT))
async def test_a_sidecar_page_that_cannot_be_read_is_that_page_missing(
    config: Config, caplog: pytest.LogCaptureFixture, page: str
) -> None:
    """The tick decides on the other pages, counts the page unread, and says so once."""
    gauges = ScalingGauges()
    async with serving(_pages(page)) as url, httpx.AsyncClient() as client:
        reader = PageReader(
            f"{url}/metrics", [f"{url}/sidecar"], ["chat-small"], client, gauges=gauges
        )
        limits = {"chat-small": model_limits(config, "chat-small")}
        scaler = Autoscaler(params_from_config(config), limits, reader, gauges)
        with caplog.at_level(logging.WARNING, logger="infermeter.autoscale"):
            first = await scaler.tick()
            second = await scaler.tick()
    assert first["chat-small"].current == second["chat-small"].current == 2
    assert gauges.registry.get_sample_value("infermeter_autoscale_unread_pages") == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"autoscale: cannot read {url}/sidecar")


async def test_a_collector_page_that_cannot_be_read_skips_the_tick(config: Config) -> None:
    """An HTML page where the collector's should be: no decisions, the gauges keep their values."""
    gauges = ScalingGauges()
    gauges.desired.labels(model="chat-small").set(5)
    html = NOT_THE_FORMAT["an HTML error page"]
    async with serving(_pages("", collector=html)) as url, httpx.AsyncClient() as client:
        reader = PageReader(f"{url}/metrics", [], ["chat-small"], client, gauges=gauges)
        limits = {"chat-small": model_limits(config, "chat-small")}
        scaler = Autoscaler(params_from_config(config), limits, reader, gauges)
        assert await scaler.tick() == {}
    get = gauges.registry.get_sample_value
    assert get("infermeter_desired_replicas", {"model": "chat-small"}) == 5
    assert get("infermeter_autoscale_unread_pages") == 1


class _FailsOnce:
    """A reader whose first read raises what nobody foresaw; later reads see two replicas."""

    def __init__(self, reads_wanted: int) -> None:
        self.reads = 0
        self.reads_wanted = reads_wanted
        self.done = asyncio.Event()

    async def read(self) -> dict[str, Observation]:
        self.reads += 1
        if self.reads == self.reads_wanted:
            self.done.set()
        if self.reads == 1:
            raise RuntimeError("a bug nobody foresaw")
        return {
            "chat-small": Observation(time=1000.0 + self.reads, current_replicas=2, queue_depth=0)
        }


async def test_a_tick_that_fails_does_not_end_the_loop(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure is logged with its traceback and counted; the next ticks decide as usual."""
    gauges = ScalingGauges()
    reader = _FailsOnce(reads_wanted=3)  # the third read starts once the second tick is over
    limits = {"chat-small": model_limits(config, "chat-small")}
    scaler = Autoscaler(params_from_config(config), limits, reader, gauges)
    with caplog.at_level(logging.ERROR, logger="infermeter.autoscale"):
        loop = asyncio.create_task(scaler.run(0.01))
        waiting = asyncio.create_task(reader.done.wait())
        await asyncio.wait({loop, waiting}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert not loop.done(), "the loop ended"
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
    get = gauges.registry.get_sample_value
    assert get("infermeter_autoscale_tick_failures_total") == 1
    assert get("infermeter_desired_replicas", {"model": "chat-small"}) == 2
    assert (get("infermeter_autoscale_last_tick_timestamp_seconds") or 0) > 0
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failed) == 1
    assert failed[0].exc_info is not None


class _StuckHook:
    """A receiver that takes a decision and answers only when told to."""

    name: ClassVar[str] = "stuck"

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.heard: list[int] = []

    async def publish(self, decision: Decision) -> None:
        await self.answer.wait()
        self.heard.append(decision.desired)


class _Recorder:
    """A receiver that answers at once."""

    name: ClassVar[str] = "recorder"

    def __init__(self) -> None:
        self.heard: list[int] = []

    async def publish(self, decision: Decision) -> None:
        self.heard.append(decision.desired)


async def test_a_hook_slow_to_answer_holds_up_neither_the_tick_nor_the_other_hooks(
    config: Config,
) -> None:
    """The tick returns and the other hook hears the change while one receiver has not answered."""
    fleet = Fleet()
    stuck, recorder = _StuckHook(), _Recorder()
    async with serving(fleet.app()) as url, httpx.AsyncClient() as client:
        reader = PageReader(f"{url}/metrics", [], ["chat-large"], client)
        limits = {"chat-large": model_limits(config, "chat-large")}
        hooks: list[Hook] = [stuck, recorder]
        scaler = Autoscaler(params_from_config(config), limits, reader, ScalingGauges(), hooks)
        decisions = await asyncio.wait_for(scaler.tick(), timeout=30)
        while not recorder.heard:
            await asyncio.sleep(0.01)
        assert stuck.heard == []
        stuck.answer.set()
        await scaler.settle()
    assert decisions["chat-large"].desired == 2
    assert (stuck.heard, recorder.heard) == ([2], [2])


async def test_metrics_endpoint_serves_the_gauges():
    """/metrics exposes infermeter_desired_replicas for KEDA; /healthz answers ok."""
    gauges = ScalingGauges()
    gauges.desired.labels(model="chat-large").set(4)
    async with serving(create_app(gauges)) as url, httpx.AsyncClient() as client:
        metrics = await client.get(f"{url}/metrics")
        health = await client.get(f"{url}/healthz")
    assert 'infermeter_desired_replicas{model="chat-large"} 4.0' in metrics.text
    assert health.text == "ok\n"


def test_webhook_without_its_secret_is_a_start_up_error(config: Config) -> None:
    """webhook_url with an empty secret variable stops the service before it starts."""
    autoscale = config.autoscale.model_copy(update={"webhook_url": "http://hooks.example/x"})
    config = config.model_copy(update={"autoscale": autoscale})
    with pytest.raises(HookError, match="INFERMETER_WEBHOOK_SECRET"):
        build_hooks(config, httpx.AsyncClient(), environ={})


def test_reader_defaults_to_the_collector_and_every_sidecar(config: Config) -> None:
    """Without URLs in the section, pages come from collector.listen and each sidecar_listen."""
    reader = build_reader(config, httpx.AsyncClient(), None)
    assert isinstance(reader, PageReader)
    assert reader.collector_url == f"http://{config.collector.listen}/metrics"
    assert len(reader.sidecar_urls) == len(config.replicas)


def test_instance_sidecars_are_read_while_they_live_and_then_forgotten(config: Config) -> None:
    """Sidecars that come and go are read after the fixed ones; one gone is no longer listed."""
    live = ["http://i1/metrics", "http://i2/metrics"]
    reader = PageReader(
        "http://c/metrics",
        ["http://s/metrics"],
        ["chat-small"],
        httpx.AsyncClient(),
        instance_sidecars=lambda: live,
    )
    assert reader.page_urls() == ["http://s/metrics", "http://i1/metrics", "http://i2/metrics"]
    live = ["http://i2/metrics", "http://i3/metrics"]
    assert reader.page_urls() == ["http://s/metrics", "http://i2/metrics", "http://i3/metrics"]
    for port in range(1000):  # a thousand instances started and stopped, one at a time
        live = [f"http://127.0.0.1:{30000 + port}/metrics"]
        reader.page_urls()
    assert reader.page_urls() == ["http://s/metrics", "http://127.0.0.1:30999/metrics"]
