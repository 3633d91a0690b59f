"""A run's energy, where it can be measured: its GPUs through NVML, its share of the CPU packages through RAPL.

GPUs: the energy counter (``nvmlDeviceGetTotalEnergyConsumption``) where the GPUs have one, else power
readings integrated over each interval; CPUs: :mod:`~prefect_launch.workers.metrics.rapl` (package energy
x the run's CPU time / the host's busy CPU time). What was chosen, or why nothing could be, goes into
the run record's ``extra`` (``gpu_energy``, ``cpu_energy``). Used by the sampler once per tick.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect_launch.workers.metrics.rapl import RaplReader


class EnergyMeter:
    """How one run's energy is read: decided once (`notes`), then read each tick (`read`, `since`)."""

    def __init__(self, nvml: Any, gpu_indices: list[int]) -> None:
        self.nvml = nvml
        self.gpu_indices = gpu_indices
        self.gpu_source: Optional[str] = None  # "counter" / "power" / None (not measured)
        self.rapl: Optional[RaplReader] = None

    def notes(self) -> dict[str, str]:
        """Decide how this run's energy is measured; the words go into the record's extra."""
        notes: dict[str, str] = {}
        if self.gpu_indices:
            nv = self.nvml
            if nv is None or not nv.available:
                notes["gpu_energy"] = "unavailable: NVML not available" + (
                    f" ({nv.error})" if nv is not None and nv.error else "")
            elif nv.energy_mj(self.gpu_indices) is not None:
                self.gpu_source = "counter"
                notes["gpu_energy"] = "nvml energy counter"
            elif nv.power_mw(self.gpu_indices) is not None:
                self.gpu_source = "power"
                notes["gpu_energy"] = "nvml power readings integrated over each interval (no energy counter)"
            else:
                notes["gpu_energy"] = "unavailable: NVML reports neither energy nor power for these GPUs"
        try:
            rapl = RaplReader()
        except Exception as exc:  # pragma: no cover - defensive
            rapl = None
            notes["cpu_energy"] = f"unavailable: {exc}"
        if rapl is not None:
            if rapl.unavailable:
                notes["cpu_energy"] = f"unavailable: {rapl.unavailable}"
            else:
                self.rapl = rapl
                notes["cpu_energy"] = "rapl: package energy x the run's share of the host's busy CPU time"
        return notes

    def read(self) -> tuple[Any, Any]:
        """(GPU reading, RAPL reading) now; None where not measured."""
        gpu = None
        if self.gpu_source == "counter":
            gpu = self.nvml.energy_mj(self.gpu_indices)
        elif self.gpu_source == "power":
            gpu = self.nvml.power_mw(self.gpu_indices)
        return gpu, (self.rapl.read() if self.rapl is not None else None)

    def since(self, prev: tuple[Any, Any], cur: tuple[Any, Any], wall: float,
              cpu_s: float) -> tuple[Optional[float], Optional[float]]:
        """(GPU joules, CPU joules) of the interval between two readings; None where unmeasured."""
        gpu_j = None
        if prev[0] is not None and cur[0] is not None:
            if self.gpu_source == "counter":
                gpu_j = (cur[0] - prev[0]) / 1000.0 if cur[0] >= prev[0] else None  # a reset counter: not this run's
            else:  # power (mW): trapezoid over the interval
                gpu_j = (prev[0] + cur[0]) / 2.0 * wall / 1000.0
        cpu_j = self.rapl.interval(prev[1], cur[1], cpu_s) if self.rapl is not None else None
        return (round(gpu_j, 3) if gpu_j is not None else None), (round(cpu_j, 3) if cpu_j is not None else None)
