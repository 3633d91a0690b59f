"""The monitor's run index: built from and kept in step with a real Prefect server, and
giving the same numbers as Prefect's own aggregation for the same runs."""

from __future__ import annotations

import datetime as dt
import math
import re
import time
import uuid

import numpy as np
import pandas as pd
import pytest
from prefect.client.orchestration import get_client
from prefect.states import Completed, Running, Scheduled

from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.blocks.run_index import IndexRow, RunIndex
from prefect_launch.dashboard import api as A
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import view as V
from prefect_launch.dashboard import frames as F
from prefect_launch.dashboard import index_sync as X
from prefect_launch.dashboard import index_view as IV
from fixtures_dashboard import seed_runs

UTC = dt.timezone.utc


@pytest.fixture(scope="module")
def seeded(prefect_server):
    return seed_runs(uuid.uuid4().hex[:6], metrics=False)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return RunMetricsStore(url=f"sqlite:///{tmp_path_factory.mktemp('index') / 'launch-metrics.db'}")


def _spec(seeded, **kw) -> S.ViewSpec:
    now = dt.datetime.now(UTC)
    return S.ViewSpec(since=seeded.since, until=now + dt.timedelta(minutes=1), queues=(seeded.pool,), interval_s=300, **kw)


def _by(hist: pd.DataFrame, keys: list[str]) -> dict:
    return hist.groupby(keys)["count"].sum().to_dict()


def _same_view(a: V.View, b: V.View) -> None:
    """Index and API views agree on every run-derived panel."""
    assert a.source == "index" and b.source == "api"
    assert a.totals["runs"] == b.totals["runs"] > 0
    assert _by(a.hist, ["bucket", "status"]) == _by(b.hist, ["bucket", "status"])
    assert _by(a.hist, ["bucket", "group"]) == _by(b.hist, ["bucket", "group"])
    # queued and run seconds of finished runs are fixed numbers (waiting runs grow with the
    # clock); the server sums whole seconds per run on SQLite, the index keeps microseconds
    done = a.hist[a.hist["status"].isin(["completed", "failed", "crashed", "cancelled"])]
    done_b = b.hist[b.hist["status"].isin(["completed", "failed", "crashed", "cancelled"])]
    for c in ("queued_s", "run_s"):
        assert math.isclose(done[c].sum(), done_b[c].sum(), abs_tol=1.0 * done["count"].sum()), c
    assert set(a.runs["id"]) == set(b.runs["id"])
    ra, rb = a.runs.set_index("id").sort_index(), b.runs.set_index("id").sort_index()
    for c in ("job", "queue", "owner", "preset", "status", "start", "end", "expected_start"):
        assert ra[c].equals(rb[c]), c
    assert list(a.errors["id"]) == list(b.errors["id"])
    assert list(a.errors["message"]) == list(b.errors["message"])
    ca = a.now_counts.set_index("queue").sort_index()
    cb = b.now_counts.set_index("queue").sort_index()
    assert ca.to_dict() == cb.to_dict()


@pytest.mark.parametrize("kw", [
    dict(grouping="job"),
    dict(grouping="owner"),
    dict(grouping="status"),
    dict(grouping="preset", owners=("alice",)),
    dict(grouping="job", presets=("gpu-1",), statuses=("completed", "failed")),
    dict(grouping="queue"),
])
def test_index_gives_what_prefect_aggregation_gives(seeded, store, kw):
    spec = _spec(seeded, **kw)
    now = dt.datetime.now(UTC)
    a = V.load_view(spec, store=store, source="index", use_cache=False, now=now)
    b = V.load_view(spec, store=None, source="api", use_cache=False, now=now)
    _same_view(a, b)


def test_build_reads_every_run_and_records_coverage(seeded, store):
    index = RunIndex(store)
    api = A.get_api()
    res = X.build(index, api, days=1)
    assert res.mode == "build" and res.runs_read >= len(seeded.run_ids)
    frame = index.frame()
    assert set(seeded.run_ids) <= set(frame["id"])
    row = frame.set_index("id").loc[seeded.failed_ids[0]]
    assert row["state_type"] == "FAILED" and "loss is NaN" in row["message"]
    meta = index.meta(api.server_id())
    assert meta.covered_since_ms <= (dt.datetime.now(UTC) - dt.timedelta(hours=23)).timestamp() * 1000
    svc = X.IndexService(index, api)
    assert svc.covers(dt.datetime.now(UTC) - dt.timedelta(hours=23))
    assert not svc.covers(dt.datetime.now(UTC) - dt.timedelta(days=2))


def test_sync_follows_state_changes_new_and_backdated_runs(seeded, store):
    index = RunIndex(store)
    api = A.get_api()
    if not X.IndexService(index, api).covers(seeded.since):
        X.build(index, api, days=1)
    with get_client(sync_client=True) as client:
        running = seeded.running_ids[0]
        client.set_flow_run_state(uuid.UUID(running), Completed(), force=True)  # an open run finishes
        dep = client.read_flow_run(uuid.UUID(seeded.run_ids[0])).deployment_id
        new = client.create_flow_run_from_deployment(dep, tags=["launch", "owner:carol", "preset:small"])  # due now
        old = client.create_flow_run_from_deployment(  # created now, expected 3 h ago: only events reveal it
            dep, tags=["launch", "owner:dave"], state=Scheduled(scheduled_time=dt.datetime.now(UTC) - dt.timedelta(hours=3)))
        done = seeded.run_ids[0]
        client.set_flow_run_state(uuid.UUID(done), Running(), force=True)  # a finished run is re-run
    seeded.running_ids[:] = [done]
    res = X.sync(index, api)
    rows = index.frame().set_index("id")
    assert rows.loc[running, "state_type"] == "COMPLETED"
    assert str(new.id) in rows.index and rows.loc[str(new.id), "owner"] == "carol"
    # the other two changes arrive through Prefect's events, which the server persists in batches
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = index.frame().set_index("id")
        if str(old.id) in rows.index and rows.loc[done, "state_type"] == "RUNNING":
            break
        time.sleep(1)
        res = X.sync(index, api)
    assert res.mode == "events"
    assert rows.loc[str(old.id), "owner"] == "dave" and rows.loc[done, "state_type"] == "RUNNING"


def test_keyset_paging_walks_through_a_shared_timestamp(prefect_server, monkeypatch):
    """More runs than a page expected at the same instant are all read, once."""
    monkeypatch.setattr(X, "PAGE", 3)
    t = dt.datetime.now(UTC).replace(microsecond=0) - dt.timedelta(days=3, seconds=uuid.uuid4().int % 1000)
    with get_client(sync_client=True) as client:
        dep = client.create_deployment(flow_id=client.create_flow_from_name(f"tie-{uuid.uuid4().hex[:6]}"), name="tie")
        ids = {str(client.create_flow_run_from_deployment(dep, state=Scheduled(scheduled_time=t)).id) for _ in range(8)}
    got = [r["id"] for page in X.read_runs_expected(A.get_api(), t - dt.timedelta(seconds=1), t + dt.timedelta(seconds=1))
           for r in page]
    assert len(got) == len(set(got)) and ids <= set(got)


# ------------------------------------------------------------- pure functions


def _raw(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([dict(IndexRow(**r).model_dump(), synced_ms=0) for r in rows])


def _frame(rows: list[dict]) -> pd.DataFrame:
    return IV.prepare(_raw(rows), {"d1": {"name": "train"}})


def test_history_counts_run_time_and_lateness_like_prefect():
    t0 = dt.datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
    now = t0 + dt.timedelta(hours=1)
    us = IV.us
    rows = _frame([
        # finished: started 60 s late, ran 100 s
        dict(id="a", deployment_id="d1", state_type="COMPLETED", expected_start_us=us(t0), start_us=us(t0) + 60_000_000,
             end_us=us(t0) + 160_000_000, run_time_s=100.0, owner="alice"),
        # running since 10 min before now, started on time
        dict(id="b", deployment_id="d1", state_type="RUNNING", expected_start_us=us(now - dt.timedelta(minutes=10)),
             start_us=us(now - dt.timedelta(minutes=10)), state_us=us(now - dt.timedelta(minutes=10)), run_time_s=0.0),
        # still waiting, due 30 min before now
        dict(id="c", state_type="SCHEDULED", expected_start_us=us(now - dt.timedelta(minutes=30))),
        # cancelled before it started: no lateness (terminal)
        dict(id="d", state_type="CANCELLED", expected_start_us=us(t0 + dt.timedelta(minutes=5))),
    ])
    spec = S.ViewSpec(since=t0, until=now, grouping="job", interval_s=900)
    total, per = IV.history(IV.select(rows, spec), spec, 900, now)
    assert total["count"].sum() == 4
    got = total.set_index("state_type")
    assert got.loc["COMPLETED", "run_s"] == 100 and got.loc["COMPLETED", "queued_s"] == 60
    assert got.loc["RUNNING", "run_s"] == 600 and got.loc["RUNNING", "queued_s"] == 0
    assert got.loc["SCHEDULED", "queued_s"] == 1800 and got.loc["CANCELLED", "queued_s"] == 0
    assert set(per["group"]) == {"train", "(no deployment)"}
    assert list(total["bucket"].sort_values().dt.minute.unique()) == [0, 30, 45]
    # filters: owner narrows to the one run that has it
    only = IV.select(rows, S.ViewSpec(since=t0, until=now, owners=("alice",)))
    assert list(only["id"]) == ["a"]
    r = F.runs_frame(IV.newest(rows, 3), _raw([dict(id="c", name="run-c", message="m")]), now)
    assert list(r["id"]) == ["b", "c", "d"]  # newest expected start first, limited
    r = r.set_index("id")
    assert r.loc["c", "queued_s"] == 1800 and np.isnan(r.loc["c", "duration_s"])
    assert r.loc["b", "duration_s"] == 600
    assert (r.loc["c", "name"], r.loc["c", "message"]) == ("run-c", "m") and r.loc["b", "message"] == ""


def test_splice_replaces_runs_and_keeps_labels_categorical():
    held = _frame([dict(id="a", owner="alice", state_type="RUNNING", expected_start_us=1),
                   dict(id="b", owner="bob", state_type="RUNNING", expected_start_us=2)])
    fresh = _frame([dict(id="b", owner="bob", state_type="FAILED", expected_start_us=2),
                    dict(id="c", owner="zoe", state_type="SCHEDULED", expected_start_us=3)])
    out = IV.splice(held, fresh).set_index("id")
    assert list(out.index) == ["a", "b", "c"]
    assert out.loc["b", "status"] == "failed" and out.loc["c", "owner"] == "zoe"
    assert all(isinstance(out[c].dtype, pd.CategoricalDtype) for c in IV.LABELS)
    assert list(IV.select(out.reset_index(), S.ViewSpec(since=dt.datetime(2026, 1, 1, tzinfo=UTC), until=dt.datetime(2026, 1, 2, tzinfo=UTC),
                                                        owners=("zoe",)), time=False)["id"]) == ["c"]


def test_cli_builds_and_reports_the_index(seeded, tmp_path, monkeypatch):
    from launch_helpers import cli_json

    monkeypatch.setenv("LAUNCH_METRICS_URL", f"sqlite:///{tmp_path / 'cli-metrics.db'}")
    before = cli_json("monitor", "status", "--no-sync")
    assert before["built"] is False and before["indexed"] == 0
    built = cli_json("monitor", "index", "--days", "1")
    assert built["mode"] == "build" and built["built"] is True and built["indexed"] >= len(seeded.run_ids)
    status = cli_json("monitor", "status")
    assert status["sync"]["mode"] == "events" and status["indexed"] >= built["indexed"]
    assert dt.datetime.fromisoformat(status["covered_since"]) <= dt.datetime.now(UTC) - dt.timedelta(hours=23)


def test_sync_drops_finished_runs_past_the_window(seeded, tmp_path, monkeypatch):
    index = RunIndex(RunMetricsStore(url=f"sqlite:///{tmp_path / 'retention.db'}"))
    api = A.get_api()
    X.build(index, api, days=1)
    old = dt.datetime.now(UTC) - dt.timedelta(days=5)
    old_done, old_open = str(uuid.uuid4()), str(uuid.uuid4())  # runs the server does not have (any more)
    index.upsert([IndexRow(id=old_done, state_type="COMPLETED", expected_start_us=IV.us(old)),
                  IndexRow(id=old_open, state_type="RUNNING", expected_start_us=IV.us(old))])
    meta = index.meta(api.server_id())
    index.set_meta(meta.model_copy(update=dict(covered_since_ms=int(old.timestamp() * 1000))))
    monkeypatch.setenv("LAUNCH_INDEX_DAYS", "1")
    X.sync(index, api)
    ids = set(index.frame(columns=["id"])["id"])
    assert old_done not in ids and set(seeded.run_ids) <= ids
    assert old_open not in ids  # an open run the server no longer has is dropped, not shown as running forever
    assert index.meta(api.server_id()).covered_since_ms > (dt.datetime.now(UTC) - dt.timedelta(days=1, minutes=5)).timestamp() * 1000


def test_view_falls_back_to_the_api_when_the_index_cannot_sync(seeded, tmp_path, monkeypatch):
    """The page found the index built, then another process reset it before the view synced:
    the view comes from Prefect's API instead of failing."""
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'fallback.db'}")
    api = A.get_api()
    X.build(RunIndex(store), api, days=1)
    real_covers = X.IndexService.covers

    def covers_then_reset(self, since):
        ok = real_covers(self, since)
        RunIndex(store).reset(api.server_id(), api.api_url)
        return ok

    monkeypatch.setattr(X.IndexService, "covers", covers_then_reset)
    spec = _spec(seeded)
    v = V.load_view(spec, store=store, use_cache=False)
    want = V.load_view(spec, store=None, source="api", use_cache=False)
    assert v.source == "api" and v.totals["runs"] == want.totals["runs"] > 0


def _set_state_without_event(run_id: str, state_type: str, name: str) -> None:
    """Give a run a new state the way Prefect's orchestration stores one (a state row, the run pointing
    at it) but with no event: what the server holds after an event was lost. Written to the session
    server's SQLite database (under PREFECT_HOME) while it runs."""
    import json
    import os
    import sqlite3
    from pathlib import Path

    db = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
    assert db.exists(), db
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
    sid = str(uuid.uuid4())
    with sqlite3.connect(db, timeout=30) as conn:
        conn.execute("INSERT INTO flow_run_state (id, created, updated, type, timestamp, name, state_details, flow_run_id) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (sid, now, now, state_type, now, name, json.dumps({"flow_run_id": run_id}), run_id))
        conn.execute("UPDATE flow_run SET state_id = ?, state_type = ?, state_name = ?, state_timestamp = ?, end_time = ?, updated = ? "
                     "WHERE id = ?", (sid, state_type, name, now, now, now, run_id))


def test_open_runs_are_reread_once_a_clock_step_and_events_carry_the_rest(seeded, tmp_path, monkeypatch):
    """Between two checks of the open runs (one step of the page's clock) a sync relies on
    Prefect's events: a state change still arrives; what no event tells (a deleted run, a state
    change whose event was lost) waits for the next check, which shows it; a change a check cannot
    see (a state renamed within its type) waits for the next full read of the open runs."""
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'open.db'}")
    api = A.get_api()
    index = RunIndex(store)
    with get_client(sync_client=True) as client:
        dep = client.read_flow_run(uuid.UUID(seeded.run_ids[0])).deployment_id
        moving = client.create_flow_run_from_deployment(dep, tags=["launch", "owner:erin"])
        doomed = client.create_flow_run_from_deployment(dep, tags=["launch", "owner:erin"])
        late = client.create_flow_run_from_deployment(dep, tags=["launch", "owner:erin"])
    X.build(index, api, days=1)
    rows = index.frame().set_index("id")
    assert rows.loc[str(moving.id), "state_type"] == rows.loc[str(doomed.id), "state_type"] == "SCHEDULED"
    monkeypatch.setattr(X, "MIN_SYNC_S", 0.0)
    svc = X.IndexService(index, api)
    svc.frame(seeded.since, {})  # the first sync reads the open runs in full
    monkeypatch.setattr(X, "OPEN_REREAD_S", 3600.0)
    monkeypatch.setattr(X, "OPEN_FULL_REREAD_S", 3600.0)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(moving.id, Running(), force=True)
        client.delete_flow_run(doomed.id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the event is persisted in a batch of the server's
        frame, _ = svc.frame(seeded.since, {})
        if frame.set_index("id").loc[str(moving.id), "state_type"] == "RUNNING":
            break
        time.sleep(1)
    assert svc.last_sync.mode == "events"
    frame = frame.set_index("id")
    assert frame.loc[str(moving.id), "state_type"] == "RUNNING"
    assert str(doomed.id) in frame.index  # no event says a run was deleted
    monkeypatch.setattr(X, "OPEN_REREAD_S", 0.0)  # a step later: the open runs are read again
    frame, _ = svc.frame(seeded.since, {})
    assert svc.last_sync.deleted == [str(doomed.id)]
    assert str(doomed.id) not in index.frame().set_index("id").index
    assert str(doomed.id) not in set(frame["id"]) and str(moving.id) in set(frame["id"])  # what the page draws
    # a state change whose event never reached the server's events (lost with a crash): between re-reads
    # nothing says so; the next re-read of the open runs shows it
    monkeypatch.setattr(X, "OPEN_REREAD_S", 3600.0)
    monkeypatch.setattr(X, "NEW_RUN_SLACK_S", 0.0)  # the run is not read again as one due about now either
    # nor for its Running event: events are read again from EVENTS_OVERLAP_S before the last sync (for
    # late-persisted ones), and on a slow box that event can still lie inside the overlap (seen under -n 3)
    monkeypatch.setattr(X, "EVENTS_OVERLAP_S", 0.0)
    _set_state_without_event(str(moving.id), "COMPLETED", "Completed")
    frame, _ = svc.frame(seeded.since, {})
    assert svc.last_sync.mode == "events" and frame.set_index("id").loc[str(moving.id), "state_type"] == "RUNNING"
    monkeypatch.setattr(X, "OPEN_REREAD_S", 0.0)
    frame, _ = svc.frame(seeded.since, {})
    assert frame.set_index("id").loc[str(moving.id), "state_type"] == "COMPLETED"
    # renamed within its type (Scheduled -> Late) with no event: a check asks only which runs changed type
    _set_state_without_event(str(late.id), "SCHEDULED", "Late")
    svc.frame(seeded.since, {})
    assert index.frame(ids=[str(late.id)])["state_name"].tolist() == ["Scheduled"]
    monkeypatch.setattr(X, "OPEN_FULL_REREAD_S", 0.0)  # the full read, once every OPEN_FULL_REREAD_S
    svc.frame(seeded.since, {})
    assert index.frame(ids=[str(late.id)])["state_name"].tolist() == ["Late"]
    # without events to rely on (a gap past EVENTS_MAX_GAP_S: catch-up) a sync reads the open runs all the same
    with get_client(sync_client=True) as client:
        lost = client.create_flow_run_from_deployment(dep, tags=["launch", "owner:erin"])
    X.sync(index, api, open_runs=False)  # indexed as a new run due now
    with get_client(sync_client=True) as client:
        client.delete_flow_run(lost.id)
    monkeypatch.setattr(X, "EVENTS_MAX_GAP_S", -1.0)
    res = X.sync(index, api, open_runs=False)
    assert res.mode == "catch-up" and res.deleted == [str(lost.id)]


def test_isin_on_categoricals_equals_pandas():
    """index_view.isin, which tests each category once, answers as pandas' isin does (missing values too)."""
    s = pd.Series(pd.Categorical(["RUNNING", "FAILED", None, "COMPLETED"] * 50))
    for vals in (["FAILED"], ("RUNNING", "COMPLETED"), [], ["NOPE"], {"FAILED", "CRASHED"}):
        assert (IV.isin(s, vals) == s.isin(list(vals)).to_numpy()).all()
    plain = pd.Series(["a", None, "b"])
    assert IV.isin(plain, ["a", "b"]).tolist() == [True, False, True]


def _other_spelling(api_url: str) -> str:
    """The same server by another name (what a second monitor, a proxy or a README might use)."""
    assert "127.0.0.1" in api_url, api_url
    return api_url.replace("127.0.0.1", "localhost")


def test_server_id_is_one_per_server_whatever_its_url(seeded, prefect_server):
    """Two spellings of the server's URL give one identity, kept in a Prefect Variable; monitors
    starting at once on a server that has none yet agree on the one made."""
    import concurrent.futures as cf

    from prefect.variables import Variable

    from prefect_launch.dashboard.api import SERVER_ID_VARIABLE, Api

    a, b = Api(prefect_server), Api(_other_spelling(prefect_server))
    assert a.api_url != b.api_url
    sid = a.server_id()
    assert re.fullmatch(r"[0-9a-f]{32}", sid), sid
    assert b.server_id() == sid == Variable.get(SERVER_ID_VARIABLE)
    # a server without the variable: monitors asking at once make one between them
    before = sid
    Variable.unset(SERVER_ID_VARIABLE)
    try:
        urls = [prefect_server, _other_spelling(prefect_server)] * 3
        with cf.ThreadPoolExecutor(len(urls)) as pool:
            ids = list(pool.map(lambda u: Api(u).server_id(), urls))
        assert len(set(ids)) == 1 and ids[0] == Variable.get(SERVER_ID_VARIABLE) != before
    finally:  # the other tests' indexes were built for the first id
        Variable.set(SERVER_ID_VARIABLE, before, overwrite=True)
    assert Api(prefect_server).server_id() == before
    # a value that is no id is an error that says what to do, not a guess
    Variable.set(SERVER_ID_VARIABLE, "not-an-id", overwrite=True)
    try:
        with pytest.raises(RuntimeError, match="not a server id: delete it"):
            Api(prefect_server).server_id()
    finally:
        Variable.set(SERVER_ID_VARIABLE, before, overwrite=True)


def test_monitors_reaching_one_server_by_two_urls_share_its_index(seeded, prefect_server, tmp_path):
    """A monitor reaching the server by another URL finds the index built and syncs it; it neither
    resets it nor builds again (before v8 each spelling reset the other's index)."""
    from prefect_launch.dashboard.api import Api

    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'spellings.db'}")
    first, second = Api(prefect_server), Api(_other_spelling(prefect_server))
    X.build(RunIndex(store), first, days=1)
    rows = len(RunIndex(store).frame(columns=["id"]))
    assert rows >= len(seeded.run_ids)
    since = dt.datetime.now(UTC) - dt.timedelta(hours=23)
    svc = X.IndexService(RunIndex(store), second)
    assert svc.covers(since)
    covered = RunIndex(store).meta(first.server_id()).covered_since_ms
    X.sync(RunIndex(store), second)  # raised "not built for this server" when the index followed a URL
    assert RunIndex(store).meta(second.server_id()).covered_since_ms == covered  # not reset (a reset clears it)
    assert set(seeded.run_ids) <= set(RunIndex(store).frame(columns=["id"])["id"])
    meta = RunIndex(store).meta(first.server_id())
    assert meta.server_id == second.server_id() and meta.api_url == second.api_url  # synced through the second URL
    X.sync(RunIndex(store), first)  # and back: still the one index
    assert X.IndexService(RunIndex(store), first).covers(since) and svc.covers(since)
    assert len(RunIndex(store).frame(columns=["id"])) >= rows


def test_monitors_agree_again_after_the_server_id_variable_is_deleted(seeded, prefect_server, tmp_path):
    """The Variable deleted while a monitor runs: a monitor started after it makes a new id and builds
    the index under it; the first one follows that id at its next view instead of building again under
    its old one (each build resets the other's index: they fought until the first was restarted)."""
    from prefect.variables import Variable

    from prefect_launch.dashboard.api import SERVER_ID_VARIABLE, Api

    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'deleted-id.db'}")
    since = dt.datetime.now(UTC) - dt.timedelta(hours=23)
    first = Api(prefect_server)
    before = first.server_id()
    X.build(RunIndex(store), first, days=1)
    running = X.IndexService(RunIndex(store), first)
    assert running.covers(since)
    Variable.unset(SERVER_ID_VARIABLE)
    try:
        later = Api(prefect_server)
        made = later.server_id()
        assert made != before and Variable.get(SERVER_ID_VARIABLE) == made
        started = X.IndexService(RunIndex(store), later)
        assert not started.covers(since)  # its id has no index: it builds one
        X.build(started.index, later, days=1)
        covered = RunIndex(store).meta(made).covered_since_ms
        rows = len(RunIndex(store).frame(columns=["id"]))
        assert running.covers(since)  # the running monitor follows the new id: no build of its own
        assert first.server_id() == made
        running.sync_if_due()  # synced under the new id: the index is the one the later monitor built
        assert started.covers(since) and RunIndex(store).meta(made).covered_since_ms == covered
        assert RunIndex(store).meta(before) is None and len(RunIndex(store).frame(columns=["id"])) >= rows
        assert running.status()["built"] and not running.building()
    finally:  # the other tests' indexes were built for the first id
        Variable.set(SERVER_ID_VARIABLE, before, overwrite=True)


def test_a_never_built_store_reads_the_server_id_again_once_per_recheck(prefect_server, tmp_path, monkeypatch):
    """No index under the held id on a store never built: every coverage check would read the server-id
    Variable again (a request on the visit path) though the id has not changed. It is read again at
    most once per ID_RECHECK_S, and once that has passed, again (a deleted Variable is still followed)."""
    from prefect_launch.dashboard.api import SERVER_ID_VARIABLE, Api

    api = Api(prefect_server)
    api.server_id()
    reads: list[str] = []
    api.http.event_hooks["request"].append(
        lambda req: reads.append(req.url.path) if req.url.path.endswith(f"/variables/name/{SERVER_ID_VARIABLE}") else None)
    service = X.IndexService(RunIndex(RunMetricsStore(url=f"sqlite:///{tmp_path / 'never-built.db'}")), api)
    since = dt.datetime.now(UTC) - dt.timedelta(hours=1)
    for _ in range(5):
        assert not service.covers(since)
        assert service.status()["built"] is False
    assert len(reads) == 1  # the first check read it again; the other nine did not
    monkeypatch.setattr(X, "ID_RECHECK_S", 0.0)
    assert not service.covers(since)
    assert len(reads) == 2


def test_an_index_built_before_server_ids_is_adopted_not_rebuilt(tmp_path):
    """A v7 store's meta row names the URL only: the monitor whose URL it names adopts it (the index
    keeps its rows and coverage); a monitor of another URL does not."""
    import sqlalchemy as sa

    from prefect_launch.blocks import metrics_schema as S
    from prefect_launch.blocks.metrics_engines import dispose_engines

    url = f"sqlite:///{tmp_path / 'v7.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        S.ensure_schema(conn, target=7)
        assert "server_id" not in {c["name"] for c in sa.inspect(conn).get_columns("launch_index_meta")}
        conn.exec_driver_sql("INSERT INTO launch_index_meta (api_url, covered_since_ms, events_cursor_ms, last_sync_ms) "
                             "VALUES ('http://127.0.0.1:4200/api', 1000, 2000, 3000)")
        conn.exec_driver_sql("INSERT INTO launch_run_index (id, state_type, synced_ms) VALUES ('r1', 'COMPLETED', 1)")
    engine.dispose()
    dispose_engines()
    index = RunIndex(RunMetricsStore(url=url))
    assert index.store.schema_version() == 10
    assert index.meta("a" * 32, "http://localhost:4200/api") is None  # another URL: not this row
    m = index.meta("a" * 32, "http://127.0.0.1:4200/api")
    assert (m.server_id, m.covered_since_ms, m.events_cursor_ms, m.last_sync_ms) == ("a" * 32, 1000, 2000, 3000)
    assert index.meta("a" * 32).covered_since_ms == 1000  # adopted: found by the id alone from now on
    assert index.meta("b" * 32, "http://127.0.0.1:4200/api") is None  # another server at that URL later: not it
    assert set(index.frame(columns=["id"])["id"]) == {"r1"}


def test_the_run_tables_show_who_launched_a_run_for_its_owner():
    """The gateway's launched_by: tag (an admin launching for alice) reaches the index row and the monitor's run
    table; a run alice launched herself shows none."""
    now = dt.datetime(2026, 1, 1, 1, tzinfo=dt.timezone.utc)
    row = IndexRow.from_flow_run({"id": "a", "tags": ["owner:alice", "launched_by:root"], "state_type": "RUNNING"})
    own = IndexRow.from_flow_run({"id": "b", "tags": ["owner:alice"], "state_type": "RUNNING"})
    assert (row.owner, row.launched_by, own.launched_by) == ("alice", "root", None)
    raw = pd.DataFrame([dict(r.model_dump(), synced_ms=0) for r in (row, own)])
    table = F.runs_frame(IV.prepare(raw, {}), raw, now).set_index("id")
    assert "launched_by" in F.RUN_COLUMNS
    assert table.loc["a", "launched_by"] == "root" and table.loc["b", "launched_by"] == ""


def test_open_and_terminal_state_types_are_every_prefect_state_type(tmp_path):
    """The index asks for the runs that can still change by name (``OPEN``, served by its state index);
    with Prefect's terminal types they must be every type Prefect has, or runs in a new one would never be
    read again. And the open runs it reads are exactly the non-terminal rows of a real store."""
    from prefect.client.schemas.objects import StateType

    from prefect_launch.blocks import run_index as RI

    assert set(RI.OPEN) | set(RI.TERMINAL) == {t.value for t in StateType}
    assert not set(RI.OPEN) & set(RI.TERMINAL)
    idx = RunIndex(RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}"))
    now = dt.datetime.now(dt.timezone.utc)
    rows = [IndexRow(id=str(uuid.uuid4()), state_type=t.value, expected_start_us=RI.to_us(now))
            for t in StateType]
    idx.upsert(rows)
    got = idx.open_ids_by_type()
    assert {k: sorted(v) for k, v in got.items()} == {
        r.state_type: [r.id] for r in rows if r.state_type not in RI.TERMINAL}


def test_select_without_filters_gives_every_row_and_writes_to_it_stay_its_own():
    """The default view filters nothing: select then hands the rows on without copying them, and a write to
    what it gave does not reach the rows it was given (pandas' copy-on-write)."""
    rows = IV.prepare(_raw([dict(id="a", queue="q1", state_type="COMPLETED", expected_start_us=10),
                            dict(id="b", queue="q2", state_type="RUNNING", expected_start_us=20)]), {})
    spec = S.ViewSpec(since=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), until=dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc))
    got = IV.select(rows, spec, time=False)
    pd.testing.assert_frame_equal(got, rows)
    got.loc[got.index[0], "queue"] = "q2"
    got["extra"] = 1
    assert rows["queue"].tolist() == ["q1", "q2"] and "extra" not in rows
    assert IV.select(rows, S.ViewSpec(since=spec.since, until=spec.until, queues=("q2",)), time=False)["id"].tolist() == ["b"]
    assert IV.select(rows, spec).empty  # expected starts far before the range
