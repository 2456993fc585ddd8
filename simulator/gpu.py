"""A simulated GPU's power, utilization and energy, driven by its engine's steps.

The engine tells the meter, step by step, how long the GPU was busy and how hard (the batch
load); the meter integrates power over time, so the energy counter is exactly the integral of
the power it reports, the way a real board's counter is. Utilization is the share of time a
kernel ran over the last second, which is what DCGM_FI_DEV_GPU_UTIL measures.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from infermeter.config import GpuProfile

__all__ = ["GpuMeter", "GpuReading"]

WINDOW_SECONDS = 1.0


@dataclass(frozen=True)
class GpuReading:
    """What dcgm-exporter would read off the board at one moment."""

    utilization_pct: float
    power_watts: float
    energy_joules: float
    busy_seconds: float
    memory_used_mib: float
    memory_free_mib: float


class GpuMeter:
    """Energy and busy-time integrator of one GPU."""

    def __init__(self, profile: GpuProfile, now: float, memory_fraction: float = 0.92) -> None:
        self.profile = profile
        self._t = now
        self._energy = 0.0
        self._busy = 0.0
        self._memory_used = round(profile.memory_mib * memory_fraction)
        self._history: deque[tuple[float, float, float]] = deque([(now, 0.0, 0.0)])

    def power_at(self, load: float) -> float:
        """Board power while a step with this load (0..1) runs."""
        p = self.profile
        return p.idle_watts + (p.max_watts - p.idle_watts) * (0.45 + 0.55 * min(1.0, load))

    def idle_until(self, now: float) -> None:
        """Account the time since the last event as idle."""
        if now > self._t:
            self._energy += self.profile.idle_watts * (now - self._t)
            self._t = now
            self._remember()

    def busy(self, start: float, end: float, load: float) -> None:
        """Account a step that ran from ``start`` to ``end`` at ``load``."""
        self.idle_until(start)
        if end > self._t:
            self._energy += self.power_at(load) * (end - self._t)
            self._busy += end - self._t
            self._t = end
            self._remember()

    def _remember(self) -> None:
        self._history.append((self._t, self._busy, self._energy))
        while len(self._history) > 2 and self._history[1][0] < self._t - 4 * WINDOW_SECONDS:
            self._history.popleft()

    def read(self, now: float) -> GpuReading:
        """Readings at ``now``: utilization and power averaged over the last second."""
        self.idle_until(now)
        since = now - WINDOW_SECONDS
        base = self._history[0]
        for entry in self._history:
            if entry[0] > since:
                break
            base = entry
        span = max(now - base[0], 1e-9)
        util = min(100.0, 100.0 * (self._busy - base[1]) / span)
        power = (self._energy - base[2]) / span if now > base[0] else self.profile.idle_watts
        return GpuReading(
            utilization_pct=util,
            power_watts=power,
            energy_joules=self._energy,
            busy_seconds=self._busy,
            memory_used_mib=float(self._memory_used),
            memory_free_mib=float(self.profile.memory_mib - self._memory_used),
        )
