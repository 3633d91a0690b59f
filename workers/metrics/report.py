"""Text rendering of a run's metrics (pure): sparklines, the `runs show` report, artifact rows.

``record`` and ``summary`` may be the pydantic models or the dicts that
:meth:`RunMetricsStore.summaries` returns; ``series`` is the list of dicts from
:meth:`RunMetricsStore.series` (or :class:`MetricSample` s).
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any, Iterable, Mapping, Optional, Sequence

BARS = "▁▂▃▄▅▆▇█"


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _resample(values: Sequence[Optional[float]], width: int) -> list[Optional[float]]:
    """Average into ``width`` buckets (None-aware)."""
    n = len(values)
    if n <= width:
        return list(values)
    out: list[Optional[float]] = []
    for i in range(width):
        lo, hi = i * n // width, (i + 1) * n // width
        chunk = [v for v in values[lo:hi] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def sparkline(
    values: Iterable[Optional[float]],
    width: int = 60,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
) -> str:
    """One-line chart: one of ``▁▂▃▄▅▆▇█`` per point, a space for a missing value.

    More than ``width`` values are averaged into ``width`` buckets. The scale runs
    from ``lo`` (default: min(0, min value)) to ``hi`` (default: the max value); an
    all-zero series is all ``▁``. ``sparkline([])`` is ``""``.
    """
    vals = [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    vals = _resample(vals, max(1, width))
    present = [v for v in vals if v is not None]
    if not present:
        return " " * len(vals)
    lo_ = min(0.0, min(present)) if lo is None else lo
    hi_ = max(present) if hi is None else hi
    span = hi_ - lo_
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif span <= 0:
            out.append(BARS[0] if v <= lo_ else BARS[-1])
        else:
            k = int(round((min(max(v, lo_), hi_) - lo_) / span * (len(BARS) - 1)))
            out.append(BARS[k])
    return "".join(out)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def fmt_duration(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m{sec:02d}s"
    return f"{m}m{sec:02d}s"


def fmt_pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{float(v):.1f}%"


def _fmt_time(t: Any) -> str:
    if t is None:
        return "-"
    if isinstance(t, datetime):
        return t.isoformat(timespec="seconds")
    return str(t)


def _alloc(summary: Any, record: Any) -> tuple[Any, Any, Any]:
    cpus = _get(summary, "allocated_cpus")
    mem = _get(summary, "allocated_memory_bytes")
    gpus = _get(summary, "allocated_gpus")
    if cpus is None:
        cpus = _get(record, "cpu")
    if mem is None:
        mem = _get(record, "memory_bytes")
    if gpus is None:
        gpus = _get(record, "gpu")
    return cpus, mem, gpus


# how the sampler counted a run's memory (RunRecord.extra["memory_measure"])
MEMORY_MEASURES = {"cgroup": "cgroup charge", "pss": "PSS of its processes"}


def lost_samples_note(summary: Any) -> Optional[str]:
    """A line for a run that lost samples while the metrics store was unreachable; None when none were lost."""
    lost = _get(summary, "lost_samples", 0) or 0
    if not lost:
        return None
    taken = _get(summary, "samples", 0) or 0
    return (f"{lost} of {taken} samples were lost while the metrics store was unreachable "
            "(the series below has gaps; the summary still counts every sample)")


def summary_artifact_rows(summary: Any, record: Any = None) -> list[dict[str, str]]:
    """Rows ``{"metric", "allocated", "used"}`` for a Prefect table artifact
    (``create_table_artifact(table=rows, key=..., description=...)``), all values strings.
    """
    cpus, mem, gpus = _alloc(summary, record)
    avg_cpu = _get(summary, "avg_cpu_pct")
    max_cpu = _get(summary, "max_cpu_pct")
    peak = _get(summary, "peak_rss_bytes")
    mem_used = f"{fmt_bytes(peak)} peak"
    if peak is not None and mem:
        mem_used += f" ({100.0 * peak / mem:.0f}%)"
    measure = MEMORY_MEASURES.get(str((_get(record, "extra") or {}).get("memory_measure")))
    if peak is not None and measure:
        mem_used += f", {measure}"
    gpu_used = "-"
    if _get(summary, "avg_gpu_util_pct") is not None:
        gpu_used = f"{fmt_pct(_get(summary, 'avg_gpu_util_pct'))} avg util, {fmt_pct(_get(summary, 'max_gpu_util_pct'))} max"
    gpu_mem_total = _get(summary, "gpu_mem_total_bytes")
    reasons = _get(summary, "waste_reasons") or []
    if isinstance(reasons, str):
        reasons = json.loads(reasons) if reasons.startswith("[") else [reasons]
    rows = [
        {"metric": "exit state", "allocated": "", "used": str(_get(summary, "exit_state") or "-")},
        {"metric": "duration", "allocated": "", "used": fmt_duration(_get(summary, "duration_s"))},
        {"metric": "queued", "allocated": "", "used": fmt_duration(_get(summary, "queue_s"))},
        {
            "metric": "CPU",
            "allocated": "-" if cpus is None else f"{float(cpus):g} CPUs",
            "used": "-"
            if avg_cpu is None
            else f"{float(avg_cpu) / 100:.2f} CPUs avg ({fmt_pct(avg_cpu)}), {fmt_pct(max_cpu)} max",
        },
        {"metric": "memory", "allocated": fmt_bytes(mem), "used": mem_used},
        {"metric": "GPU", "allocated": "-" if not gpus else f"{gpus} GPU", "used": gpu_used},
        {
            "metric": "GPU memory",
            "allocated": fmt_bytes(gpu_mem_total) if gpus else "-",
            "used": f"{fmt_bytes(_get(summary, 'peak_gpu_mem_bytes'))} peak" if gpus else "-",
        },
        {
            "metric": "disk I/O",
            "allocated": "",
            "used": f"read {fmt_bytes(_get(summary, 'read_bytes'))}, write {fmt_bytes(_get(summary, 'write_bytes'))}",
        },
    ]
    if _get(summary, "net_rx_bytes") is not None or _get(summary, "net_tx_bytes") is not None:
        rows.append(
            {
                "metric": "network",
                "allocated": "",
                "used": f"rx {fmt_bytes(_get(summary, 'net_rx_bytes'))}, tx {fmt_bytes(_get(summary, 'net_tx_bytes'))}",
            }
        )
    rows.append(
        {
            "metric": "samples",
            "allocated": "",
            "used": f"{_get(summary, 'samples', 0) or 0} taken, {_get(summary, 'lost_samples', 0) or 0} lost",
        }
    )
    rows.append(
        {
            "metric": "waste",
            "allocated": "",
            "used": ("WASTEFUL: " + "; ".join(reasons)) if _get(summary, "wasteful") else "no",
        }
    )
    return rows


_SERIES = [
    ("cpu %", "cpu_pct", "pct"),
    ("memory", "rss_bytes", "bytes"),
    ("gpu util", "gpu_util_pct", "pct"),
    ("gpu mem", "gpu_mem_bytes", "bytes"),
    ("disk read", "read_bytes", "bytes"),
    ("disk write", "write_bytes", "bytes"),
    ("net rx", "net_rx_bytes", "bytes"),
    ("net tx", "net_tx_bytes", "bytes"),
]


def render_run_report(record: Any, summary: Any, series: Sequence[Any], width: int = 60) -> str:
    """Plain-text report for ``prefect-launch runs show RUN``.

    Header (run, queue, job, flow, owner, preset, agent, times, state), the
    allocated-vs-used table, the waste verdict, then one sparkline per series that
    has any value (cpu %, memory, gpu util, gpu mem, disk and network I/O) with its
    min/avg/max. ``summary`` may be None (run still going or never measured).
    """
    rid = _get(record, "flow_run_id") or _get(summary, "flow_run_id") or "?"
    lines = [f"Run {rid}" + (f"  ({_get(record, 'flow_run_name')})" if _get(record, "flow_run_name") else "")]
    head = [
        ("queue", _get(record, "queue")),
        ("work queue", _get(record, "work_queue")),
        ("job", _get(record, "job")),
        ("flow", _get(record, "flow")),
        ("owner", _get(record, "owner")),
        ("project", _get(record, "project")),
        ("preset", _get(record, "preset")),
        ("agent", _get(record, "agent")),
        ("gpu indices", ",".join(str(i) for i in (_get(record, "gpu_indices") or [])) or None),
        ("submitted", _fmt_time(_get(record, "submitted_at")) if _get(record, "submitted_at") else None),
        ("started", _fmt_time(_get(record, "started_at") or _get(summary, "started_at"))),
        ("ended", _fmt_time(_get(record, "ended_at") or _get(summary, "ended_at"))),
        ("state", _get(summary, "exit_state") or _get(record, "state")),
    ]
    for k, v in head:
        if v not in (None, ""):
            lines.append(f"  {k:<12} {v}")
    lines.append("")
    if summary is None:
        lines.append("  (no summary yet: the run is still going or was not measured)")
    else:
        rows = summary_artifact_rows(summary, record)
        w1 = max(len(r["metric"]) for r in rows)
        w2 = max(max(len(r["allocated"]) for r in rows), len("allocated"))
        lines.append(f"  {'':<{w1}}  {'allocated':<{w2}}  used")
        for r in rows:
            lines.append(f"  {r['metric']:<{w1}}  {r['allocated']:<{w2}}  {r['used']}")
        note = lost_samples_note(summary)
        if note:
            lines.append(f"  ! {note}")
    lines.append("")
    pts = list(series or [])
    if not pts:
        lines.append("  (no samples)")
        return "\n".join(lines).rstrip() + "\n"
    first, last = _get(pts[0], "ts"), _get(pts[-1], "ts")
    lines.append(f"  series: {len(pts)} points, {_fmt_time(first)} .. {_fmt_time(last)}")
    for label, key, kind in _SERIES:
        vals = [_get(p, key) for p in pts]
        present = [float(v) for v in vals if v is not None]
        if not present:
            continue
        fmt = fmt_pct if kind == "pct" else fmt_bytes
        stats = f"min {fmt(min(present))}  avg {fmt(sum(present) / len(present))}  max {fmt(max(present))}"
        hi = 100.0 if key == "gpu_util_pct" else None
        lines.append(f"  {label:<10} {sparkline(vals, width=width, hi=hi)}  {stats}")
    return "\n".join(lines).rstrip() + "\n"


def _jsonable(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.isoformat()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "model_dump"):
        return _jsonable(v.model_dump())
    return v


def report_dict(record: Any, summary: Any, series: Sequence[Any]) -> dict[str, Any]:
    """JSON-ready ``{"run": ..., "summary": ... | None, "series": [...]}`` for ``runs show --json``
    (datetimes as ISO strings; ``json.dumps`` works on the result)."""
    return {
        "run": _jsonable(record) if record is not None else None,
        "summary": _jsonable(summary) if summary is not None else None,
        "series": _jsonable(list(series or [])),
    }
