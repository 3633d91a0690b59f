"""The queue-summary table: a queue whose runs wait on capacity says so, with the head run's reason."""

from __future__ import annotations

import pandas as pd

from prefect_launch.dashboard.summary import head_reasons, summary_frame

T = pd.Timestamp


def _frames():
    pools = pd.DataFrame([dict(queue=q, type="launch-process", status="READY", concurrency_limit=None)
                          for q in ("train", "eval", "spare", "orphan")])
    counts = pd.DataFrame([dict(queue="train", queued=0, pending=0, running=2), dict(queue="eval", queued=3, pending=0, running=0),
                           dict(queue="orphan", queued=1, pending=0, running=0)])
    workers = pd.DataFrame([dict(queue=q, worker="w1", status="ONLINE") for q in ("train", "eval", "spare")])
    agents = pd.DataFrame([dict(agent="w1", queue=q, online=True, free_cpu=0.0, free_gpu=0, free_memory_gib=1.0)
                           for q in ("train", "eval", "spare")])
    runs = pd.DataFrame([
        dict(queue="eval", state_type="SCHEDULED", start=pd.NaT, expected_start=T("2026-11-30 10:02", tz="UTC"),
             waiting="needs 2 CPU, 0 free on agent w1"),
        dict(queue="eval", state_type="SCHEDULED", start=pd.NaT, expected_start=T("2026-11-30 10:00", tz="UTC"),
             waiting="needs 4 CPU, 0 free on agent w1"),  # the head: waiting longest
        dict(queue="eval", state_type="SCHEDULED", start=pd.NaT, expected_start=T("2026-11-30 09:00", tz="UTC"), waiting=""),
        dict(queue="train", state_type="RUNNING", start=T("2026-11-30 09:00", tz="UTC"),
             expected_start=T("2026-11-30 08:59", tz="UTC"), waiting=""),
    ])
    return pools, counts, workers, agents, runs


def test_waiting_for_capacity_with_the_head_runs_reason():
    pools, counts, workers, agents, runs = _frames()
    s = summary_frame(pools, counts, workers, agents, runs).set_index("queue")
    assert s.loc["train", "now"] == "busy"
    assert s.loc["eval", "now"] == "waiting for capacity: needs 4 CPU, 0 free on agent w1"
    assert s.loc["spare", "now"] == "idle"
    assert s.loc["orphan", "now"] == "waiting (no agent online)"
    assert s.loc["eval", "queued"] == 3 and s.loc["eval", "agents_online"] == 1 and s.loc["eval", "free_cpu"] == 0.0
    # shown queues only
    assert list(summary_frame(pools, counts, workers, agents, runs, ("eval",))["queue"]) == ["eval"]
    # waiting without a reason on any read run: still not "idle"
    s2 = summary_frame(pools, counts, workers, agents, runs.assign(waiting="")).set_index("queue")
    assert s2.loc["eval", "now"] == "waiting for capacity"
    assert head_reasons(runs.iloc[:0]) == {}


def test_headline_and_capacity_used():
    from prefect_launch.dashboard.summary import capacity_used, headline

    pools, counts, workers, agents, runs = _frames()
    s = summary_frame(pools, counts, workers, agents, runs)
    assert headline(s) == dict(busy=1, queues=4, queued=4, running=2)
    assert headline(s.iloc[:0]) == dict(busy=0, queues=0, queued=0, running=0)
    cost = pd.DataFrame({"gpu_used_h": [1.0, 0.5], "cpu_used_h": [None, None]})
    # 1.5 GPU-hours used of 2 GPUs x 3 h
    assert capacity_used(cost, dict(gpu=2.0, cpu=8.0), 3 * 3600) == dict(gpu=25.0, cpu=None)  # CPU not measured: None
    assert capacity_used(cost, dict(gpu=None, cpu=None), 3600) == dict(gpu=None, cpu=None)  # no agent capacity
    assert capacity_used(None, dict(gpu=2.0, cpu=8.0), 3600) == dict(gpu=None, cpu=None)
