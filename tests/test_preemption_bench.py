"""bench/preemption.py's breakdown of the idle GPU-seconds, on synthetic state histories (pure)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "preemption_bench", Path(__file__).resolve().parents[1] / "bench" / "preemption.py")
P = sys.modules.setdefault("preemption_bench", importlib.util.module_from_spec(_spec))  # bench/ is no package
_spec.loader.exec_module(P)


def run(*states: tuple[str, float]) -> list[tuple[str, float]]:
    return list(states)


def done(created: float, pending: float, start: float, end: float) -> list[tuple[str, float]]:
    return run(("SCHEDULED", created), ("PENDING", pending), ("RUNNING", start), ("COMPLETED", end))


def test_lives_are_running_to_the_next_other_state():
    h = run(("SCHEDULED", 0), ("PENDING", 1), ("RUNNING", 2), ("RUNNING", 3), ("CANCELLING", 5),
            ("SCHEDULED", 6), ("PENDING", 7), ("RUNNING", 8), ("COMPLETED", 9))
    assert P.lives_of(h) == [(2, 5), (8, 9)]
    assert P.lives_of(run(("SCHEDULED", 0), ("RUNNING", 1))) == []  # still running: no end yet


def test_waiting_spans_merge_scheduled_and_pending():
    hs = {"a": done(0, 2, 3, 10), "b": done(1, 4, 5, 9)}
    assert P.waiting_spans(hs) == [(0, 5)]
    hs["c"] = done(20, 21, 22, 30)
    assert P.waiting_spans(hs) == [(0, 5), (20, 22)]


def test_slots_follow_the_run_freed_last():
    lives = [(0, 10, "a", 0), (0, 12, "b", 0), (12.5, 20, "c", 0), (10.5, 30, "d", 0)]
    slots = P.assign_slots(lives)
    assert sorted([l[2] for l in s] for s in slots) == [["a", "d"], ["b", "c"]]
    # timestamps a few ms out of order (a start before the previous end): the slot that frees first takes it
    slots = P.assign_slots([(0, 10, "a", 0), (0, 12, "b", 0), (9.99, 20, "c", 0)])
    assert sorted([l[2] for l in s] for s in slots) == [["a", "c"], ["b"]]


def test_transition_gaps_split_at_the_next_runs_pending_claim_and_the_drain_tail():
    hs = {"A": done(-1, -0.5, 0, 10), "B": done(-1, -0.5, 0, 10),
          "C": done(-1, 10.5, 11, 21), "D": done(-1, 10.2, 10.8, 20)}
    b = P.idle_breakdown(hs)
    assert b["release_to_pending"] == pytest.approx(0.2 + 0.5)
    assert b["pending_to_running"] == pytest.approx(0.6 + 0.5)
    assert b["drain_tail"] == pytest.approx(1.0)  # D's slot after 20: nothing waits, C finishes
    assert b["preemption_grace"] == 0 and b["nothing_waiting"] == 0
    assert b["total"] == pytest.approx(2 * 21 - (10 + 10 + 10 + 9.2))
    parts = sum(b[k] for k in ("release_to_pending", "pending_to_running", "preemption_grace", "drain_tail",
                               "nothing_waiting"))
    assert parts == pytest.approx(b["total"])
    assert b["busy_share"] == pytest.approx(39.2 / 42, abs=1e-3)
    # work waited over [0, 11]: A and B held 10 s each, D 0.2 s of it
    assert b["waiting_s"] == pytest.approx(11)
    assert b["busy_share_while_waiting"] == pytest.approx(20.2 / 22, abs=1e-3)


def test_preemption_grace_is_the_preempted_end_to_the_regular_jobs_running():
    hs = {
        "T": run(("SCHEDULED", -1), ("PENDING", -0.5), ("RUNNING", 0), ("CANCELLING", 5), ("SCHEDULED", 6),
                 ("PENDING", 20), ("RUNNING", 20.5), ("COMPLETED", 30)),
        "U": done(-1, -0.5, 0, 30),
        "R": run(("SCHEDULED", 4.9), ("PENDING", 5.0), ("RUNNING", 7), ("COMPLETED", 8)),
    }
    b = P.idle_breakdown(hs)
    assert b["preemption_grace"] == pytest.approx(2.0)  # T's stop asked at 5, R Running at 7
    assert b["release_to_pending"] == pytest.approx(12.0)  # R ended at 8, T claimed again at 20
    assert b["pending_to_running"] == pytest.approx(0.5)
    assert b["drain_tail"] == 0 and b["nothing_waiting"] == 0
    assert b["total"] == pytest.approx(60 - (5 + 30 + 1 + 9.5))


def test_idle_with_nothing_waiting_before_the_last_start_is_not_drain():
    hs = {"A": done(-1, -0.5, 0, 10), "B": done(-1, -0.5, 0, 4),
          "C": done(8, 8.5, 9, 12)}  # submitted late: B's GPU idle 4 -> 8 with nothing to run
    b = P.idle_breakdown(hs)
    assert b["nothing_waiting"] == pytest.approx(4.0)
    assert b["release_to_pending"] == pytest.approx(0.5) and b["pending_to_running"] == pytest.approx(0.5)
    assert b["drain_tail"] == pytest.approx(2.0)  # A's GPU after 10 while C finishes
    assert b["busy_share_while_waiting"] == pytest.approx(1 / 2)  # [8, 9]: A held, C not yet


def test_no_lives():
    b = P.idle_breakdown({"a": run(("SCHEDULED", 0))})
    assert b["total"] == 0 and b["busy_share"] is None and b["busy_share_while_waiting"] is None


def test_a_run_change_splits_at_placement_claim_and_the_engines_order():
    """(Run ids are hex, as Prefect's.) The agent's log lines (placement, then Prefect's submitting; the engine's first pull-step line) mark the
    steps of a change; a preempted life's gap (the grace) is no change of ours; missing marks leave a step out."""
    lines = [
        "00:00:10.300 | INFO    | prefect.flow_runs.worker - Agent 'a' starting flow run with cpu=1 gpus=[0]",
        "00:00:10.350 | INFO    | prefect.flow_runs.worker - Worker 'a' submitting flow run 'b'",
        "00:00:11.000 | INFO    | Flow run 'bee' - Running 1 deployment pull step(s)",
        "00:00:11.400 | INFO    | Flow run 'bee' - View at http://h/runs/flow-run/b",
        "00:00:21.000 | INFO    | Flow run 'cee' - View at http://h/runs/flow-run/c",  # C: no placement line
    ]
    marks = P.log_marks(lines, day_start=1000.0)
    assert marks == {"b": {"placed": [1010.3], "order": [1011.0]}}
    hs = {"a": done(1000, 1000, 1000, 1010), "b": done(1000, 1010.5, 1011.5, 1020),
          "c": done(1000, 1020.2, 1021.0, 1030),
          # d is preempted at 1009 (e takes its GPU: the grace, no change of ours) and runs again after c
          "d": run(("SCHEDULED", 1000), ("PENDING", 1000), ("RUNNING", 1000), ("SCHEDULED", 1009),
                   ("PENDING", 1030.1), ("RUNNING", 1030.4), ("COMPLETED", 1031)),
          "e": done(1000, 1009.2, 1009.6, 1019)}
    steps = P.transition_steps(hs, marks)
    assert steps["gap"]["n"] == 3  # a -> b, b -> c, c -> d's second life; not d's preempted life -> e
    assert steps["placed"] == {"median": 0.3, "p90": 0.3, "n": 1}  # b only: c and d have no placement line
    assert steps["pending"] == {"median": 0.2, "p90": 0.2, "n": 1}
    assert steps["order"] == {"median": 0.5, "p90": 0.5, "n": 1}
    assert steps["running"] == {"median": 0.5, "p90": 0.5, "n": 1}
