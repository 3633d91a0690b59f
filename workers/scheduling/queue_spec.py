"""The declaration of a launch queue: presets, bounds, priorities, policy.

A queue is a Prefect work pool; this model is what `deployments/queues.yaml`
declares and what the pool's base job template carries (under
``job_configuration.launch``) so that the CLI and every agent read the same
presets and bounds from the server.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, Field, field_validator, model_validator

from prefect_launch.workers.metrics.idle_checks import IdlePolicy
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources, format_size, parse_size

PRIORITIES: tuple[str, ...] = ("critical", "high", "medium", "low")
DEFAULT_PRIORITY = "medium"
TARGET_POOL_TYPES = {"process": "launch-process", "docker": "launch-docker", "kubernetes": "kubernetes"}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-_]{0,62}$")


class Preset(BaseModel):
    """A named size, e.g. ``gpu-small: {cpu: 4, memory: 16Gi, gpu: 1}``."""

    cpu: float = Field(1, ge=0)
    memory: str = "1Gi"
    gpu: int = Field(0, ge=0)
    shm_size: Optional[str] = None
    # Kubernetes queues only: where the preset's pods may run
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict] = Field(default_factory=list)

    @field_validator("memory", "shm_size")
    @classmethod
    def _size(cls, v: Optional[str]) -> Optional[str]:
        parse_size(v)
        return v

    def to_resources(self) -> Resources:
        return Resources(cpu=self.cpu, memory=parse_size(self.memory) or 0, gpu=self.gpu,
                         shm_size=parse_size(self.shm_size))


class Range(BaseModel):
    min: Optional[float] = None
    max: Optional[float] = None


class SizeRange(BaseModel):
    min: Optional[str] = None
    max: Optional[str] = None

    @field_validator("min", "max")
    @classmethod
    def _size(cls, v: Optional[str]) -> Optional[str]:
        parse_size(v)
        return v


class Bounds(BaseModel):
    """Min/max per resource (W&B's template-variable bounds)."""

    cpu: Range = Range()
    memory: SizeRange = SizeRange()
    gpu: Range = Range()
    shm_size: SizeRange = SizeRange()

    def violations(self, r: Resources) -> list[str]:
        out: list[str] = []

        def check(name: str, value: float | None, lo: float | None, hi: float | None, fmt) -> None:
            if value is None:
                return
            if lo is not None and value < lo:
                out.append(f"{name}={fmt(value)} is below the queue minimum {fmt(lo)}")
            if hi is not None and value > hi:
                out.append(f"{name}={fmt(value)} is above the queue maximum {fmt(hi)}")

        num = lambda v: f"{v:g}"  # noqa: E731
        size = lambda v: format_size(int(v))  # noqa: E731
        check("cpu", r.cpu, self.cpu.min, self.cpu.max, num)
        check("gpu", r.gpu, self.gpu.min, self.gpu.max, num)
        check("memory", r.memory, parse_size(self.memory.min), parse_size(self.memory.max), size)
        check("shm_size", r.shm_size, parse_size(self.shm_size.min), parse_size(self.shm_size.max), size)
        return out


class QuotaSpec(BaseModel):
    """Most one owner may hold at once on a queue's agents; unset = no cap on that resource."""

    cpu: Optional[float] = Field(None, ge=0)
    memory: Optional[str] = None
    gpu: Optional[int] = Field(None, ge=0)

    @field_validator("memory")
    @classmethod
    def _mem(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_size(v, "quota memory")
        return v

    def describe(self) -> str:
        """``cpu=2 memory=8Gi gpu=1``: only the capped resources."""
        caps = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in (("cpu", self.cpu), ("memory", self.memory), ("gpu", self.gpu)) if v is not None]
        return " ".join(caps) or "none"

    def resources(self):
        from prefect_launch.workers.scheduling.fair_share import Quota

        return Quota(cpu=self.cpu, memory=parse_size(self.memory) if self.memory else None, gpu=self.gpu)


class QueueSpec(BaseModel):
    """One launch queue as declared in queues.yaml."""

    name: str
    target: Literal["process", "docker", "kubernetes"] = "process"
    description: Optional[str] = None
    presets: dict[str, Preset]
    default_preset: str
    bounds: Bounds = Bounds()
    priorities: list[str] = Field(default_factory=lambda: list(PRIORITIES))
    concurrency_limit: Optional[int] = Field(None, ge=1)
    backfill: bool = False
    image: Optional[str] = None  # default image for docker/kubernetes queues
    registry: Optional[str] = None  # kubernetes queues: job environment images are pushed here (environments/image.py)
    timeout: Optional[str] = None  # default run timeout, e.g. "2h"; a run's --timeout overrides it
    idle: Optional[IdlePolicy] = None  # idle checks that reclaim held hardware (workers/metrics/idle_checks.py)
    # issue 12: preemptible fill, fair share and quotas between owners
    preemptible_priorities: list[str] = Field(default_factory=list)  # runs at these levels are preemptible by default
    preempt_grace: str = "30s"  # SIGTERM -> kill; the job sees LAUNCH_PREEMPT_DEADLINE_FILE to checkpoint
    fair_share: bool = False  # within a priority level, the owner holding the least goes first (DRF)
    owner_quota: Optional[QuotaSpec] = None  # most any one owner holds at once
    owner_quotas: dict[str, QuotaSpec] = Field(default_factory=dict)  # per-owner overrides
    # docker queues: containers started ahead of their runs, per shape (workers/backends/warm_containers.py)
    warm_containers: int = Field(0, ge=0, le=8)

    @field_validator("preempt_grace", mode="before")
    @classmethod
    def _grace(cls, v: object) -> str:
        from prefect_launch.times import duration_seconds

        if v is None or v == "":
            return "30s"
        duration_seconds(v, "preempt_grace")  # type: ignore[arg-type]
        return str(v)

    def sharing_text(self) -> str:
        """How the queue shares its agents between owners, in a line (`queue ls`, the monitor); '' when it
        does not (plain priority and FIFO/backfill)."""
        parts = []
        if self.fair_share:
            parts.append("fair share (DRF) within a priority")
        if self.owner_quota is not None:
            parts.append(f"owner quota {self.owner_quota.describe()}")
        parts += [f"{o}: {q.describe()}" for o, q in sorted(self.owner_quotas.items())]
        if self.preemptible_priorities:
            parts.append(f"preemptible: {', '.join(self.preemptible_priorities)} (grace {self.preempt_grace})")
        return "; ".join(parts)

    def quota_for(self, owner: Optional[str]) -> Optional["QuotaSpec"]:
        return self.owner_quotas.get(owner or "") or self.owner_quota

    @property
    def preempt_grace_s(self) -> float:
        from prefect_launch.times import duration_seconds

        return float(duration_seconds(self.preempt_grace, "preempt_grace") or 30.0)

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, v: object) -> Optional[str]:
        from prefect_launch.times import duration_seconds

        if v is None or v == "":
            return None
        duration_seconds(v, "timeout")  # type: ignore[arg-type]
        return str(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"queue name {v!r} must be lowercase letters, digits, '-' or '_' (max 63)")
        return v

    @field_validator("preemptible_priorities")
    @classmethod
    def _pre_levels(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in PRIORITIES]
        if unknown:
            raise ValueError(f"preemptible_priorities must be priority levels {list(PRIORITIES)}, got {unknown}")
        return v

    @field_validator("priorities")
    @classmethod
    def _priorities(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in PRIORITIES]
        if unknown or not v:
            raise ValueError(f"priorities must be a non-empty subset of {list(PRIORITIES)}, got {v}")
        return [p for p in PRIORITIES if p in v]

    @model_validator(mode="after")
    def _consistent(self) -> "QueueSpec":
        if not self.presets:
            raise ValueError(f"queue {self.name!r} declares no presets")
        if self.warm_containers and self.target != "docker":
            raise ValueError(f"queue {self.name!r}: warm_containers applies to docker queues only "
                             f"(process queues always keep a warm engine; kubernetes starts its own pods)")
        if self.default_preset not in self.presets:
            raise ValueError(
                f"queue {self.name!r}: default_preset {self.default_preset!r} is not one of {sorted(self.presets)}"
            )
        for pname, preset in self.presets.items():
            res = preset.to_resources()
            bad = self.bounds.violations(res)
            if bad:
                raise ValueError(f"queue {self.name!r}: preset {pname!r} is out of bounds: {'; '.join(bad)}")
            if res.shm_size and res.shm_size > res.memory:
                raise ValueError(f"queue {self.name!r}: preset {pname!r} has shm_size above its memory")
        return self

    @property
    def pool_type(self) -> str:
        return TARGET_POOL_TYPES[self.target]

    @property
    def default_priority(self) -> str:
        return DEFAULT_PRIORITY if DEFAULT_PRIORITY in self.priorities else self.priorities[-1]


class QueuesFile(BaseModel):
    queues: list[QueueSpec]

    @model_validator(mode="after")
    def _unique(self) -> "QueuesFile":
        names = [q.name for q in self.queues]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"queue names must be unique; repeated: {sorted(dup)}")
        return self


def queue_spec_of(pool: object) -> Optional[QueueSpec]:
    """The declaration a launch queue's work pool carries, or None for a plain Prefect pool."""
    template = getattr(pool, "base_job_template", None) or {}
    data = (template.get("job_configuration") or {}).get("launch")
    return QueueSpec.model_validate(data) if data else None


def load_queues_file(path: str) -> QueuesFile:
    """Read and validate a queues.yaml; errors name the file and the field."""
    import yaml
    from pydantic import ValidationError

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise LaunchValidationError(f"queue file {path!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise LaunchValidationError(f"queue file {path!r} is not valid YAML: {exc}") from None
    try:
        return QueuesFile.model_validate(data)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise LaunchValidationError(f"queue file {path!r} is invalid: {msgs}") from None
