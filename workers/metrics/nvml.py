"""NVML access (nvidia-ml-py / ``pynvml``) for GPU detection and sampling, and a fake for tests.

Everything here degrades to "no GPUs": when the library or the driver is missing,
:func:`detect_gpus` returns ``[]`` and :class:`Nvml` reports ``available=False``;
nothing raises for the absence of NVML.

Indices are NVML's (physical) indices, in PCI bus order: the same ones the worker puts into
``CUDA_VISIBLE_DEVICES``, always with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA's own default is
fastest first); a container's device request names them by UUID (:func:`gpu_uuids`).

Tests inject :class:`FakeNVML`, which implements exactly the handful of
``pynvml`` functions used here: directly, or in processes a test starts (an agent)
through ``LAUNCH_FAKE_NVML``, a JSON spec of the fake's devices (see
:meth:`FakeNVML.from_spec`) that the shared instance is then built on.

Energy: :meth:`Nvml.energy_mj` reads ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the
driver loaded, Volta and newer); :meth:`Nvml.power_mw` reads ``nvmlDeviceGetPowerUsage`` for
devices without the counter. Both return None where NVML cannot tell.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

log = logging.getLogger("prefect_launch.nvml")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_bytes: int
    uuid: Optional[str] = None


@dataclass
class GpuUsage:
    """Use of the allocated GPUs by one run at one instant."""

    util_pct: Optional[float]  # mean over the GPUs, 0-100
    mem_bytes: Optional[int]  # summed over the GPUs
    source: str  # "process" (NVML per-process data) or "device" (whole device)
    per_gpu: dict[int, tuple[Optional[float], Optional[int]]] = field(default_factory=dict)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """A session on an NVML module (``pynvml`` by default, or a fake).

    Thread-safe; ``nvmlInit`` is called once on construction. Use
    :func:`get_nvml` for a shared, process-wide instance.
    """

    def __init__(self, module: Any = None) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        self._last_proc_ts: dict[int, int] = {}
        self._proc_util_unsupported: set[int] = set()
        self.error: Optional[str] = None
        self.available = False
        if module is None:
            try:
                import pynvml as module  # nvidia-ml-py
            except Exception as exc:  # pragma: no cover - nvidia-ml-py is a dependency
                self.error = f"pynvml not importable: {exc}"
                self.nv = None
                return
        self.nv = module
        try:
            module.nvmlInit()
            self.available = True
        except Exception as exc:
            self.error = f"NVML unavailable: {exc}"
            log.debug(self.error)

    # -------------------------------------------------------------- devices

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._handles[index] = self.nv.nvmlDeviceGetHandleByIndex(index)
        return h

    def device_count(self) -> int:
        if not self.available:
            return 0
        try:
            return int(self.nv.nvmlDeviceGetCount())
        except Exception as exc:
            log.warning("nvmlDeviceGetCount failed: %s", exc)
            return 0

    def detect_gpus(self) -> list[GpuInfo]:
        out: list[GpuInfo] = []
        for i in range(self.device_count()):
            try:
                h = self._handle(i)
                name = _s(self.nv.nvmlDeviceGetName(h))
                mem = int(self.nv.nvmlDeviceGetMemoryInfo(h).total)
                try:
                    uuid = _s(self.nv.nvmlDeviceGetUUID(h))
                except Exception:
                    uuid = None
                out.append(GpuInfo(index=i, name=name, memory_total_bytes=mem, uuid=uuid))
            except Exception as exc:
                log.warning("NVML: cannot read GPU %s: %s", i, exc)
        return out

    def memory_total(self, indices: Iterable[int]) -> Optional[int]:
        if not self.available:
            return None
        total = 0
        try:
            for i in indices:
                total += int(self.nv.nvmlDeviceGetMemoryInfo(self._handle(i)).total)
        except Exception:
            return None
        return total

    # ------------------------------------------------------------- sampling

    def _device_usage(self, h: Any) -> tuple[Optional[float], Optional[int]]:
        util = mem = None
        try:
            util = float(self.nv.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:
            pass
        try:
            mem = int(self.nv.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            pass
        return util, mem

    def _process_usage(self, index: int, h: Any, pids: set[int]) -> tuple[Optional[float], Optional[int], bool]:
        """(util, mem, matched): per-process figures for ``pids`` on one device."""
        matched = False
        mem: Optional[int] = None
        try:
            procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h) or []
        except Exception:
            procs = []
        for p in procs:
            if int(p.pid) in pids:
                matched = True
                used = getattr(p, "usedGpuMemory", None)
                if used is not None and used >= 0 and used < (1 << 62):  # NVML_VALUE_NOT_AVAILABLE is huge
                    mem = (mem or 0) + int(used)
        util: Optional[float] = None
        if matched and index not in self._proc_util_unsupported:
            last = self._last_proc_ts.get(index, 0)
            try:
                recs = self.nv.nvmlDeviceGetProcessUtilization(h, last) or []
                per_ts: dict[int, float] = {}
                newest = last
                for r in recs:
                    ts = int(r.timeStamp)
                    newest = max(newest, ts)
                    if int(r.pid) in pids:
                        per_ts[ts] = per_ts.get(ts, 0.0) + float(r.smUtil)
                self._last_proc_ts[index] = newest
                # Instants at which only others ran count as 0 for us.
                all_ts = {int(r.timeStamp) for r in recs}
                if all_ts:
                    util = min(100.0, sum(per_ts.values()) / len(all_ts))
            except Exception as exc:
                name = type(exc).__name__
                if "NotSupported" in name or "NOT_SUPPORTED" in str(exc).upper():
                    self._proc_util_unsupported.add(index)
                # NVML_ERROR_NOT_FOUND: no samples since `last` -> fall back to device util.
        return util, mem, matched

    def usage(self, indices: Iterable[int], pids: Iterable[int] = ()) -> Optional[GpuUsage]:
        """Utilisation and memory of the GPUs ``indices`` as used by ``pids``.

        Per process where NVML lists our pids (memory from the compute-process list,
        utilisation from process-utilisation samples when supported); otherwise the
        whole device, which on disjointly pinned GPUs is the run's own use.
        Returns None when NVML is unavailable or ``indices`` is empty.
        """
        indices = list(indices)
        if not self.available or not indices:
            return None
        pidset = set(int(p) for p in pids)
        per_gpu: dict[int, tuple[Optional[float], Optional[int]]] = {}
        any_process = False
        with self._lock:
            for i in indices:
                try:
                    h = self._handle(i)
                except Exception as exc:
                    log.debug("NVML handle %s: %s", i, exc)
                    continue
                util = mem = None
                matched = False
                if pidset:
                    util, mem, matched = self._process_usage(i, h, pidset)
                if matched:
                    any_process = True
                dev_util, dev_mem = self._device_usage(h)
                if util is None:
                    util = dev_util
                if mem is None:
                    mem = dev_mem
                per_gpu[i] = (util, mem)
        if not per_gpu:
            return None
        utils = [u for u, _ in per_gpu.values() if u is not None]
        mems = [m for _, m in per_gpu.values() if m is not None]
        return GpuUsage(
            util_pct=(sum(utils) / len(utils) if utils else None),
            mem_bytes=(sum(mems) if mems else None),
            source="process" if any_process else "device",
            per_gpu=per_gpu,
        )

    # --------------------------------------------------------------- energy

    def energy_mj(self, indices: Iterable[int]) -> Optional[int]:
        """The GPUs' energy counters summed (mJ since the driver loaded); None when NVML has
        no counter for one of them (pre-Volta, some virtual GPUs) or cannot be read."""
        indices = list(indices)
        if not self.available or not indices:
            return None
        total = 0
        with self._lock:
            try:
                for i in indices:
                    total += int(self.nv.nvmlDeviceGetTotalEnergyConsumption(self._handle(i)))
            except Exception:
                return None
        return total

    def power_mw(self, indices: Iterable[int]) -> Optional[float]:
        """The GPUs' power draw now, summed (mW); None when one of them cannot report it."""
        indices = list(indices)
        if not self.available or not indices:
            return None
        total = 0.0
        with self._lock:
            try:
                for i in indices:
                    total += float(self.nv.nvmlDeviceGetPowerUsage(self._handle(i)))
            except Exception:
                return None
        return total

    def shutdown(self) -> None:
        if self.available:
            try:
                self.nv.nvmlShutdown()
            except Exception:
                pass
            self.available = False


_SHARED: Optional[Nvml] = None
_SHARED_LOCK = threading.Lock()


def get_nvml(module: Any = None) -> Nvml:
    """A shared :class:`Nvml` (``module`` given: a fresh one on that module)."""
    global _SHARED
    if module is not None:
        return module if isinstance(module, Nvml) else Nvml(module)
    with _SHARED_LOCK:
        if _SHARED is None:
            spec = os.environ.get("LAUNCH_FAKE_NVML")
            _SHARED = Nvml(FakeNVML.from_spec(json.loads(spec))) if spec else Nvml()
        return _SHARED


def detect_gpus(nvml: Any = None) -> list[GpuInfo]:
    """GPUs visible to NVML (index, name, total memory, uuid); ``[]`` without NVML."""
    return get_nvml(nvml).detect_gpus()


def gpu_uuids(nvml: Any = None) -> dict[int, str]:
    """NVML index -> UUID of this host's GPUs (those whose UUID NVML reads); ``{}`` without NVML."""
    return {g.index: g.uuid for g in detect_gpus(nvml) if g.uuid}


# ---------------------------------------------------------------------- fake


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The few ``pynvml`` calls :class:`Nvml` makes, over scripted devices.

    ``FakeNVML(gpus=[{"name": "Fake A100", "memory_total": 40<<30}], available=True)``;
    set ``util[i]``, ``mem_used[i]`` and ``processes[i] = [(pid, used_bytes, sm_util)]``
    to script what the device reports. ``process_util_supported=False`` makes
    nvmlDeviceGetProcessUtilization raise NotSupported as consumer GPUs do.

    Energy: ``power_w[i]`` is device i's draw; its energy counter
    (``nvmlDeviceGetTotalEnergyConsumption``, mJ) advances by that power over the time
    that really passes (the monotonic clock), as a device's does. ``energy_supported=False``
    makes the counter raise NotSupported (pre-Volta), ``power_supported=False`` the power
    reading too.
    """

    class _Mem:
        def __init__(self, total: int, used: int) -> None:
            self.total, self.used, self.free = total, used, total - used

    class _Util:
        def __init__(self, gpu: float, memory: float = 0) -> None:
            self.gpu, self.memory = gpu, memory

    class _Proc:
        def __init__(self, pid: int, used: int) -> None:
            self.pid, self.usedGpuMemory = pid, used

    class _PUtil:
        def __init__(self, pid: int, ts: int, sm: float) -> None:
            self.pid, self.timeStamp, self.smUtil, self.memUtil = pid, ts, sm, 0

    class NVMLError_NotSupported(FakeNVMLError):
        pass

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[dict] | None = None, available: bool = True, process_util_supported: bool = True,
                 energy_supported: bool = True, power_supported: bool = True):
        self.gpus = gpus or []
        self.available = available
        self.process_util_supported = process_util_supported
        self.energy_supported = energy_supported
        self.power_supported = power_supported
        self.power_w: dict[int, float] = {}
        self._energy_mj: dict[int, float] = {}
        self._energy_t: dict[int, float] = {}
        self.util: dict[int, float] = {}
        self.mem_used: dict[int, int] = {}
        self.processes: dict[int, list[tuple[int, int, float]]] = {}
        self.calls: list[str] = []
        self._ts = 1_000_000

    @classmethod
    def from_spec(cls, spec: dict) -> "FakeNVML":
        """``{"gpus": [...], "util": {"0": 80}, "mem_used": {...}, "power_w": {"0": 300},
        "energy_supported": true, ...}`` (the ``LAUNCH_FAKE_NVML`` environment variable)."""
        fake = cls(gpus=spec.get("gpus"), available=spec.get("available", True),
                   process_util_supported=spec.get("process_util_supported", True),
                   energy_supported=spec.get("energy_supported", True), power_supported=spec.get("power_supported", True))
        fake.util = {int(k): float(v) for k, v in (spec.get("util") or {}).items()}
        fake.mem_used = {int(k): int(v) for k, v in (spec.get("mem_used") or {}).items()}
        fake.power_w = {int(k): float(v) for k, v in (spec.get("power_w") or {}).items()}
        return fake

    def _advance_energy(self, h: int) -> float:
        now = time.monotonic()
        last = self._energy_t.get(h)
        e = self._energy_mj.get(h, 1.0e9 + 1.0e6 * h)  # counters start from the driver's load, not 0
        if last is not None:
            e += self.power_w.get(h, 0.0) * (now - last) * 1000.0
        self._energy_mj[h], self._energy_t[h] = e, now
        return e

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        self.calls.append(f"energy:{h}")
        if not self.energy_supported:
            raise self.NVMLError_NotSupported("Not Supported")
        return int(self._advance_energy(h))

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if not self.power_supported:
            raise self.NVMLError_NotSupported("Not Supported")
        return int(self.power_w.get(h, 0.0) * 1000)

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if not self.available:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < len(self.gpus):
            raise FakeNVMLError(f"Invalid Argument: index {i}")
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.gpus[h].get("name", "Fake GPU").encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h].get("uuid", f"GPU-fake-{h}")

    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> "FakeNVML._Mem":
        return self._Mem(self.gpus[h].get("memory_total", 16 << 30), self.mem_used.get(h, 0))

    def nvmlDeviceGetUtilizationRates(self, h: int) -> "FakeNVML._Util":
        return self._Util(self.util.get(h, 0.0))

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list:
        return [self._Proc(pid, used) for pid, used, _ in self.processes.get(h, [])]

    def nvmlDeviceGetProcessUtilization(self, h: int, last_ts: int) -> list:
        self.calls.append(f"procutil:{h}:{last_ts}")
        if not self.process_util_supported:
            raise self.NVMLError_NotSupported("Not Supported")
        self._ts += 1000
        return [self._PUtil(pid, self._ts, sm) for pid, _, sm in self.processes.get(h, [])]
