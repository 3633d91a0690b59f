"""Scheduling history: the merge rule and reads on a real SQLite store, then one real agent end to end.

End to end (one agent, one CPU): a batch session that must wait behind another is recorded
``schedule NEED_RETRY`` with merged attempts, then ``schedule SUCCESS`` (Scheduled -> Pending) with
its sub-steps, ``start SUCCESS`` and ``terminate``; a session past its ``--timeout`` ends Failed
with ``task-timeout`` and a ``check_timeout EXPIRED`` record; `prefect-launch history` filters.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.blocks.scheduling_history import (HistoryWriter, SchedulingRecord, SubStep, read_history,
                                                      record, record_many)

from fixtures_pg import pg_server, pg_url  # noqa: F401  (fixtures)
from launch_helpers import agent, apply_queue, cli, cli_json, wait_final

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def _rec(run: str, phase: str = "schedule", result: str = "NEED_RETRY", code: str | None = "insufficient-resources",
         at: float = 0.0, msg: str = "waiting", **kw) -> SchedulingRecord:
    return SchedulingRecord(run_id=run, phase=phase, result=result, error_code=code, message=msg,
                            created=T0 + timedelta(seconds=at), **kw)


@pytest.fixture
def store(tmp_path):
    return RunMetricsStore(url=f"sqlite:///{tmp_path / 'h.db'}")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.server)])  # pg_url: a private PostgreSQL
def any_store(request, tmp_path):
    """The merge rule on both SQL back ends the store supports."""
    url = f"sqlite:///{tmp_path / 'h.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    return RunMetricsStore(url=url)


def test_repeats_merge_into_the_latest_record_and_anything_else_starts_a_new_one(any_store):
    store = any_store
    for i in range(4):  # the agent re-plans every 2 s while the run waits
        record(store, _rec("r1", at=2 * i, msg=f"waiting: try {i}"))
    steps = [SubStep(step=s, result="SUCCESS", message=s, position=3 if s == "sequencing" else None) for s in
             ("sequencing", "validation", "capacity_check", "allocation")]
    record(store, _rec("r1", result="SUCCESS", code=None, at=9, from_state="SCHEDULED", to_state="PENDING",
                       sub_steps=steps))
    record(store, _rec("r1", at=20))  # waiting again after success: a new record, not the old one
    record(store, _rec("r2", at=1))  # another run never merges with r1
    rows = read_history(store, "r1")
    assert [(r.phase, r.result, r.attempts) for r in rows] == [
        ("schedule", "NEED_RETRY", 4), ("schedule", "SUCCESS", 1), ("schedule", "NEED_RETRY", 1)]
    first = rows[0]
    assert first.created == T0 and first.updated == T0 + timedelta(seconds=6) and first.message == "waiting: try 3"
    assert [s.step for s in rows[1].sub_steps] == ["sequencing", "validation", "capacity_check", "allocation"]
    assert [s.position for s in rows[1].sub_steps] == [3, None, None, None]  # stored as a field, read back
    assert (rows[1].from_state, rows[1].to_state) == ("SCHEDULED", "PENDING")
    # a different error code for the same phase/result is a different decision
    record(store, _rec("r1", code="capacity-taken", at=21))
    assert [r.error_code for r in read_history(store, "r1")][-2:] == ["insufficient-resources", "capacity-taken"]


def test_read_filters_and_sorts(store):
    record_many(store, [_rec("r", at=0), _rec("r", at=2), _rec("r", phase="start", result="SUCCESS", code=None, at=3),
                        _rec("r", phase="terminate", result="SUCCESS", code="cancelled", at=10)])
    assert [r.phase for r in read_history(store, "r", result="SUCCESS")] == ["start", "terminate"]
    assert [r.phase for r in read_history(store, "r", phase=["schedule", "terminate"])] == ["schedule", "terminate"]
    assert [r.phase for r in read_history(store, "r", error_code="cancelled")] == ["terminate"]
    # since/until keep the records whose [created, updated] span overlaps the window
    assert [r.phase for r in read_history(store, "r", since=T0 + timedelta(seconds=1.5),
                                          until=T0 + timedelta(seconds=5))] == ["schedule", "start"]
    assert [r.phase for r in read_history(store, "r", sort="updated")] == ["schedule", "start", "terminate"]
    with pytest.raises(ValueError):
        read_history(store, "r", sort="bogus")


def test_retention_prunes_old_history_with_the_runs(store):
    old = datetime.now(timezone.utc) - timedelta(days=100)
    record(store, SchedulingRecord(run_id="old", phase="schedule", result="NEED_RETRY", created=old))
    record(store, SchedulingRecord(run_id="new", phase="schedule", result="NEED_RETRY"))
    store.purge(90)
    assert read_history(store, "old") == [] and len(read_history(store, "new")) == 1


class _DownStore:
    """A store whose writes fail until ``up`` is set (the real store behind it)."""

    def __init__(self, real):
        self.real, self.up, self.calls = real, False, 0

    def _write(self):
        self.calls += 1
        if not self.up:
            raise ConnectionError("store unreachable")
        return self.real._write()


def test_writer_merges_in_memory_buffers_through_an_outage_and_counts_what_it_drops(store):
    down = _DownStore(store)
    w = HistoryWriter(down, flush_s=60, max_buffer=3, retry_backoff_s=(0.05, 0.1))  # flushes when asked
    for i in range(50):  # one waiting run, re-planned 50 times: one pending record, attempts 50
        w.note(_rec("a", at=i))
    assert len(w._pending) == 1 and w._pending[0].attempts == 50
    for run in ("b", "c", "d"):
        w.note(_rec(run))
    assert w.lost == 1  # buffer of 3: the oldest is dropped and counted, nothing raises
    assert w.flush_once() is False and w.failures == 1 and len(w._pending) == 3  # kept for the next try
    assert read_history(store, None) == []
    down.up = True
    assert w.flush(5)
    assert sorted(r.run_id for r in read_history(store, None)) == ["b", "c", "d"]
    w.note(_rec("d", at=5))  # after the flush: merged in the store
    w.close(5)
    assert [r.attempts for r in read_history(store, "d")] == [2]


def test_history_table_indents_sub_steps():
    from prefect_launch import cli as C

    steps = [SubStep(step=s, result="SUCCESS", message=s, ended=T0) for s in ("sequencing", "allocation")]
    table = C._history_table([_rec("r", attempts=3), _rec("r", result="SUCCESS", code=None, sub_steps=steps)], "t")
    assert table.row_count == 4
    phases = list(table.columns[2].cells)
    assert phases == ["schedule", "schedule", "  └ sequencing", "  └ allocation"]
    assert list(table.columns[4].cells)[0] == "3"


def test_dispatch_cycle_records_each_decision_with_its_sub_steps():
    """The cycle with fakes: a placed run, one that waits for capacity, one behind it (FIFO), one rejected."""
    import asyncio
    from types import SimpleNamespace
    from uuid import uuid4

    from prefect_launch.workers.scheduling.dispatch import DispatchHooks, dispatch_cycle
    from prefect_launch.workers.scheduling.ledger import Ledger
    from prefect_launch.workers.scheduling.queue_spec import Preset, QueueSpec
    from prefect_launch.workers.scheduling.resources import Resources

    spec = QueueSpec(name="q", presets={"one": Preset(cpu=1, memory="1Gi"), "two": Preset(cpu=2, memory="1Gi")},
                     default_preset="one")
    runs = [SimpleNamespace(id=uuid4(), name=f"r{i}", deployment_id=None, job_variables=jv, tags=[],
                            expected_start_time=T0 + timedelta(seconds=i), work_queue_name="default", labels={})
            for i, jv in enumerate([{}, {"preset": "two"}, {}, {"preset": "nope"}])]
    notes: list[SchedulingRecord] = []

    async def nothing(*_a):
        return None

    async def no_agents():
        return {}, set()

    async def empty(_):
        return {}

    hooks = DispatchHooks(deployment_vars=empty, pinned_agents=no_agents, start=lambda *a: None, wait=nothing,
                          reject=nothing, history=notes.append, preempt=nothing)
    asyncio.run(dispatch_cycle(runs, spec, Ledger(Resources(cpu=2, memory=4 << 30)), "q", "a1", {"default": 1}, hooks))
    by = {n.run_id: n for n in notes}
    placed, big, behind, bad = (by[str(r.id)] for r in runs)
    assert (placed.phase, placed.result, placed.from_state, placed.to_state) == ("schedule", "SUCCESS", "SCHEDULED",
                                                                                 "PENDING")
    assert [(s.step, s.result) for s in placed.sub_steps] == [
        ("sequencing", "SUCCESS"), ("validation", "SUCCESS"), ("capacity_check", "SUCCESS"), ("allocation", "SUCCESS")]
    assert (big.phase, big.result, big.error_code) == ("schedule", "NEED_RETRY", "insufficient-resources"), big
    assert "needs cpu=2" in big.message and big.sub_steps[-1].step == "capacity_check"
    assert (behind.result, behind.error_code) == ("SKIPPED", "blocked-by-head")
    assert (bad.phase, bad.result, bad.to_state) == ("check_precondition", "GIVE_UP", "FAILED")
    assert bad.sub_steps[1].step == "validation" and bad.sub_steps[1].result == "FAILURE"


# ------------------------------------------------------------------ end to end

def _wait_history(run_id: str, phase: str, timeout: float = 30) -> list:
    """The run's records once one of ``phase`` is there (the agent writes in batches, about every second)."""
    deadline = time.time() + timeout
    while True:
        rows = cli_json("history", run_id)
        if any(r["phase"] == phase for r in rows) or time.time() > deadline:
            return rows
        time.sleep(0.5)


@pytest.mark.usefixtures("prefect_server")
def test_pending_then_started_run_and_timeout_in_the_history(tmp_path, unique_name, monkeypatch):
    monkeypatch.setenv("LAUNCH_POLL_SECONDS", "0.5")  # the agent re-plans often: a waiting run piles up attempts
    q = apply_queue(tmp_path, {"name": f"sh-{unique_name}", "default_preset": "one",
                               "presets": {"one": {"cpu": 1, "memory": "512Mi"}, "two": {"cpu": 2, "memory": "512Mi"}}})
    common = ("session", "start", "--type", "batch", "--queue", q, "--owner", f"h{unique_name}")
    first = cli_json(*common, "--name", f"first-{unique_name}", "--startup-command", "sleep 4", "--json")
    slow = cli_json(*common, "--name", f"slow-{unique_name}", "--startup-command", "sleep 60", "--timeout", "2s",
                    "--json")
    second = cli_json(*common, "--name", f"second-{unique_name}", "--preset", "two", "--startup-command", "true",
                      "--json")  # needs both CPUs: waits for the other two
    ids = [first["run_ids"][0], slow["run_ids"][0], second["run_ids"][0]]
    with agent([q], f"sh-{unique_name}", "cpu=2,memory=4Gi", tmp_path):
        runs = {str(r.id): r for r in wait_final(ids, timeout=120)}
        sid, tid = second["run_ids"][0], slow["run_ids"][0]
        hist = _wait_history(sid, "terminate")
        slow_hist = _wait_history(tid, "terminate")
    assert runs[sid].state.is_completed()
    steps = [(r["phase"], r["result"]) for r in hist]
    assert steps[:2] == [("schedule", "NEED_RETRY"), ("schedule", "SUCCESS")], hist
    assert steps[2:] == [("start", "SUCCESS"), ("terminate", "SUCCESS")], hist
    waited, placed, started, ended = hist
    assert waited["attempts"] > 1 and waited["error_code"] == "insufficient-resources"
    assert "needs cpu=2" in waited["message"] and waited["updated"] > waited["created"]
    assert (placed["from_state"], placed["to_state"]) == ("SCHEDULED", "PENDING")
    assert [s["step"] for s in placed["sub_steps"]] == ["sequencing", "validation", "capacity_check", "allocation"]
    assert all(s["result"] == "SUCCESS" and s["started"] and s["ended"] for s in placed["sub_steps"])
    seq = placed["sub_steps"][0]
    assert seq["position"] >= 1 and f"position {seq['position']} of" in seq["message"]
    assert placed["created"] >= waited["updated"]
    assert (started["from_state"], started["to_state"]) == ("PENDING", "RUNNING") and ended["to_state"] == "COMPLETED"
    # the timeout: Failed with task-timeout first in the message, and the decision in the history
    assert runs[tid].state.is_failed() and runs[tid].state.message.startswith("task-timeout: timeout after 2 s")
    expired = [r for r in slow_hist if r["phase"] == "check_timeout"]
    assert len(expired) == 1 and expired[0]["result"] == "EXPIRED" and expired[0]["error_code"] == "task-timeout"
    assert slow_hist[-1]["phase"] == "terminate" and slow_hist[-1]["to_state"] == "FAILED"
    assert slow_hist[-1]["error_code"] == "task-timeout" and slow_hist[-1]["sub_steps"][0]["step"] == "signal"
    # the CLI: by name, by prefix, with filters
    only = cli_json("history", f"second-{unique_name}", "--phase", "schedule", "--result", "NEED_RETRY")
    assert [(r["id"], r["attempts"]) for r in only] == [(waited["id"], waited["attempts"])]
    assert [r["phase"] for r in cli_json("history", tid[:12], "--error-code", "task-timeout")] == [
        "check_timeout", "terminate"]
    assert cli_json("history", sid, "--until", "2000-01-01T00:00:00") == []
    assert len(cli_json("history", sid, "--since", "1h", "--sort", "updated")) == 4
    text = cli("history", sid).stdout
    assert "NEED_RETRY" in text and "└ allocation" in text and "insufficient-resources" in text
    bad = cli("history", sid, "--phase", "nope", check=False)
    assert bad.returncode == 2 and "unknown --phase" in bad.stderr
