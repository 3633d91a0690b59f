"""Idle checks (Backend.AI's idle checkers): reclaim hardware a session holds but does not use.

A queue declares the policy (`idle:` in queues.yaml); the agent feeds each run's samples to an
`IdleChecker` (the sampler's ``on_sample`` hook) and ends the run with the checker's reason when
it says so. Three checkers, each optional:

- ``max_lifetime``: from the run's start (``lifetime_from: start``, the default) or from its
  scheduled start, i.e. its starts-at (``lifetime_from: starts_at``); reason
  ``idle-session-lifetime``. Applies to batch and interactive sessions.
- ``network_idle_timeout``: interactive sessions only; idle while no TCP connection to the
  session's app ports has been open for that long (a connection in any state but LISTEN counts,
  so a request that closed less than a minute ago - TIME_WAIT - still counts as use). The clock
  starts when the app first listens: a slow app start is not idleness; reason ``idle-timeout``.
- ``utilization``: after ``grace_period``, once ``window`` of samples is full, the window's average
  of each threshold given (cpu %, memory % of the request, gpu util %, gpu memory %) is compared;
  ``operator: and`` reclaims when every considered average is below its threshold, ``or`` when any
  is. Thresholds for resources the run did not request (no GPUs) are not considered. Reason
  ``idle-utilization``.

``apply_to`` says which runs of the queue are checked: sessions by default (``interactive``,
``batch``); add ``job`` to check the queue's jobs too.

Pure apart from the clock values given to it, so every rule is tested without processes;
:meth:`IdleChecker.status` is the live state the agent publishes (run label ``launch.idle``)
for `session show`, and :func:`app_activity` reads the app ports from /proc/net/tcp.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, field_validator

from prefect_launch.times import duration_seconds, format_duration


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
        duration_seconds(v, "idle utilization duration")
        return v


class IdlePolicy(BaseModel):
    max_lifetime: Optional[str] = None
    lifetime_from: Literal["start", "starts_at"] = "start"
    network_idle_timeout: Optional[str] = None
    utilization: Optional[UtilizationPolicy] = None
    apply_to: list[Literal["interactive", "batch", "job"]] = Field(default_factory=lambda: ["interactive", "batch"])

    def applies(self, session_type: Optional[str]) -> bool:
        """Whether a run of this type (None: a job) is checked at all."""
        return (session_type or "job") in self.apply_to and self.any()

    def any(self) -> bool:
        return bool(self.max_lifetime or self.network_idle_timeout or self.utilization)

    @field_validator("max_lifetime", "network_idle_timeout")
    @classmethod
    def _dur(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            duration_seconds(v, "idle duration")
        return v


class Verdict(BaseModel):
    reason: str  # idle-session-lifetime / idle-timeout / idle-utilization
    message: str


class IdleChecker:
    """One run's idle state; ``observe`` samples, ``check(now)`` says whether to reclaim."""

    def __init__(self, policy: IdlePolicy, started: float, session_type: Optional[str],
                 requested_gpu: int = 0, allocated_memory: Optional[int] = None, interval_s: float = 1.0,
                 scheduled: Optional[float] = None):
        self.policy = policy
        self.started = started
        self.lifetime_base = scheduled if policy.lifetime_from == "starts_at" and scheduled is not None else started
        self.session_type = session_type
        self.requested_gpu = requested_gpu
        self.allocated_memory = allocated_memory
        self.last_access = started  # a session counts as used when it starts
        self.connections = 0
        self.app_ready: Optional[bool] = None  # None: not observed (no ports, or the caller does not say)
        u = policy.utilization
        self._window_s = duration_seconds(u.window) if u else 0.0
        self._grace_s = duration_seconds(u.grace_period) if u else 0.0
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def observe(self, now: float, cpu_share_pct: Optional[float] = None, rss_bytes: Optional[int] = None,
                gpu_util_pct: Optional[float] = None, gpu_mem_pct: Optional[float] = None,
                connections: int = 0, app_ready: Optional[bool] = None) -> None:
        """One sample; ``app_ready=False`` (the app does not listen yet) counts as use, like a connection."""
        self.connections = connections
        first_ready = bool(app_ready) and not self.app_ready
        if app_ready is not None:
            self.app_ready = bool(self.app_ready) or app_ready
        if connections > 0 or first_ready or (app_ready is False and not self.app_ready):
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
            out["max_lifetime"] = self.lifetime_base + duration_seconds(p.max_lifetime) - now
        if p.network_idle_timeout and self.session_type == "interactive":
            out["network_idle_timeout"] = self.last_access + duration_seconds(p.network_idle_timeout) - now
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
        if p.max_lifetime and now >= self.lifetime_base + duration_seconds(p.max_lifetime):
            return Verdict(reason="idle-session-lifetime",
                           message=f"idle-session-lifetime: the session reached its maximum lifetime of "
                                   f"{format_duration(duration_seconds(p.max_lifetime))}")
        if p.network_idle_timeout and self.session_type == "interactive":
            limit = duration_seconds(p.network_idle_timeout)
            if now - self.last_access >= limit:
                return Verdict(reason="idle-timeout",
                               message=f"idle-timeout: no connection to the session's apps for {format_duration(limit)}")
        u = p.utilization
        if u and now >= self.started + self._grace_s and self.window_full():
            avgs = self.averages()
            considered = self._considered(avgs)
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


    def window_full(self) -> bool:
        """Judged only once the samples span the window (10% slack for tick jitter)."""
        return bool(self._samples) and self._samples[-1][0] - self._samples[0][0] >= self._window_s * 0.9

    def _considered(self, avgs: dict[str, float]) -> dict[str, float]:
        u = self.policy.utilization
        if u is None:
            return {}
        return {k: t for k, t in (("cpu", u.cpu), ("memory", u.memory), ("gpu_util", u.gpu_util),
                                  ("gpu_memory", u.gpu_memory)) if t is not None and k in avgs}

    def status(self, now: float) -> dict[str, Any]:
        """The live state of each checker, in epoch seconds, for people (`session show`).

        Deadlines rather than remaining seconds, so a reader computes the time left at its own
        clock; ``at`` says when this was judged.
        """
        p = self.policy
        checks: list[dict[str, Any]] = []
        if p.max_lifetime:
            checks.append({"name": "session_lifetime", "limit": p.max_lifetime, "from": p.lifetime_from,
                           "deadline": round(self.lifetime_base + duration_seconds(p.max_lifetime), 1)})
        if p.network_idle_timeout and self.session_type == "interactive":
            checks.append({"name": "network_timeout", "limit": p.network_idle_timeout,
                           "deadline": round(self.last_access + duration_seconds(p.network_idle_timeout), 1),
                           "connections": self.connections, "app_ready": self.app_ready})
        u = p.utilization
        if u:
            avgs = self.averages()
            considered = self._considered(avgs)
            checks.append({"name": "utilization", "window": u.window, "operator": u.operator,
                           "grace_until": round(self.started + self._grace_s, 1), "window_full": self.window_full(),
                           "thresholds": {k: t for k, t in (("cpu", u.cpu), ("memory", u.memory),
                                                            ("gpu_util", u.gpu_util), ("gpu_memory", u.gpu_memory))
                                          if t is not None},
                           "averages": {k: round(avgs[k], 1) for k in considered}})
        return {"at": round(now, 1), "checks": checks}


def describe_status(status: dict[str, Any], now: float) -> list[str]:
    """One line per checker with the time left at ``now`` (what `session show` prints)."""
    out = []
    age = max(0.0, now - float(status.get("at") or now))
    for c in status.get("checks") or []:
        if "deadline" in c:
            left = max(0.0, float(c["deadline"]) - now)
            extra = ""
            if c["name"] == "network_timeout":
                extra = (f"; {c.get('connections') or 0} open connection(s)" if c.get("app_ready")
                         else "; app not listening yet")
            out.append(f"{c['name']}: limit {c['limit']}, {format_duration(left)} left{extra}")
        else:
            grace = float(c["grace_until"]) - now
            avgs = ", ".join(f"{k} {v:g}% (< {c['thresholds'][k]:g}%?)" for k, v in (c.get("averages") or {}).items())
            if grace > 0:
                state = f"grace period, {format_duration(grace)} left"
            elif not c.get("window_full"):
                state = "filling the window"
            else:
                state = f"judging ({c['operator']}): {avgs or 'no measured resource'}"
            out.append(f"utilization: window {c['window']}, {state}")
    if out and age > 1:
        out.append(f"(as judged by the agent {format_duration(age)} ago)")
    return out


_TCP_LISTEN = "0A"


def app_activity(ports: list[int]) -> tuple[bool, int]:
    """(some app port listens, sockets on the app ports in any state but LISTEN).

    Reads /proc/net/tcp and tcp6 of the agent's network namespace (the session's too on the
    process back end and with host networking): a few KB per tick, no walk over every
    process's file descriptors as ``psutil.net_connections`` does.
    """
    if not ports:
        return False, 0
    wanted = set(ports)
    listening, conns, read = False, 0, False
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            parts = line.split(None, 4)
            if len(parts) < 4:
                continue
            try:
                port = int(parts[1].rsplit(":", 1)[1], 16)
            except (IndexError, ValueError):
                continue
            if port in wanted:
                if parts[3] == _TCP_LISTEN:
                    listening = True
                else:
                    conns += 1
    if not read:
        return True, app_connections(ports)
    return listening, conns


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
