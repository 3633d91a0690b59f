"""CPU package energy from RAPL (``/sys/class/powercap``), for the sampler's energy figures.

RAPL counts the energy of each CPU package (socket) in microjoules, in
``/sys/class/powercap/intel-rapl:N/energy_uj`` (AMD's packages appear under the same
``intel-rapl`` driver), wrapping at ``max_energy_range_uj``. The counters are for the whole
package, not for one process: :class:`RaplReader` reads them with the host's busy CPU time,
and :meth:`RaplReader.interval` gives a run its share of the package energy of an interval,
in proportion to the CPU time the run used out of all the CPU time the host used meanwhile.

Since Linux 5.10 ``energy_uj`` is readable by root only; in containers the tree is often
absent. Then :attr:`RaplReader.unavailable` says why and every figure is None: the caller
records "unavailable", never a guess.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import psutil

ROOT = "/sys/class/powercap"
_PACKAGE = re.compile(r"^intel-rapl:\d+$")  # packages; sub-zones (core, uncore, dram) are intel-rapl:N:M


def _host_busy_s() -> float:
    """CPU-seconds the whole host has spent busy since boot (all CPUs)."""
    t = psutil.cpu_times()
    return float(sum(t)) - float(t.idle) - float(getattr(t, "iowait", 0.0))


class RaplReader:
    """Package energy counters and the host's busy CPU time, read together."""

    def __init__(self, root: Optional[str] = None) -> None:
        self.root = Path(root or os.environ.get("LAUNCH_RAPL_ROOT") or ROOT)
        self.unavailable: Optional[str] = None
        self.packages: list[tuple[Path, int]] = []  # (energy_uj path, wrap range)
        try:
            zones = sorted(p for p in self.root.iterdir() if _PACKAGE.match(p.name))
        except OSError:
            zones = []
        if not zones:
            self.unavailable = f"no RAPL package under {self.root}"
            return
        for z in zones:
            try:
                rng = int((z / "max_energy_range_uj").read_text())
            except (OSError, ValueError):
                rng = 0
            self.packages.append((z / "energy_uj", rng))
        if self.read() is None and self.unavailable is None:
            self.unavailable = "RAPL energy_uj not readable"

    def read(self) -> Optional[tuple[list[int], float]]:
        """(counter per package in uJ, host busy CPU-seconds), or None when unreadable."""
        if not self.packages:
            return None
        vals = []
        for path, _ in self.packages:
            try:
                vals.append(int(path.read_text()))
            except PermissionError:
                self.unavailable = f"{path} not readable (root only since Linux 5.10)"
                return None
            except (OSError, ValueError) as exc:
                self.unavailable = f"{path}: {exc}"
                return None
        return vals, _host_busy_s()

    def package_joules(self, prev: list[int], cur: list[int]) -> float:
        """Energy of all packages between two readings (counter wrap-around handled)."""
        total = 0
        for (_, rng), a, b in zip(self.packages, prev, cur):
            d = b - a
            if d < 0:
                d += rng if rng else 0
            total += max(d, 0)
        return total / 1e6

    def interval(self, prev: Optional[tuple[list[int], float]], cur: Optional[tuple[list[int], float]],
                 run_cpu_s: float) -> Optional[float]:
        """The run's joules between two readings: package energy x the run's share of the host's
        busy CPU time (1 at most); None when either reading is missing."""
        if prev is None or cur is None:
            return None
        joules = self.package_joules(prev[0], cur[0])
        busy = cur[1] - prev[1]
        if busy <= 0:
            return 0.0
        return joules * min(1.0, max(0.0, run_cpu_s) / busy)
