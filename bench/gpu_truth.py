"""The ground truth `bench/gpu_check.py` holds the agent to: NVML read directly, and the comparisons.

Nothing of prefect-launch is imported here. :class:`NvmlTruthSampler` is a thread that reads every
device through ``pynvml`` itself (or a module with the same calls) every ``interval_s``:
utilisation, memory used, the memory of the compute processes NVML lists, power, and the total
energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded). The rest are
pure functions over those samples and over the agent's figures, so they are unit-tested with
synthetic samples (tests/test_gpu_truth.py):

* :func:`run_truth`: a run's figures over its own interval (the Prefect run's start and end
  times): mean and maximum utilisation, peak memory, energy from the counter's delta (interpolated
  at both ends), and which device was busy;
* :func:`compare_run`: the agent's summary against that truth, within :data:`TOLERANCES`;
* :func:`overlapping`, :func:`gpu_hours`, :func:`check_gpu_hours`, :func:`refusal`: two 1-GPU runs on
  a 1-GPU agent never overlap, the report's GPU-hours match the runs, a 2-GPU request is refused
  with its reason.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

# what "matches" means, per figure (issue 38 section 3)
TOLERANCES = {
    "avg_util_pct": ("abs", 10.0),  # ± 10 utilisation points
    "max_util_pct": ("abs", 10.0),
    "peak_mem_bytes": ("rel", 0.05),  # ± 5 %
    "energy_j": ("rel", 0.10),  # ± 10 %
}
GPU_HOURS_REL = 0.10  # the report's GPU-hours against the runs' own intervals
GPU_HOURS_SLACK_S = 5.0  # per run: the agent holds a GPU from its process's start to its end, a little wider


@dataclass(frozen=True)
class Sample:
    """One device at one instant, as NVML reported it (None: NVML could not tell)."""

    t: float  # unix time
    index: int  # NVML index
    util_pct: Optional[float]
    mem_used: Optional[int]  # bytes, whole device
    proc_mem: Optional[int]  # bytes, summed over the compute processes NVML lists (None: it lists none)
    power_mw: Optional[float]
    energy_mj: Optional[float]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlTruthSampler:
    """Reads every GPU through NVML directly on a thread of its own, every ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 0.25, nv: Any = None):
        if nv is None:
            import pynvml as nv  # nvidia-ml-py
        self.nv = nv
        nv.nvmlInit()
        self.interval_s = interval_s
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(int(nv.nvmlDeviceGetCount()))]
        self.devices = [{"index": i, "name": _s(nv.nvmlDeviceGetName(h)), "uuid": _s(nv.nvmlDeviceGetUUID(h)),
                         "memory_total": int(nv.nvmlDeviceGetMemoryInfo(h).total)} for i, h in enumerate(self.handles)]
        self.samples: list[Sample] = []
        self.errors: dict[str, str] = {}  # what NVML could not read, once per kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nvml-truth", daemon=True)

    def _read(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.errors.setdefault(what, f"{type(exc).__name__}: {exc}")
            return None

    def read_once(self) -> list[Sample]:
        t = time.time()
        out = []
        nv = self.nv
        for i, h in enumerate(self.handles):
            util = self._read("utilisation", nv.nvmlDeviceGetUtilizationRates, h)
            mem = self._read("memory", nv.nvmlDeviceGetMemoryInfo, h)
            procs = self._read("processes", nv.nvmlDeviceGetComputeRunningProcesses, h) or []
            used = [int(p.usedGpuMemory) for p in procs
                    if getattr(p, "usedGpuMemory", None) is not None and 0 <= int(p.usedGpuMemory) < (1 << 62)]
            power = self._read("power", nv.nvmlDeviceGetPowerUsage, h)
            energy = self._read("energy", nv.nvmlDeviceGetTotalEnergyConsumption, h)
            out.append(Sample(t=t, index=i, util_pct=float(util.gpu) if util is not None else None,
                              mem_used=int(mem.used) if mem is not None else None,
                              proc_mem=sum(used) if used else None,
                              power_mw=float(power) if power is not None else None,
                              energy_mj=float(energy) if energy is not None else None))
        return out

    def _loop(self) -> None:
        while True:
            self.samples.extend(self.read_once())
            if self._stop.wait(self.interval_s):
                break

    def start(self) -> "NvmlTruthSampler":
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(timeout=10)
        self.samples.extend(self.read_once())  # one reading after the last run's end
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass
        return self.samples


# ----------------------------------------------------------------------------- pure


def _rounds(samples: Iterable[Sample], indices: Sequence[int], t0: float, t1: float) -> list[list[Sample]]:
    """The sampler's readings of ``indices`` within [t0, t1], one list per instant, in time order."""
    by_t: dict[float, list[Sample]] = {}
    for s in samples:
        if s.index in indices and t0 <= s.t <= t1:
            by_t.setdefault(s.t, []).append(s)
    return [by_t[t] for t in sorted(by_t)]


def counter_at(points: Sequence[tuple[float, float]], t: float) -> Optional[float]:
    """A monotonic counter's value at ``t``, linear between the two readings around it; None outside them."""
    pts = sorted(points)
    for (ta, ea), (tb, eb) in zip(pts, pts[1:]):
        if ta <= t <= tb:
            return ea if tb == ta else ea + (eb - ea) * (t - ta) / (tb - ta)
    if pts and pts[-1][0] == t:
        return pts[-1][1]
    return None


def idle_memory(samples: Iterable[Sample], before: float) -> dict[int, int]:
    """Each device's memory used before ``before`` (the idle baseline: the least reading)."""
    out: dict[int, int] = {}
    for s in samples:
        if s.t < before and s.mem_used is not None:
            out[s.index] = min(out.get(s.index, s.mem_used), s.mem_used)
    return out


def run_truth(samples: Sequence[Sample], indices: Sequence[int], t0: float, t1: float,
              idle_mem: Optional[dict[int, int]] = None) -> dict[str, Any]:
    """What NVML itself says of the GPUs ``indices`` over [t0, t1] (a run's own interval).

    Utilisation: mean over the GPUs at each instant, then mean and maximum over the instants.
    Peak memory: the largest sum over the GPUs at one instant of the compute processes' memory where NVML
    lists processes (what a per-process reader sees), else of the devices' memory used; also the
    devices' peak above their idle baseline. Energy: each counter interpolated at t0 and t1, the
    deltas summed (None where a GPU has no counter); also power integrated (trapezoids) as a check.
    ``busy_index``: of every device sampled, the one with the highest mean utilisation over [t0, t1]."""
    rounds = _rounds(samples, indices, t0, t1)
    utils = []
    mem_dev, mem_proc = [], []
    for r in rounds:
        u = [s.util_pct for s in r if s.util_pct is not None]
        if u:
            utils.append(sum(u) / len(u))
        m = [s.mem_used for s in r if s.mem_used is not None]
        if m:
            mem_dev.append(sum(m))
        p = [s.proc_mem for s in r if s.proc_mem is not None]
        if p:
            mem_proc.append(sum(p))
    energy: Optional[float] = 0.0
    for i in indices:
        pts = [(s.t, s.energy_mj) for s in samples if s.index == i and s.energy_mj is not None]
        a, b = counter_at(pts, t0), counter_at(pts, t1)
        if a is None or b is None or energy is None:
            energy = None
        else:
            energy += (b - a) / 1000.0
    power_j: Optional[float] = 0.0
    for i in indices:
        pts = sorted((s.t, s.power_mw) for s in samples if s.index == i and s.power_mw is not None and t0 <= s.t <= t1)
        if len(pts) < 2 or power_j is None:
            power_j = None
        else:
            power_j += sum((tb - ta) * (pa + pb) / 2 for (ta, pa), (tb, pb) in zip(pts, pts[1:])) / 1000.0
    means: dict[int, list[float]] = {}
    for s in samples:
        if t0 <= s.t <= t1 and s.util_pct is not None:
            means.setdefault(s.index, []).append(s.util_pct)
    busy = max(means, key=lambda i: sum(means[i]) / len(means[i])) if means else None
    idle = sum((idle_mem or {}).get(i, 0) for i in indices)
    peak_dev = max(mem_dev) if mem_dev else None
    return {
        "samples": len(rounds),
        "avg_util_pct": sum(utils) / len(utils) if utils else None,
        "max_util_pct": max(utils) if utils else None,
        "peak_mem_bytes": max(mem_proc) if mem_proc else peak_dev,
        "peak_mem_source": "process" if mem_proc else ("device" if mem_dev else None),
        "peak_device_mem_bytes": peak_dev,
        "peak_device_mem_above_idle_bytes": (peak_dev - idle) if peak_dev is not None and idle_mem else None,
        "energy_j": energy,
        "power_integrated_j": power_j,
        "busy_index": busy,
    }


def within(agent: Optional[float], truth: Optional[float], kind: str, tol: float) -> bool:
    if agent is None or truth is None:
        return False
    if kind == "abs":
        return abs(agent - truth) <= tol
    return abs(agent - truth) <= tol * abs(truth)


AGENT_FIELDS = {"avg_util_pct": "avg_gpu_util_pct", "max_util_pct": "max_gpu_util_pct",
                "peak_mem_bytes": "peak_gpu_mem_bytes", "energy_j": "gpu_energy_j"}


def compare_run(agent_summary: dict[str, Any], agent_indices: Sequence[int], truth: dict[str, Any],
                tolerances: dict[str, tuple[str, float]] = TOLERANCES) -> list[dict[str, Any]]:
    """One check per figure: the agent's (``runs show --json``'s summary) against NVML's, and the pinning
    (the device NVML saw busy is the one the agent gave the run). A figure NVML cannot give (no energy
    counter) is ``ok: None``, skipped and said so, never passed."""
    checks = []
    for key, (kind, tol) in tolerances.items():
        a, t = agent_summary.get(AGENT_FIELDS[key]), truth.get(key)
        ok: Optional[bool] = within(a, t, kind, tol)
        note = None
        if t is None:
            ok, note = None, "NVML gives no figure for it on this device"
        elif a is None:
            note = "the agent recorded nothing"
        checks.append({"what": key, "agent": a, "truth": t, "tolerance": f"±{tol:g} points" if kind == "abs" else
                       f"±{tol:.0%}", "ok": ok, **({"note": note} if note else {})})
    busy = truth.get("busy_index")
    checks.append({"what": "pinned_gpu", "agent": list(agent_indices), "truth": busy,
                   "ok": busy is not None and list(agent_indices) == [busy], "tolerance": "exact"})
    return checks


def overlapping(intervals: dict[str, tuple[float, float]]) -> list[tuple[str, str]]:
    """Pairs of runs whose [start, end] intervals overlap (touching ends do not)."""
    keys = sorted(intervals, key=lambda k: intervals[k][0])
    out = []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if intervals[b][0] < intervals[a][1] and intervals[a][0] < intervals[b][1]:
                out.append((a, b))
    return out


def gpu_hours(runs: Iterable[tuple[int, float, float]]) -> float:
    """GPU-hours held by runs given as (GPUs, start, end)."""
    return sum(g * max(0.0, t1 - t0) for g, t0, t1 in runs) / 3600.0


def check_gpu_hours(reported_h: Optional[float], expected_h: float, runs: int) -> dict[str, Any]:
    """The report's GPU-hours against the runs' own: within 10 %, or a few seconds per run (the agent holds
    a GPU from its process's start to its end, a little wider than the run's Running..final states)."""
    slack = max(GPU_HOURS_REL * expected_h, runs * GPU_HOURS_SLACK_S / 3600.0)
    ok = reported_h is not None and abs(reported_h - expected_h) <= slack
    return {"what": "report_gpu_hours", "agent": reported_h, "truth": expected_h, "ok": ok,
            "tolerance": f"±{GPU_HOURS_REL:.0%} or {GPU_HOURS_SLACK_S:g} s per run"}


REFUSAL_CODES = ("exceeds-agent-capacity", "insufficient-resources")


def refusal(history: Sequence[dict[str, Any]], ever_started: bool, gpus: int = 2,
            submit_error: Optional[str] = None) -> dict[str, Any]:
    """A request for ``gpus`` GPUs on an agent with fewer: refused with a reason that names the GPUs, and
    never started. Refused either at submission (``submit_error``: the CLI knows the online agents'
    capacity) or by the agent (a scheduling-history record with a capacity error code)."""
    if submit_error is not None:
        return {"what": "refused_2_gpu_request", "agent": submit_error, "truth": "refused, never started",
                "ok": f"gpu={gpus}" in submit_error, "where": "submit"}
    recs = [r for r in history if r.get("error_code") in REFUSAL_CODES and f"gpu={gpus}" in (r.get("message") or "")]
    reason = recs[0].get("message") if recs else None
    return {"what": "refused_2_gpu_request", "agent": reason, "truth": "refused, never started",
            "ok": bool(recs) and not ever_started, "error_code": recs[0].get("error_code") if recs else None,
            "where": "agent"}


def verdict(checks: Sequence[dict[str, Any]]) -> bool:
    """Every check passed (one NVML cannot make, ``ok: None``, neither passes nor fails)."""
    return all(c["ok"] is not False for c in checks) and any(c["ok"] for c in checks)


def samples_json(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in samples]
