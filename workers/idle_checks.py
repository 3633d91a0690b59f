"""Idle checks (Backend.AI's idle checkers): reclaim hardware a session holds but does not use.

A queue declares the policy (`idle:` in queues.yaml); the agent feeds each run's samples to an
`IdleChecker` (the sampler's ``on_sample`` hook) and ends the run with the checker's reason when
it says so. Three checkers, each optional:

- ``max_lifetime``: from the run's start (or its starts-at); reason ``idle-session-lifetime``.
  Applies to batch and interactive sessions.
- ``network_idle_timeout``: interactive sessions only; idle while no connection to the session's
  app ports has been open for that long; reason ``idle-timeout``.
- ``utilization``: after ``grace_period``, once ``window`` of samples is full, the window's average
  of each threshold given (cpu %, memory % of the request, gpu util %, gpu memory %) is compared;
  ``operator: and`` reclaims when every considered average is below its threshold, ``or`` when any
  is. Thresholds for resources the run did not request (no GPUs) are not considered. Reason
  ``idle-utilization``.

Pure apart from the clock values given to it, so every rule is tested without processes.
"""

from __future__ import annotations

from collections import deque
from typing import Literal, Optional

from pydantic import BaseModel, Field, field_validator

from prefect_launch.workers.durations import format_duration, parse_duration


class UtilizationPolicy(BaseModel):
    grace_period: str = "5m"
    window: str = "10m"
    operator: Literal["and", "or"] = "and"
    cpu: Optional[float] = Field(None, ge=0, le=100)  # % of the allocated CPUs
    memory: Optional[float] = Field(None, ge=0, le=100)  # % of the memory request
    gpu_util: Optional[float] = Field(None, ge=0, le=100)
    gpu_memory: Optional[float] = Field(None, ge=0, le=100)

    @field_validator("grace_period", "window")
    @classmethod
    def _dur(cls, v: str) -> str:
        parse_duration(v, "idle utilization duration")
        return v


class IdlePolicy(BaseModel):
    max_lifetime: Optional[str] = None
    network_idle_timeout: Optional[str] = None
    utilization: Optional[UtilizationPolicy] = None

    @field_validator("max_lifetime", "network_idle_timeout")
    @classmethod
    def _dur(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_duration(v, "idle duration")
        return v


class Verdict(BaseModel):
    reason: str  # idle-session-lifetime / idle-timeout / idle-utilization
    message: str


class IdleChecker:
    """One run's idle state; ``observe`` samples, ``check(now)`` says whether to reclaim."""

    def __init__(self, policy: IdlePolicy, started: float, session_type: Optional[str],
                 requested_gpu: int = 0, allocated_memory: Optional[int] = None, interval_s: float = 1.0):
        self.policy = policy
        self.started = started
        self.session_type = session_type
        self.requested_gpu = requested_gpu
        self.allocated_memory = allocated_memory
        self.last_access = started  # a session counts as used when it starts
        u = policy.utilization
        self._window_s = parse_duration(u.window) if u else 0.0
        self._grace_s = parse_duration(u.grace_period) if u else 0.0
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def observe(self, now: float, cpu_share_pct: Optional[float] = None, rss_bytes: Optional[int] = None,
                gpu_util_pct: Optional[float] = None, gpu_mem_pct: Optional[float] = None,
                connections: int = 0) -> None:
        if connections > 0:
            self.last_access = now
        vals: dict[str, float] = {}
        if cpu_share_pct is not None:
            vals["cpu"] = cpu_share_pct
        if rss_bytes is not None and self.allocated_memory:
            vals["memory"] = 100.0 * rss_bytes / self.allocated_memory
        if gpu_util_pct is not None and self.requested_gpu:
            vals["gpu_util"] = gpu_util_pct
        if gpu_mem_pct is not None and self.requested_gpu:
            vals["gpu_memory"] = gpu_mem_pct
        self._samples.append((now, vals))
        while self._samples and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()

    def remaining(self, now: float) -> dict[str, Optional[float]]:
        """Seconds left per checker (None: not judged yet / not applicable)."""
        out: dict[str, Optional[float]] = {}
        p = self.policy
        if p.max_lifetime:
            out["max_lifetime"] = self.started + parse_duration(p.max_lifetime) - now
        if p.network_idle_timeout and self.session_type == "interactive":
            out["network_idle_timeout"] = self.last_access + parse_duration(p.network_idle_timeout) - now
        if p.utilization:
            out["utilization"] = max(0.0, self.started + self._grace_s - now) if now < self.started + self._grace_s \
                else None
        return out

    def averages(self) -> dict[str, float]:
        sums: dict[str, list[float]] = {}
        for _, vals in self._samples:
            for k, v in vals.items():
                sums.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in sums.items()}

    def check(self, now: float) -> Optional[Verdict]:
        p = self.policy
        if p.max_lifetime and now >= self.started + parse_duration(p.max_lifetime):
            return Verdict(reason="idle-session-lifetime",
                           message=f"idle-session-lifetime: the session reached its maximum lifetime of "
                                   f"{format_duration(parse_duration(p.max_lifetime))}")
        if p.network_idle_timeout and self.session_type == "interactive":
            limit = parse_duration(p.network_idle_timeout)
            if now - self.last_access >= limit:
                return Verdict(reason="idle-timeout",
                               message=f"idle-timeout: no connection to the session's apps for {format_duration(limit)}")
        u = p.utilization
        if u and now >= self.started + self._grace_s and self._samples \
                and self._samples[-1][0] - self._samples[0][0] >= self._window_s * 0.9:
            avgs = self.averages()
            considered = {k: t for k, t in (("cpu", u.cpu), ("memory", u.memory), ("gpu_util", u.gpu_util),
                                            ("gpu_memory", u.gpu_memory)) if t is not None and k in avgs}
            if considered:
                below = {k: avgs[k] < t for k, t in considered.items()}
                idle = all(below.values()) if u.operator == "and" else any(below.values())
                if idle:
                    detail = ", ".join(f"{k} {avgs[k]:.1f}% < {t:g}%" if below[k] else f"{k} {avgs[k]:.1f}%"
                                       for k, t in considered.items())
                    return Verdict(reason="idle-utilization",
                                   message=f"idle-utilization: over the last {format_duration(self._window_s)} "
                                           f"({u.operator}): {detail}")
        return None


def app_connections(ports: list[int]) -> int:
    """Established TCP connections to the session's app ports (its 'last access' signal)."""
    if not ports:
        return 0
    import psutil

    try:
        return sum(1 for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port in ports)
    except (psutil.Error, OSError):
        return 0
