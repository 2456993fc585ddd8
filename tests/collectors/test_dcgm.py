"""dcgm-exporter pages become GPU readings: the real capture, the simulator's, and MIG slices."""

from __future__ import annotations

import pytest

from collectors.dcgm import dcgm_readings
from collectors.exposition import ExpositionError
from simulator.dcgm import DcgmGpu, render

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
    """Each slice is its own reading; board power, energy and GPU time split 1:3 by compute slices."""
    a, b = dcgm_readings(MIG_PAGE, "node-m")
    assert (a.slot, a.mig_profile, b.slot, b.mig_profile) == ("0/1", "1g.10gb", "0/2", "3g.40gb")
    assert (a.utilization, b.utilization) == (0.25, 0.75)
    assert (a.power_watts, b.power_watts) == (70.0, 210.0)
    assert (a.energy_mj, b.energy_mj) == (1_000_000.0, 3_000_000.0)
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
