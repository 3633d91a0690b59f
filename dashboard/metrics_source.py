"""Metrics source of the queue monitor: the run metrics store the agents write, read per view.

:func:`metrics_store` finds the store (env URL, else block, else default), cached a minute;
:func:`fetch_metrics_cached` reads its run summaries for a range, cached per what the query
depends on (queues and range: the other filters narrow the rows on the client);
:func:`metrics_frame` and :func:`waste_frame` are the panels' pure producers.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from prefect_launch.dashboard.spec import STATUS_OF_TYPE, UNKNOWN, ViewSpec

METRIC_COLUMNS = ["id", "run", "job", "queue", "owner", "preset", "flow", "state", "status", "duration_s", "gpu_util_pct", "cpu_pct",
                  "cpu_share_pct", "gpu_mem_gib", "rss_gib", "alloc_gpus", "alloc_cpus", "alloc_memory_gib", "wasteful",
                  "waste_reasons", "members"]
WASTE_COLUMNS = ["run", "id", "job", "owner", "queue", "preset", "duration_s", "gpu_util_pct", "cpu_share_pct", "alloc_gpus",
                 "waste_reasons"]


class TtlCache:
    """Results kept ``ttl_s`` seconds per key (at most ``max_entries``, oldest dropped first)."""

    def __init__(self, ttl_s: float = 30.0, max_entries: int = 32) -> None:
        self._clock = time.monotonic
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._lock = threading.Lock()
        self._data: dict[Any, tuple[float, Any]] = {}

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        now = self._clock()
        with self._lock:
            hit = self._data.get(key)
        if hit is not None and now - hit[0] <= self.ttl_s:
            return hit[1]
        value = compute()
        with self._lock:
            self._data[key] = (now, value)
            if len(self._data) > self.max_entries:
                for k, _ in sorted(self._data.items(), key=lambda kv: kv[1][0])[: len(self._data) - self.max_entries]:
                    self._data.pop(k, None)
        return value


METRICS_CACHE = TtlCache()
STORE_CACHE = TtlCache(ttl_s=60.0, max_entries=8)


def metrics_store():
    """The run metrics store: ``LAUNCH_METRICS_URL`` (an SQLAlchemy URL) if set, else the block
    named ``LAUNCH_METRICS_BLOCK`` (default "default"), else the store's default URL.

    The block is loaded from the server at most once a minute per process (a load costs a
    client start-up, ~50 ms, on every view otherwise)."""
    key = (os.environ.get("LAUNCH_METRICS_URL"), os.environ.get("LAUNCH_METRICS_BLOCK"), os.environ.get("PREFECT_API_URL"))
    return STORE_CACHE.get(key, _load_metrics_store)


def _load_metrics_store():
    try:
        from prefect_launch.blocks.metrics_store import RunMetricsStore
    except Exception:
        return None
    if os.environ.get("LAUNCH_METRICS_URL"):
        return RunMetricsStore(url=os.environ["LAUNCH_METRICS_URL"])
    name = os.environ.get("LAUNCH_METRICS_BLOCK", "default")
    try:
        return RunMetricsStore.load(name)
    except Exception:
        return RunMetricsStore()


def fetch_metrics(store: Any, spec: ViewSpec) -> list[dict]:
    """The store's run summaries for the spec's queues and range ([] without a readable store)."""
    if store is None:
        return []
    try:
        return store.summaries(queue=list(spec.queues) or None, since=spec.since, until=spec.until, limit=max(spec.detail_limit * 2, 2000))
    except Exception:
        return []


def _store_key(store: Any) -> Any:
    try:
        return store.resolved_url()
    except Exception:
        return id(store)


def fetch_metrics_cached(cache: TtlCache, store: Any, spec: ViewSpec) -> list[dict]:
    """:func:`fetch_metrics` through ``cache``, keyed by what the query depends on."""
    if store is None:
        return []
    key = (_store_key(store), spec.queues, spec.since, spec.until, spec.detail_limit)
    return cache.get(key, lambda: fetch_metrics(store, spec))


def metrics_frame(rows: Sequence[dict], spec: Optional[ViewSpec] = None) -> pd.DataFrame:
    """Store summaries -> run, job, queue, owner, preset, flow, duration_s and the four metrics."""
    out = []
    for r in rows:
        if not r.get("has_summary") and r.get("duration_s") is None:
            continue
        state = (r.get("exit_state") or r.get("state") or "").upper()
        out.append(dict(
            id=r["flow_run_id"], run=r.get("flow_run_name") or r["flow_run_id"][:8], job=r.get("job") or UNKNOWN,
            queue=r.get("queue") or UNKNOWN, owner=r.get("owner") or UNKNOWN, preset=r.get("preset") or UNKNOWN,
            flow=r.get("flow") or r.get("project") or UNKNOWN, state=state, status=STATUS_OF_TYPE.get(state, state.lower() or UNKNOWN),
            duration_s=r.get("duration_s"), gpu_util_pct=r.get("avg_gpu_util_pct"), cpu_pct=r.get("avg_cpu_pct"),
            cpu_share_pct=r.get("avg_cpu_share_pct"),
            gpu_mem_gib=(r["peak_gpu_mem_bytes"] / 2**30) if r.get("peak_gpu_mem_bytes") is not None else None,
            rss_gib=(r["peak_rss_bytes"] / 2**30) if r.get("peak_rss_bytes") is not None else None,
            alloc_gpus=r.get("gpu"), alloc_cpus=r.get("cpu"),
            alloc_memory_gib=(r["memory_bytes"] / 2**30) if r.get("memory_bytes") else None,
            wasteful=bool(r.get("wasteful")), waste_reasons="; ".join(r.get("waste_reasons") or []),
            members=members_text((r.get("extra") or {}).get("members")),
        ))
    df = pd.DataFrame(out, columns=METRIC_COLUMNS)
    if spec is not None and not df.empty:
        df = apply_filters(df, spec)
    return df


def members_text(members: Optional[dict]) -> str:
    """A cluster run's members in one cell: name, GPUs, CPU seconds, peak memory ('' for other runs)."""
    if not isinstance(members, dict) or not members:
        return ""
    parts = []
    for name, m in sorted(members.items()):
        if not isinstance(m, dict):
            continue
        gpus = ",".join(str(int(g)) for g in (m.get("gpu_indices") or []))
        peak = m.get("peak_memory_bytes")
        parts.append(f"{name}: " + (f"gpu {gpus}, " if gpus else "") + f"{float(m.get('cpu_seconds') or 0):.1f} CPU-s"
                     + (f", {peak / 2**30:.2f} GiB" if isinstance(peak, (int, float)) and peak else ""))
    return " · ".join(parts)


def apply_filters(df: pd.DataFrame, spec: ViewSpec) -> pd.DataFrame:
    """Client-side version of the sidebar filters (for frames not read through Prefect)."""
    m = pd.Series(True, index=df.index)
    for col, vals in (("queue", spec.queues), ("owner", spec.owners), ("job", spec.jobs), ("preset", spec.presets), ("status", spec.statuses)):
        if vals and col in df:
            m &= df[col].isin(vals)
    return df[m]


def waste_frame(metrics: pd.DataFrame) -> pd.DataFrame:
    """The runs the agents flagged as wasting what they held, longest first."""
    w = metrics[metrics["wasteful"]] if not metrics.empty else metrics
    return w.sort_values("duration_s", ascending=False, ignore_index=True)[WASTE_COLUMNS]
