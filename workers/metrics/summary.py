"""Per-run summary and waste verdict from samples (pure: no I/O, no clock).

:class:`SummaryAccumulator` folds samples one at a time in O(1) memory (the
sampler uses it so a week-long session costs no more than a minute-long job);
:func:`summarize` is the list version. :func:`waste_reasons` decides whether a
finished run wasted what it was given.
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable, Optional

from pydantic import BaseModel

from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary

GiB = 1024**3


class WasteThresholds(BaseModel):
    """When a finished run counts as wasting its allocation."""

    min_duration_s: float = 60.0  # shorter runs are never flagged
    gpu_util_pct: float = 10.0  # GPU allocated, average utilisation below this
    gpu_mem_pct: float = 5.0  # GPU allocated, peak GPU memory below this % of the GPUs' memory
    cpu_share_pct: float = 10.0  # >= cpu_min_alloc CPUs allocated, average use below this % of them
    cpu_min_alloc: float = 2.0
    memory_used_pct: float = 25.0  # peak RSS below this % of the allocated memory ...
    memory_min_slack_bytes: int = 1 * GiB  # ... and at least this much left unused


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def waste_reasons(summary: RunSummary, thresholds: WasteThresholds | None = None) -> list[str]:
    """Reasons (``"code: explanation"``) the run wasted hardware; ``[]`` when it did not.

    Codes: ``gpu_idle``, ``gpu_memory_unused``, ``cpu_underused``, ``memory_overallocated``.
    A run shorter than ``min_duration_s`` (or of unknown duration) is never flagged;
    a resource without measurements is not judged.
    """
    t = thresholds or WasteThresholds()
    if summary.duration_s is None or summary.duration_s < t.min_duration_s:
        return []
    out: list[str] = []
    gpus = summary.allocated_gpus or 0
    if gpus > 0 and summary.avg_gpu_util_pct is not None and summary.avg_gpu_util_pct < t.gpu_util_pct:
        out.append(
            f"gpu_idle: {gpus} GPU allocated, average utilisation "
            f"{summary.avg_gpu_util_pct:.1f}% < {t.gpu_util_pct:g}%"
        )
    if (
        gpus > 0
        and summary.peak_gpu_mem_bytes is not None
        and summary.gpu_mem_total_bytes
        and 100.0 * summary.peak_gpu_mem_bytes / summary.gpu_mem_total_bytes < t.gpu_mem_pct
    ):
        pct = 100.0 * summary.peak_gpu_mem_bytes / summary.gpu_mem_total_bytes
        out.append(
            f"gpu_memory_unused: peak GPU memory {_fmt_bytes(summary.peak_gpu_mem_bytes)} "
            f"is {pct:.1f}% of {_fmt_bytes(summary.gpu_mem_total_bytes)} allocated (< {t.gpu_mem_pct:g}%)"
        )
    cpus = summary.allocated_cpus or 0
    if cpus >= t.cpu_min_alloc and summary.avg_cpu_pct is not None:
        share = summary.avg_cpu_pct / cpus
        if share < t.cpu_share_pct:
            out.append(
                f"cpu_underused: {cpus:g} CPUs allocated, average use {summary.avg_cpu_pct / 100:.2f} CPUs "
                f"({share:.1f}% < {t.cpu_share_pct:g}%)"
            )
    mem = summary.allocated_memory_bytes
    if mem and summary.peak_rss_bytes is not None:
        pct = 100.0 * summary.peak_rss_bytes / mem
        if pct < t.memory_used_pct and mem - summary.peak_rss_bytes >= t.memory_min_slack_bytes:
            out.append(
                f"memory_overallocated: peak {_fmt_bytes(summary.peak_rss_bytes)} of "
                f"{_fmt_bytes(mem)} allocated ({pct:.1f}% < {t.memory_used_pct:g}%)"
            )
    return out


def apply_waste(summary: RunSummary, thresholds: WasteThresholds | None = None) -> RunSummary:
    """Set ``wasteful`` and ``waste_reasons`` on the summary (returns it)."""
    summary.waste_reasons = waste_reasons(summary, thresholds)
    summary.wasteful = bool(summary.waste_reasons)
    return summary


class SummaryAccumulator:
    """Folds :class:`MetricSample` s into running totals; ``finish`` makes the :class:`RunSummary`."""

    def __init__(self) -> None:
        self.samples = 0
        self.first_ts: Optional[datetime] = None
        self.last_ts: Optional[datetime] = None
        self._cpu_s = 0.0  # CPU-seconds from samples with an interval
        self._cpu_wall = 0.0  # their wall seconds
        self._cpu_n = 0
        self._cpu_sum = 0.0  # plain sum, for samples without an interval
        self.max_cpu_pct: Optional[float] = None
        self._rss_sum = 0
        self._rss_n = 0
        self.peak_rss_bytes: Optional[int] = None
        self._gpu_sum = 0.0
        self._gpu_n = 0
        self.max_gpu_util_pct: Optional[float] = None
        self.peak_gpu_mem_bytes: Optional[int] = None
        self._gpu_util_s = 0.0  # sum of utilisation (0-1) x interval: GPU-seconds used per allocated GPU
        self._gpu_util_wall = 0.0
        self.gpu_energy_j: Optional[float] = None  # sums of the samples' energy; None: never measured
        self.cpu_energy_j: Optional[float] = None
        self._io: dict[str, Optional[int]] = dict.fromkeys(
            ("read_bytes", "write_bytes", "net_rx_bytes", "net_tx_bytes")
        )

    def note_peak_memory(self, peak: Optional[int]) -> None:
        """A peak known between samples (the kernel's maximum charge of the run's memory group)."""
        if peak is not None and (self.peak_rss_bytes is None or peak > self.peak_rss_bytes):
            self.peak_rss_bytes = peak

    def add(self, s: MetricSample) -> None:
        self.samples += 1
        if self.first_ts is None or s.ts < self.first_ts:
            self.first_ts = s.ts
        if self.last_ts is None or s.ts > self.last_ts:
            self.last_ts = s.ts
        if s.cpu_pct is not None:
            self._cpu_n += 1
            self._cpu_sum += s.cpu_pct
            if s.interval_s:
                self._cpu_s += s.cpu_pct / 100.0 * s.interval_s
                self._cpu_wall += s.interval_s
            self.max_cpu_pct = s.cpu_pct if self.max_cpu_pct is None else max(self.max_cpu_pct, s.cpu_pct)
        if s.rss_bytes is not None:
            self._rss_sum += s.rss_bytes
            self._rss_n += 1
            self.peak_rss_bytes = s.rss_bytes if self.peak_rss_bytes is None else max(self.peak_rss_bytes, s.rss_bytes)
        if s.gpu_util_pct is not None:
            self._gpu_sum += s.gpu_util_pct
            self._gpu_n += 1
            if s.interval_s:
                self._gpu_util_s += s.gpu_util_pct / 100.0 * s.interval_s
                self._gpu_util_wall += s.interval_s
            self.max_gpu_util_pct = (
                s.gpu_util_pct if self.max_gpu_util_pct is None else max(self.max_gpu_util_pct, s.gpu_util_pct)
            )
        if s.gpu_mem_bytes is not None:
            self.peak_gpu_mem_bytes = (
                s.gpu_mem_bytes if self.peak_gpu_mem_bytes is None else max(self.peak_gpu_mem_bytes, s.gpu_mem_bytes)
            )
        if s.gpu_energy_j is not None:
            self.gpu_energy_j = (self.gpu_energy_j or 0.0) + s.gpu_energy_j
        if s.cpu_energy_j is not None:
            self.cpu_energy_j = (self.cpu_energy_j or 0.0) + s.cpu_energy_j
        for k in self._io:
            v = getattr(s, k)
            if v is not None:
                self._io[k] = (self._io[k] or 0) + v

    @property
    def cpu_seconds(self) -> Optional[float]:
        return self._cpu_s if self._cpu_wall > 0 else None

    @property
    def avg_cpu_pct(self) -> Optional[float]:
        """Time-weighted when samples carry intervals, else the plain mean."""
        if self._cpu_wall > 0:
            return 100.0 * self._cpu_s / self._cpu_wall
        if self._cpu_n:
            return self._cpu_sum / self._cpu_n
        return None

    def finish(
        self,
        record: RunRecord,
        exit_state: Optional[str],
        ended_at: Optional[datetime] = None,
        lost_samples: int = 0,
        gpu_mem_total_bytes: Optional[int] = None,
        thresholds: WasteThresholds | None = None,
    ) -> RunSummary:
        started = record.started_at or self.first_ts
        ended = ended_at or record.ended_at or self.last_ts
        duration = (ended - started).total_seconds() if started and ended else None
        queue_s = (
            (record.started_at - record.submitted_at).total_seconds()
            if record.started_at and record.submitted_at
            else None
        )
        gpus = record.gpu if record.gpu is not None else (len(record.gpu_indices) if record.gpu_indices else None)
        avg_cpu = self.avg_cpu_pct
        summary = RunSummary(
            flow_run_id=record.flow_run_id,
            started_at=started,
            ended_at=ended,
            duration_s=duration,
            queue_s=queue_s,
            cpu_seconds=self.cpu_seconds,
            avg_cpu_pct=avg_cpu,
            max_cpu_pct=self.max_cpu_pct,
            avg_cpu_share_pct=(avg_cpu / record.cpu if avg_cpu is not None and record.cpu else None),
            avg_rss_bytes=(self._rss_sum // self._rss_n if self._rss_n else None),
            peak_rss_bytes=self.peak_rss_bytes,
            avg_gpu_util_pct=(self._gpu_sum / self._gpu_n if self._gpu_n else None),
            max_gpu_util_pct=self.max_gpu_util_pct,
            peak_gpu_mem_bytes=self.peak_gpu_mem_bytes,
            gpu_mem_total_bytes=gpu_mem_total_bytes,
            allocated_cpus=record.cpu,
            allocated_memory_bytes=record.memory_bytes,
            allocated_gpus=gpus,
            gpu_used_s=(self._gpu_util_s * gpus if gpus and self._gpu_util_wall > 0 else None),
            gpu_energy_j=self.gpu_energy_j,
            cpu_energy_j=self.cpu_energy_j,
            samples=self.samples,
            lost_samples=lost_samples,
            exit_state=exit_state,
            **self._io,
        )
        return apply_waste(summary, thresholds)


def summarize(
    record: RunRecord,
    samples: Iterable[MetricSample],
    exit_state: Optional[str],
    ended_at: Optional[datetime] = None,
    lost_samples: int = 0,
    gpu_mem_total_bytes: Optional[int] = None,
    thresholds: WasteThresholds | None = None,
) -> RunSummary:
    """The :class:`RunSummary` of a run from its record and samples (any order)."""
    acc = SummaryAccumulator()
    for s in samples:
        acc.add(s)
    return acc.finish(record, exit_state, ended_at, lost_samples, gpu_mem_total_bytes, thresholds)
