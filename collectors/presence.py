"""Which GPUs a page read left out, and when such a GPU's last reading is forgotten.

A GPU (or MIG slice) can leave its node's page while the page is still read: a board fallen off
the bus, a GPU instance destroyed by a re-partition, a node whose boards changed. Kept as the
baseline, its last reading made the reading that came back (the board again, or a new slice
given the old GPU_I_ID) one interval spanning the whole absence: a gap, whose time billing
counts as held GPU time, billed to whoever holds the board now.

A page that was read and did not list a GPU is evidence the GPU was not there; a page that was
not read (the target down, the collector restarting) is none, and a GPU not read stays a gap
past the gap limit, as before: it was held all along, as far as anyone knows. So a reading
older than the gap limit is forgotten once a page read since has left its GPU out: the GPU's
return is measured as a first reading is (a whole GPU from 0 s, a slice from its board's latest
reading), never across the absence. The bound is the gap limit because it is where the loop
already stops believing an interval (no energy past it); an absence shorter than it is a
missed line the board's counter measures exactly, as after any missed reading.

Forgotten readings are what keeps memory bounded while MIG layouts and boards come and go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

from collectors.energy import Point
from collectors.sources import GpuReading

__all__ = ["Key", "absences", "listed_keys"]

Key = tuple[str, str, str]


def listed_keys(readings: Iterable[GpuReading], homes: Mapping[str, str]) -> set[Key]:
    """The keys of ``readings`` under the node each board is sampled under (``board_homes``).

    Every reading a page listed counts, kept or not: a reading left out as another node's or
    refused as untrue still says the GPU is there.
    """
    return {(homes.get(r.uuid, r.node), r.uuid, r.mig_instance or "") for r in readings}


def absences(
    held: Mapping[Key, Point],
    listed: Set[Key],
    missing: Set[Key],
    now: float,
    gap_seconds: float,
) -> tuple[set[Key], set[Key]]:
    """``(forget, missing)`` for the readings ``held`` under nodes whose pages were read ``now``.

    ``listed``: the keys those pages listed; ``missing``: the keys a page read before left out.
    A reading older than ``gap_seconds`` whose GPU a page left out (this one or one before) is
    forgotten; one within it that this page left out is missing from now on.
    """
    forget = {
        k for k, p in held.items() if now - p.t > gap_seconds and (k in missing or k not in listed)
    }
    return forget, {k for k in held if k not in listed and k not in forget}
