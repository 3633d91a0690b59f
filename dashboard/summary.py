"""The queue-summary table of the monitor: one row per queue, what it is doing right now.

Pure (pandas in, pandas out). A queue is

* ``busy`` when runs are claimed or running on it;
* ``waiting for capacity: <reason>`` when nothing of it runs but runs are due and waiting
  (e.g. the agent's CPUs are held by another queue); the reason is the head run's, the one
  the agent wrote on the run (label ``launch.waiting``, "needs 2 GPU, 1 free on agent w1");
* ``waiting (no agent online)`` when runs wait and no agent serves the queue;
* ``idle`` otherwise.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd

COLUMNS = ["queue", "type", "now", "queued", "pending", "running", "agents_online", "free_cpu", "free_gpu",
           "free_memory_gib", "concurrency_limit", "status", "sharing"]


def head_reasons(runs: pd.DataFrame) -> dict[str, str]:
    """Per queue, the waiting reason of its head run: the due, unclaimed run waiting longest
    that carries a reason (runs read are the newest of the range, so the head is among them
    unless more runs than that wait)."""
    if runs is None or runs.empty or "waiting" not in runs:
        return {}
    w = runs[(runs["state_type"] == "SCHEDULED") & runs["start"].isna() & (runs["waiting"].fillna("") != "")]
    if w.empty:
        return {}
    w = w.sort_values("expected_start", kind="stable")
    return {q: str(g["waiting"].iloc[0]) for q, g in w.groupby("queue", sort=False)}


def now_label(running: int, pending: int, queued: int, agents_online: int, reason: Optional[str]) -> str:
    if running + pending > 0:
        return "busy"
    if queued > 0:
        if agents_online == 0:
            return "waiting (no agent online)"
        return f"waiting for capacity: {reason}" if reason else "waiting for capacity"
    return "idle"


def summary_frame(pools: pd.DataFrame, now_counts: pd.DataFrame, workers: pd.DataFrame, agents: pd.DataFrame,
                  runs: pd.DataFrame, queues: tuple = ()) -> pd.DataFrame:
    """One row per shown queue (``queues``, else every pool) with its state now."""
    pools = pools[pools["queue"].isin(queues)] if queues else pools
    counts = now_counts.set_index("queue") if not now_counts.empty else pd.DataFrame(columns=["queued", "pending", "running"])
    online = (workers[workers["status"] == "ONLINE"].groupby("queue")["worker"].count() if not workers.empty
              else pd.Series(dtype=int))
    reasons = head_reasons(runs)
    rows = []
    for _, p in pools.iterrows():
        q = p["queue"]
        c = counts.loc[q] if q in counts.index else {"queued": 0, "pending": 0, "running": 0}
        ag = agents[(agents["queue"] == q) & agents["online"]] if not agents.empty else agents
        n_online = max(int(online.get(q, 0)), 0 if ag.empty else int(ag["agent"].nunique()))
        queued, pending, running = int(c["queued"]), int(c["pending"]), int(c["running"])
        rows.append(dict(
            queue=q, type=p["type"], now=now_label(running, pending, queued, n_online, reasons.get(q)), queued=queued,
            pending=pending, running=running, agents_online=n_online,
            free_cpu=None if ag.empty else float(ag["free_cpu"].sum()), free_gpu=None if ag.empty else int(ag["free_gpu"].sum()),
            free_memory_gib=None if ag.empty else round(float(ag["free_memory_gib"].sum()), 1),
            concurrency_limit=p["concurrency_limit"], status=p["status"], sharing=p.get("sharing") or "",
        ))
    return pd.DataFrame(rows, columns=COLUMNS)


def headline(summary: pd.DataFrame) -> dict:
    """The figures above the table: queues busy now (of those shown), runs queued and running now."""
    if summary is None or summary.empty:
        return dict(busy=0, queues=0, queued=0, running=0)
    return dict(busy=int((summary["now"] == "busy").sum()), queues=len(summary), queued=int(summary["queued"].sum()),
                running=int(summary["running"].sum()))


def capacity_used(cost_runs: Optional[pd.DataFrame], capacity: dict, span_s: float) -> dict[str, Optional[float]]:
    """Share (%) of the agents' GPU- and CPU-seconds over ``span_s`` that runs used (measured:
    the cost rows' ``gpu_used_h`` / ``cpu_used_h``); None where nothing was measured or no
    agent publishes that capacity."""
    out: dict[str, Optional[float]] = {}
    for key, col in (("gpu", "gpu_used_h"), ("cpu", "cpu_used_h")):
        c = capacity.get(key)
        ok = cost_runs is not None and not cost_runs.empty and cost_runs[col].notna().any()
        out[key] = 100.0 * float(cost_runs[col].sum()) * 3600 / (c * span_s) if c and span_s > 0 and ok else None
    return out


WAITING_COLUMNS = ["queue", "position", "name", "owner", "priority", "waited_s", "eta", "eta_in_s", "why"]


def waiting_frame(waits: list, now) -> pd.DataFrame:
    """Who waits and why: one row per waiting run (:class:`prefect_launch.deployments.wait_order.WaitingRun`),
    in queue then position order (1 = next; empty while its starts-at is ahead), with its predicted
    start (``eta``, UTC; empty when it cannot be told), seconds until then, and the agent's reason."""
    rows = []
    for w in waits:
        sub = getattr(w, "submitted", None)
        eta = getattr(w, "eta", None)
        rows.append(dict(
            queue=w.queue, position=w.position, name=w.name, owner=w.owner, priority=w.priority,
            waited_s=max(0.0, (now - sub).total_seconds()) if sub and sub <= now else None,
            eta=pd.Timestamp(eta) if eta else pd.NaT,
            eta_in_s=max(0.0, (eta - now).total_seconds()) if eta else None,
            why=w.reason or ("starts at " + f"{sub:%Y-%m-%d %H:%M:%S} UTC" if sub and sub > now
                             else "waiting: not planned yet (agents plan the oldest due runs of each priority first)")))
    df = pd.DataFrame(rows, columns=WAITING_COLUMNS)
    df["position"] = df["position"].astype("Int64")
    df["eta"] = pd.to_datetime(df["eta"], utc=True)
    for c in ("waited_s", "eta_in_s"):
        df[c] = df[c].astype("float64")
    return df
