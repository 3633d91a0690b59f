"""The run-metrics store's records: what goes in and comes out, as pydantic models.

:class:`RunRecord` (one launched run), :class:`MetricSample` (one tick of its process tree) and
:class:`RunSummary` (its end-of-run figures). The SQL tables they are stored in are
:mod:`prefect_launch.blocks.metrics_schema`; the reads and writes are
:mod:`prefect_launch.blocks.metrics_repository`. Times are timezone-aware UTC ``datetime``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Optional
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["RunRecord", "MetricSample", "RunSummary", "id_str"]


def id_str(v: Any) -> Any:
    """A Prefect flow run id as the store keeps it: text (a UUID becomes its string, anything else passes)."""
    return str(v) if isinstance(v, UUID) else v


class RunRecord(BaseModel):
    """One launched run: identity, grouping keys and allocated resources."""

    model_config = ConfigDict(extra="ignore")

    flow_run_id: str
    flow_run_name: Optional[str] = None
    queue: Optional[str] = None  # launch queue = work pool name
    work_queue: Optional[str] = None  # priority (work queue) name
    job: Optional[str] = None  # deployment name
    deployment_id: Optional[str] = None
    flow: Optional[str] = None
    owner: Optional[str] = None
    project: Optional[str] = None
    preset: Optional[str] = None
    cpu: Optional[float] = None  # allocated CPUs
    memory_bytes: Optional[int] = None  # allocated memory
    gpu: Optional[int] = None  # allocated GPU count (defaults to len(gpu_indices))
    gpu_indices: list[int] = Field(default_factory=list)
    agent: Optional[str] = None  # worker name
    host: Optional[str] = None
    submitted_at: Optional[datetime] = None
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    state: Optional[str] = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("flow_run_id", "deployment_id", mode="before")
    @classmethod
    def _uuid_to_str(cls, v: Any) -> Any:
        return id_str(v)


class MetricSample(BaseModel):
    """One tick of one run's process tree. Counters are per interval, not cumulative."""

    model_config = ConfigDict(extra="ignore")

    flow_run_id: str
    ts: datetime
    interval_s: Optional[float] = None
    cpu_pct: Optional[float] = None  # 100 = one core
    cpu_share_pct: Optional[float] = None  # 100 = all allocated CPUs busy
    rss_bytes: Optional[int] = None  # sum of RSS over the tree
    read_bytes: Optional[int] = None  # disk bytes read during the interval
    write_bytes: Optional[int] = None
    net_rx_bytes: Optional[int] = None  # only when the run has its own network namespace
    net_tx_bytes: Optional[int] = None
    gpu_util_pct: Optional[float] = None  # mean over allocated GPUs, 0-100
    gpu_mem_bytes: Optional[int] = None  # sum over allocated GPUs
    num_procs: Optional[int] = None
    gpu_energy_j: Optional[float] = None  # energy of the allocated GPUs over the interval (NVML); None: not measured
    cpu_energy_j: Optional[float] = None  # the run's share of the CPU packages' energy (RAPL); None: not measured

    @field_validator("flow_run_id", mode="before")
    @classmethod
    def _uuid_to_str(cls, v: Any) -> Any:
        return id_str(v)


class RunSummary(BaseModel):
    """End-of-run figures, allocated vs used, and the waste verdict."""

    model_config = ConfigDict(extra="ignore")

    flow_run_id: Optional[str] = None
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    duration_s: Optional[float] = None
    queue_s: Optional[float] = None
    cpu_seconds: Optional[float] = None
    avg_cpu_pct: Optional[float] = None
    max_cpu_pct: Optional[float] = None
    avg_cpu_share_pct: Optional[float] = None
    avg_rss_bytes: Optional[int] = None
    peak_rss_bytes: Optional[int] = None
    avg_gpu_util_pct: Optional[float] = None
    max_gpu_util_pct: Optional[float] = None
    peak_gpu_mem_bytes: Optional[int] = None
    gpu_mem_total_bytes: Optional[int] = None  # total memory of the allocated GPUs
    allocated_cpus: Optional[float] = None
    allocated_memory_bytes: Optional[int] = None
    allocated_gpus: Optional[int] = None
    read_bytes: Optional[int] = None
    write_bytes: Optional[int] = None
    net_rx_bytes: Optional[int] = None
    net_tx_bytes: Optional[int] = None
    gpu_used_s: Optional[float] = None  # GPU-seconds used: sum of utilisation x interval x allocated GPUs
    gpu_energy_j: Optional[float] = None  # None: not measured (see the record's extra "gpu_energy")
    cpu_energy_j: Optional[float] = None  # None: not measured (see the record's extra "cpu_energy")
    samples: int = 0
    lost_samples: int = 0
    exit_state: Optional[str] = None
    wasteful: bool = False
    waste_reasons: list[str] = Field(default_factory=list)

    @field_validator("flow_run_id", mode="before")
    @classmethod
    def _uuid_to_str(cls, v: Any) -> Any:
        return id_str(v)
