"""The agent's one record per run (workers/agent/active_run.py): reads never create, a cleared record goes."""

from uuid import uuid4

from prefect_launch.workers.agent.active_run import ActiveRuns, RunHandle


def test_get_reads_without_creating_and_of_creates():
    runs, rid = ActiveRuns(), uuid4()
    assert runs.get(rid).handle is None and not runs.get(rid).ended and len(runs) == 0
    runs.of(rid).handle = RunHandle(pid=42)
    assert runs.get(rid).handle.pid == 42 and len(runs) == 1


def test_take_returns_the_field_and_drops_an_empty_record():
    runs, rid = ActiveRuns(), uuid4()
    runs.of(rid).kill_reason = "memory limit"
    runs.of(rid).ended = True
    assert runs.take(rid, "kill_reason") == "memory limit"
    assert runs.get(rid).kill_reason is None and len(runs) == 1  # still ended
    assert runs.take(rid, "ended") is True and len(runs) == 0
    assert runs.take(rid, "ended") is False and runs.take(uuid4(), "stops") is None


def test_having_lists_only_runs_with_the_field_set():
    runs, a, b = ActiveRuns(), uuid4(), uuid4()
    runs.of(a).handle = RunHandle(pid=1)
    runs.of(b).request = "req"
    assert list(runs.having("handle")) == [a] and list(runs.having("request")) == [b]
    assert runs.having("ending") == {}


def test_the_shared_blank_record_is_never_written():
    runs = ActiveRuns()
    runs.get(uuid4())
    runs.of(uuid4()).stops = ["x"]
    assert runs.get(uuid4()).stops is None
