"""dcgm-exporter pages become GPU readings: the real capture, the simulator's, MIG slices, and
pages too big to be an exporter's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest

from collectors.dcgm import DCGM_FIELDS, MAX_PAGE_BYTES, DcgmSource, dcgm_readings
from collectors.exposition import MAX_LINES, ExpositionError, parse_samples
from collectors.sources import ScrapeError, screen_gpu_readings
from collectors.vllm import VllmSource
from simulator.dcgm import DcgmGpu, render
from tests.collectors.fakes import Receive, Scope, Send, shared_board_page
from tests.servers import serving

MIG_PAGE = """\
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="1",hostname="node-m"} 280.000000
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",hostname="node-m"} 280.000000
# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="1",hostname="node-m"} 4000000
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",hostname="node-m"} 4000000
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="1",hostname="node-m",container="vllm",namespace="inference",pod="vllm-tiny-0-0"} 0.250000
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",hostname="node-m"} 0.750000
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="1",hostname="node-m"} 9000
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",hostname="node-m"} 100
"""


def test_real_capture_parses_into_one_gpu_with_its_pod(fixture_text):
    """The RTX 4000 Ada capture: utilization, power, mJ counter, memory, XID and pod labels."""
    [r] = dcgm_readings(fixture_text("dcgm-exporter-rtx4000ada-k8s.prom"), "node-x")
    assert (r.node, r.gpu, r.uuid) == ("node-x", "0", "GPU-a8394b51-c086-568a-9f1a-c1e1c934c44c")
    assert r.model_name == "NVIDIA RTX 4000 Ada Generation"
    assert r.hostname == "lke529760-766837-0a634ab30000"
    assert (r.utilization, r.power_watts, r.energy_mj) == (0.0, 40.979, 455497156.0)
    assert (r.memory_used_mib, r.memory_free_mib, r.xid_errors) == (1.0, 20015.0, 0)
    assert (r.pod, r.namespace, r.container) == ("cuda-75454ffb9f-8ljq7", "default", "cuda")
    assert r.mig_profile is None
    assert r.slot == "0"


def test_simulator_page_gives_every_board():
    """The simulator's renderer: 8 boards, percent utilization turned into a ratio."""
    gpus = [
        DcgmGpu(
            index=i,
            uuid=f"GPU-{i}",
            model_name="NVIDIA H100",
            hostname="n",
            utilization_pct=50.0,
            power_watts=300.25,
            energy_mj=1000 * i,
            memory_used_mib=10,
            memory_free_mib=20,
            xid=43 if i == 3 else 0,
        )
        for i in range(8)
    ]
    readings = dcgm_readings(render(gpus), "n")
    assert [r.gpu for r in readings] == [str(i) for i in range(8)]
    assert {r.utilization for r in readings} == {0.5}
    assert readings[3].xid_errors == 43
    assert readings[5].energy_mj == 5000


def test_mig_slices_are_separate_readings_sharing_board_power_and_energy():
    """Each slice is its own reading; board power and GPU time split 1:3 by compute slices, and
    each keeps the board's energy counter whole (the loop splits its increase by the share)."""
    a, b = dcgm_readings(MIG_PAGE, "node-m")
    assert (a.slot, a.mig_profile, b.slot, b.mig_profile) == ("0/1", "1g.10gb", "0/2", "3g.40gb")
    assert (a.utilization, b.utilization) == (0.25, 0.75)
    assert (a.power_watts, b.power_watts) == (70.0, 210.0)
    assert (a.energy_mj, b.energy_mj) == (4_000_000.0, 4_000_000.0)
    assert (a.share, b.share) == (0.25, 0.75)
    assert a.hostname == "node-m"
    assert a.pod == "vllm-tiny-0-0"


def test_page_without_dcgm_fields_is_refused():
    """A valid exposition with no DCGM fields is not a dcgm-exporter page."""
    with pytest.raises(ExpositionError, match="no DCGM_FI_"):
        dcgm_readings("up 1\n", "n")


@pytest.mark.parametrize("xid", ["NaN", "+Inf", "-Inf", "-1", "43.5"])
def test_an_xid_that_is_not_a_code_is_refused_as_a_bad_page(xid):
    """An XID of NaN, infinity, a negative or a fraction makes the page the exporter's error."""
    page = 'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a"} ' + xid + "\n"
    with pytest.raises(ExpositionError, match="XID"):
        dcgm_readings(page, "n")


def _page_app(
    body: bytes, declare_length: bool
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """A server answering with ``body`` in 64 KiB pieces, with or without a Content-Length."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"text/plain")]
        if declare_length:
            headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for at in range(0, len(body), 2**16):
            chunk = body[at : at + 2**16]
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


# A valid vLLM page made 12 MiB by comment lines, as the audit's 15 MiB one was.
_HUGE = b"##\n" * (12 * 2**20 // 3) + b"vllm:num_requests_running 1\n"


@pytest.mark.parametrize("declare_length", [True, False], ids=["content-length", "chunked"])
async def test_a_page_over_the_size_cap_is_a_scrape_error_naming_it(declare_length):
    """12 MiB where a metrics page should be: refused with the 8 MiB cap named, not parsed."""
    async with (
        serving(_page_app(_HUGE, declare_length)) as url,
        httpx.AsyncClient() as client,
    ):
        source = VllmSource("small-0", f"{url}/metrics", client, 5.0)
        with pytest.raises(ScrapeError) as caught:
            await source.read()
    message = str(caught.value)
    assert f"page over the {MAX_PAGE_BYTES:,} bytes a metrics page may have" in message
    assert ("Content-Length: " in message) is declare_length


async def test_a_page_under_the_size_cap_is_read_whole(fixture_text):
    """A real capture streamed in pieces, without a length, reads back as the same GPU."""
    page = fixture_text("dcgm-exporter-rtx4000ada-k8s.prom").encode()
    async with serving(_page_app(page, False)) as url, httpx.AsyncClient() as client:
        [r] = await DcgmSource("node-x", f"{url}/metrics", client, 5.0).read()
    assert r.energy_mj == 455497156.0


def test_a_page_of_too_many_lines_is_refused():
    """More lines than any metrics page has: refused before they are split into strings."""
    with pytest.raises(ExpositionError, match="more than the 100,000 lines"):
        parse_samples("#\n" * (MAX_LINES + 1), DCGM_FIELDS)


def test_a_time_sliced_board_gives_one_reading_per_pod():
    """Each pod sharing a board has its own reading, with the board's values and its own labels."""
    readings = dcgm_readings(shared_board_page(1_000_000), "node-a")
    assert [(r.key, r.pod, r.power_watts, r.energy_mj) for r in readings] == [
        (("node-a", "GPU-3333", ""), "pod-a", 300.0, 1_000_000.0),
        (("node-a", "GPU-3333", ""), "pod-b", 300.0, 1_000_000.0),
    ]


def test_a_time_sliced_mig_slice_keeps_its_compute_share():
    """Two pods on a 1g slice beside a 3g one: the slice is still a quarter of the board."""
    readings = dcgm_readings(shared_board_page(1_000_000, mig=True), "node-a")
    assert [(r.slot, r.pod, r.share, r.power_watts) for r in readings] == [
        ("3/1", "pod-a", 0.25, 75.0),
        ("3/1", "pod-b", 0.25, 75.0),
        ("3/2", None, 0.75, 225.0),
    ]


def test_a_field_given_twice_with_different_values_is_named_on_every_reading_of_its_board():
    """One pod's series of a time-sliced board repeats its energy counter with another value:
    every reading of that board carries the conflict (so no pod pays another's part of the
    round), the other board none; the same line twice with the same value is no conflict."""
    page = shared_board_page(5_000_000)
    again = 'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="3",UUID="GPU-3333",modelName="NVIDIA L40S",'
    again += 'namespace="ns",pod="pod-b",container="vllm"}'
    other = 'DCGM_FI_DEV_POWER_USAGE{gpu="4",UUID="GPU-4444",modelName="NVIDIA L40S"} 200\n'
    other += 'DCGM_FI_DEV_GPU_UTIL{gpu="4",UUID="GPU-4444",modelName="NVIDIA L40S"} 50\n'
    readings = dcgm_readings(page + f"{again} 5000000\n{again} 6000000\n" + other * 2, "node-a")
    conflict = ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION 5000000.0 and 6000000.0",)
    assert [(r.pod, r.uuid, r.conflicts) for r in readings] == [
        ("pod-a", "GPU-3333", conflict),
        ("pod-b", "GPU-3333", conflict),
        (None, "GPU-4444", ()),
    ]
    fit, refused = screen_gpu_readings(readings)
    assert [r.uuid for r in fit] == ["GPU-4444"]
    assert refused == [f"node-a/3 {conflict[0]} (two series for one GPU)"] * 2


def test_a_gpu_the_page_gives_no_power_utilization_or_uuid_is_refused_not_zeroed():
    """dcgm-exporter leaves out a field DCGM returned blank (a faulty board), and an XID-only
    series names no UUID: read as 0 W and 0 % (a board billed as idle, its energy from a power
    of nothing) or as a GPU of its own, they would invent figures. Each such reading is
    refused, naming what is missing; a whole board beside them is kept."""
    whole = 'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-0"} 200\nDCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0"} 50\n'
    no_power = 'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-1"} 50\n'
    no_util = 'DCGM_FI_DEV_POWER_USAGE{gpu="2",UUID="GPU-2"} 150\n'
    no_uuid = 'DCGM_FI_DEV_XID_ERRORS{gpu="3"} 0\n'
    fit, refused = screen_gpu_readings(dcgm_readings(whole + no_power + no_util + no_uuid, "n"))
    assert [(r.uuid, r.power_watts, r.utilization) for r in fit] == [("GPU-0", 200.0, 0.5)]
    assert refused == [
        "n/1 power missing from the page",
        "n/2 utilization missing from the page",
        "n/3 UUID missing from the page",
        "n/3 power missing from the page",
        "n/3 utilization missing from the page",
    ]
