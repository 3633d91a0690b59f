"""Resource quantities: parsing sizes, requests, capacities.

Sizes follow Kubernetes notation (``512Mi``, ``4Gi``, ``1G``, ``1500000``) so a
queue file reads the same whether the target is a process, Docker or Kubernetes.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from pydantic import BaseModel, Field

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?|[kmgtp]i?|B|b)?\s*$")
_UNITS = {
    None: 1, "B": 1, "b": 1,
    "K": 1000, "k": 1000, "M": 1000**2, "m": 1000**2, "G": 1000**3, "g": 1000**3,
    "T": 1000**4, "t": 1000**4, "P": 1000**5, "p": 1000**5,
    "Ki": 1024, "ki": 1024, "Mi": 1024**2, "mi": 1024**2, "Gi": 1024**3, "gi": 1024**3,
    "Ti": 1024**4, "ti": 1024**4, "Pi": 1024**5, "pi": 1024**5,
}


class LaunchValidationError(ValueError):
    """A request that can never be served as given; the message says what to change."""


def parse_size(value: str | int | float | None, what: str = "size") -> Optional[int]:
    """Parse ``4Gi``/``512Mi``/``1G``/bytes into bytes; ``None`` stays ``None``."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise LaunchValidationError(f"malformed {what} {value!r}: use e.g. 512Mi, 4Gi or a byte count")
    if isinstance(value, (int, float)):
        if value < 0:
            raise LaunchValidationError(f"{what} must not be negative, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise LaunchValidationError(
            f"malformed {what} {value!r}: use a number with an optional unit, e.g. 512Mi, 4Gi, 2G"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_size(n: Optional[int]) -> str:
    """Render bytes in the largest binary unit that keeps one decimal at most."""
    if n is None:
        return "-"
    for unit, factor in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n >= factor:
            v = n / factor
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f}{unit}"
    return f"{n}B"


class Resources(BaseModel):
    """A resolved amount of cpu, memory, gpu and shared memory (bytes)."""

    cpu: float = Field(0, ge=0)
    memory: int = Field(0, ge=0)
    gpu: int = Field(0, ge=0)
    shm_size: Optional[int] = Field(None, ge=0)

    def describe(self) -> str:
        parts = [f"cpu={self.cpu:g}", f"memory={format_size(self.memory)}", f"gpu={self.gpu}"]
        if self.shm_size:
            parts.append(f"shm_size={format_size(self.shm_size)}")
        return ",".join(parts)

    def shortfall(self, free: "Resources") -> list[tuple[str, str, str]]:
        """Resources that exceed ``free`` as (name, needed, available) strings."""
        out = []
        if self.cpu > free.cpu + 1e-9:
            out.append(("cpu", f"{self.cpu:g}", f"{free.cpu:g}"))
        if self.memory > free.memory:
            out.append(("memory", format_size(self.memory), format_size(free.memory)))
        if self.gpu > free.gpu:
            out.append(("gpu", str(self.gpu), str(free.gpu)))
        return out

    def fits(self, free: "Resources") -> bool:
        return not self.shortfall(free)

    def times(self, n: int) -> "Resources":
        """``n`` of this request at once (a cluster run's members)."""
        return Resources(cpu=round(self.cpu * n, 6), memory=self.memory * n, gpu=self.gpu * n,
                         shm_size=self.shm_size * n if self.shm_size else None)


def parse_capacity(text: str) -> dict[str, float | int]:
    """Parse ``cpu=8,memory=32Gi,gpu=2`` (any subset) into numbers."""
    out: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise LaunchValidationError(
                f"bad capacity item {part!r}: expected key=value, e.g. cpu=8,memory=32Gi,gpu=2"
            )
        key, val = (s.strip() for s in part.split("=", 1))
        if key == "cpu":
            try:
                out["cpu"] = float(val)
            except ValueError:
                raise LaunchValidationError(f"bad cpu capacity {val!r}: expected a number") from None
        elif key == "memory":
            out["memory"] = parse_size(val, "memory capacity") or 0
        elif key == "gpu":
            if not val.isdigit():
                raise LaunchValidationError(f"bad gpu capacity {val!r}: expected a whole number")
            out["gpu"] = int(val)
        else:
            raise LaunchValidationError(f"unknown capacity key {key!r}: use cpu, memory or gpu")
    return out


def detect_capacity(declared: str | None = None) -> Resources:
    """The agent's total capacity: declared values win, the rest is detected.

    CPUs and memory come from psutil, GPUs from NVML; a GPU-less machine can
    declare virtual GPUs (``gpu=2``) to act as a GPU box in tests and demos.
    """
    import psutil

    declared = declared if declared is not None else os.environ.get("LAUNCH_WORKER_CAPACITY", "")
    values = parse_capacity(declared) if declared else {}
    cpu = values.get("cpu")
    if cpu is None:
        cpu = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else psutil.cpu_count())
    memory = values.get("memory")
    if memory is None:
        memory = int(psutil.virtual_memory().total)
    gpu = values.get("gpu")
    if gpu is None:
        gpu = len(_detect_gpu_indices())
    return Resources(cpu=cpu, memory=int(memory), gpu=int(gpu))


def _detect_gpu_indices() -> list[int]:
    try:
        from prefect_launch.workers.metrics.nvml import detect_gpus  # written with the metrics sampler

        return [g.index for g in detect_gpus()]
    except Exception:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return list(range(pynvml.nvmlDeviceGetCount()))
            finally:
                pynvml.nvmlShutdown()
        except Exception:
            return []
