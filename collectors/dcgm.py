"""dcgm-exporter as a GPU source: scrape a node's /metrics and read each GPU or MIG slice.

Fields read (dcgm-exporter's default counters): DCGM_FI_DEV_GPU_UTIL (percent),
DCGM_FI_PROF_GR_ENGINE_ACTIVE (ratio; the utilization of a MIG slice, which has no GPU_UTIL),
DCGM_FI_DEV_POWER_USAGE (W), DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ since boot),
DCGM_FI_DEV_FB_USED / _FREE (MiB), DCGM_FI_DEV_XID_ERRORS (last XID). Labels: gpu, UUID,
modelName, Hostname (or the newer ``hostname``), GPU_I_PROFILE / GPU_I_ID on MIG slices, and
pod / namespace / container when Kubernetes pod mapping is on.

dcgm-exporter repeats a board's power and energy on each of its MIG slices. Each slice's
reading gets its compute share of the board (the ``N`` of ``Ng.XXgb`` over the board's slices)
and that share of the board's power; its energy counter stays the board's, which the loop
differences and then splits by the share (``collectors.energy``), so the slices' energy adds up
to the board's once, not once per slice, whatever GPU instances come and go.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import replace
from typing import Final

import httpx

from collectors.exposition import ExpositionError, parse_samples
from collectors.sources import GpuReading, ScrapeError

__all__ = ["DCGM_FIELDS", "MAX_PAGE_BYTES", "DcgmSource", "dcgm_readings", "fetch_text"]

UTIL = "DCGM_FI_DEV_GPU_UTIL"
GR_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
POWER = "DCGM_FI_DEV_POWER_USAGE"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
XID = "DCGM_FI_DEV_XID_ERRORS"
DCGM_FIELDS = (UTIL, GR_ACTIVE, POWER, ENERGY, FB_USED, FB_FREE, XID)

_COMPUTE_SLICES = re.compile(r"^(\d+)g\.")

_Board = tuple[str, str]  # UUID, GPU_I_ID ('' for a whole GPU)
_Pod = tuple[str, str]  # namespace, pod


def dcgm_readings(text: str, node: str) -> list[GpuReading]:
    """Every GPU and MIG slice in one dcgm-exporter page; ExpositionError if it is not one.

    A board that several pods share by time-slicing is repeated by dcgm-exporter once per pod,
    with that pod's labels: it gives one reading per pod (the same board values, each pod's
    labels), so the loop can split the board among them. Keyed by board alone, the first pod's
    labels won and that pod paid for the whole board. A series without pod labels holds for
    every pod of its board. A field given twice for one GPU (and pod) with different values is
    named in the ``conflicts`` of every reading of that board, which refuse them: taken as read,
    the last line won, silently, and which series was true nobody knew.
    """
    samples = parse_samples(text, DCGM_FIELDS)
    board_rows: dict[_Board, dict[str, float]] = defaultdict(dict)
    pod_rows: dict[_Board, dict[_Pod, dict[str, float]]] = defaultdict(dict)
    labels: dict[tuple[_Board, _Pod | None], dict[str, str]] = {}
    conflicts: dict[tuple[_Board, _Pod | None], list[str]] = defaultdict(list)
    for name, found in samples.items():
        for lab, value in found:
            board = (lab.get("UUID", ""), lab.get("GPU_I_ID", ""))
            pod = (lab.get("namespace", ""), lab["pod"]) if lab.get("pod") else None
            row = board_rows[board] if pod is None else pod_rows[board].setdefault(pod, {})
            if name in row and row[name] != value:
                conflicts[(board, pod)].append(f"{name} {row[name]!r} and {value!r}")
            row[name] = value
            labels.setdefault((board, pod), lab)
    if not labels:
        raise ExpositionError("no DCGM_FI_ GPU metrics in the page")
    # A board's values are one whichever pod's series holds them: a conflict in any refuses all
    # its readings, so no pod of a time-sliced board pays another's part of a round.
    twice: dict[_Board, tuple[str, ...]] = defaultdict(tuple)
    for (where, _), lines in conflicts.items():
        twice[where] += tuple(lines)
    readings = []
    for board in dict.fromkeys(board for board, _ in labels):  # in the page's order
        shared = board_rows.get(board, {})
        for pod, own in pod_rows.get(board, {None: {}}).items():
            reading = _reading(node, labels[(board, pod)], {**shared, **own})
            readings.append(replace(reading, conflicts=twice[board]) if twice[board] else reading)
    return _split_mig_board_values(readings)


def _reading(node: str, lab: dict[str, str], row: dict[str, float]) -> GpuReading:
    utilization = row[UTIL] / 100.0 if UTIL in row else row.get(GR_ACTIVE, 0.0)
    missing = (
        *(("UUID",) if not lab.get("UUID") else ()),
        *(("power",) if POWER not in row else ()),
        *(("utilization",) if UTIL not in row and GR_ACTIVE not in row else ()),
    )
    return GpuReading(
        missing=missing,
        node=node,
        gpu=lab.get("gpu", ""),
        uuid=lab.get("UUID", ""),
        model_name=lab.get("modelName", ""),
        utilization=utilization,
        power_watts=row.get(POWER, 0.0),
        energy_mj=row.get(ENERGY),
        memory_used_mib=row.get(FB_USED, 0.0),
        memory_free_mib=row.get(FB_FREE, 0.0),
        xid_errors=_xid(row.get(XID, 0.0), lab),
        gr_engine_active=row.get(GR_ACTIVE),
        mig_profile=lab.get("GPU_I_PROFILE") or None,
        mig_instance=lab.get("GPU_I_ID") or None,
        hostname=lab.get("Hostname") or lab.get("hostname") or None,
        pod=lab.get("pod") or None,
        namespace=lab.get("namespace") or None,
        container=lab.get("container") or None,
    )


def _xid(value: float, lab: dict[str, str]) -> int:
    """The last XID code as an int; ExpositionError unless it is a whole number (``int`` raises
    on NaN and infinities, and a page is whatever the exporter, or whatever answers, says)."""
    if not (math.isfinite(value) and 0 <= value < 2**31 and value == int(value)):
        raise ExpositionError(f"GPU {lab.get('UUID', '?')}: XID {value!r} is not an XID code")
    return int(value)


def _split_mig_board_values(readings: list[GpuReading]) -> list[GpuReading]:
    """Give each MIG slice its compute share of the board, and that share of the board's power.

    The energy counter is left whole: it is the board's since boot, and a share changes when an
    operator creates or destroys a GPU instance (no reboot needed). A slice "counter" made of
    board counter x share jumped with it: a fall read as a reset counted the whole since-boot
    energy, a rise counted the change of share times it (437 MJ for one 1.5 kJ interval).
    """
    slices: dict[str, list[GpuReading]] = defaultdict(list)
    for r in readings:
        if r.mig_instance:
            slices[r.uuid].append(r)
    if not slices:
        return readings
    share: dict[tuple[str, str, str], float] = {}
    for board in slices.values():
        # One weight per slice, however many pods time-slice it (each has its own reading).
        weights = {r.key: _compute_slices(r.mig_profile) for r in board}
        for key, w in weights.items():
            share[key] = w / sum(weights.values())
    out = []
    for r in readings:
        f = share.get(r.key)
        if f is None:
            out.append(r)
            continue
        out.append(replace(r, power_watts=r.power_watts * f, share=f))
    return out


def _replace(r: GpuReading, power_watts: float, energy_mj: float | None) -> GpuReading:
    from dataclasses import replace

    return replace(r, power_watts=power_watts, energy_mj=energy_mj)


def _compute_slices(profile: str | None) -> int:
    match = _COMPUTE_SLICES.match(profile or "")
    return int(match[1]) if match else 1


class DcgmSource:
    """One node's dcgm-exporter /metrics endpoint, read over a shared HTTP client."""

    kind = "dcgm"

    def __init__(
        self, node: str, url: str, client: httpx.AsyncClient, timeout_seconds: float
    ) -> None:
        self.target = node
        self.url = url
        self.client = client
        self.timeout_seconds = timeout_seconds
        self.last_parse_seconds = 0.0

    async def read(self) -> list[GpuReading]:
        """Scrape and parse the node's page now."""
        text = await fetch_text(self.client, self.url, self.timeout_seconds)
        started = time.perf_counter()
        try:
            readings = dcgm_readings(text, self.target)
        except ExpositionError as exc:
            raise ScrapeError(f"{self.url}: not a dcgm-exporter page: {exc}") from None
        finally:
            self.last_parse_seconds = time.perf_counter() - started
        return readings


# The largest page read. A real dcgm-exporter page is about 9 KB per GPU (the 1-GPU capture in
# tests/fixtures is 11 KB with its comments), so 8 boards are some 75 KB, and 8 boards of 7 MIG
# slices each some 0.5 MB; vLLM's page is 52 KB. 8 MiB is 16 times the largest of these. Read
# whole, a 15 MiB page cost some 400 MiB of memory and half a second of the event loop, and up
# to 32 scrapes run at once.
MAX_PAGE_BYTES: Final = 8 * 2**20


async def fetch_text(
    client: httpx.AsyncClient,
    url: str,
    timeout_seconds: float,
    headers: dict[str, str] | None = None,
    max_bytes: int = MAX_PAGE_BYTES,
) -> str:
    """GET ``url`` and return its body; ScrapeError on any HTTP failure or non-200 answer.

    The body is streamed and the read given up past ``max_bytes`` (at once when Content-Length
    says so), so a page too big to be an exporter's costs at most that much memory.
    """
    try:
        async with client.stream("GET", url, timeout=timeout_seconds, headers=headers) as response:
            if response.status_code != 200:
                raise ScrapeError(f"{url}: HTTP {response.status_code}")
            body = await _read_capped(url, response, max_bytes)
    except httpx.TimeoutException:
        raise ScrapeError(f"{url}: no answer within {timeout_seconds:g} s") from None
    except httpx.HTTPError as exc:
        raise ScrapeError(
            f"{url}: {type(exc).__name__}: {str(exc) or 'connection failed'}"
        ) from None
    # UTF-8 whatever charset the server names: the exposition format is UTF-8, and a charset
    # such as punycode decodes in time quadratic in the page, on the event loop, where the
    # scrape's timeout cannot stop it (an 8 MiB page would hold every scrape for minutes).
    return body.decode("utf-8", errors="replace")


async def _read_capped(url: str, response: httpx.Response, max_bytes: int) -> bytes:
    too_big = f"{url}: page over the {max_bytes:,} bytes a metrics page may have"
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise ScrapeError(f"{too_big} (Content-Length: {declared})")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise ScrapeError(too_big)
        chunks.append(chunk)
    return b"".join(chunks)
