"""Data functions of the queue monitor, checked against a real Prefect server's runs."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
import math
import uuid

import pandas as pd
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.states import Running

from prefect_launch.dashboard import api_cache
from prefect_launch.dashboard import api as A
from prefect_launch.dashboard import api_cache as AC
from prefect_launch.dashboard import frames as F
from prefect_launch.dashboard import metrics_source as M
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import view as V
from fixtures_dashboard import seed_runs

UTC = dt.timezone.utc


@pytest.fixture(scope="module")
def seeded(prefect_server):
    return seed_runs(uuid.uuid4().hex[:6])


def _client_runs(ids) -> list[FlowRun]:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(i) for i in ids])))


def _spec(seeded, **kw) -> S.ViewSpec:
    now = dt.datetime.now(UTC)
    return S.ViewSpec(since=seeded.since, until=now + dt.timedelta(minutes=1), queues=(seeded.pool,), interval_s=300, **kw)


def test_history_totals_and_queued_time_match_run_timestamps(seeded):
    v = V.load_view(_spec(seeded), use_cache=False, store=None)
    runs = _client_runs(seeded.run_ids)
    assert v.totals["runs"] == len(seeded.run_ids)
    # queued time per run = start - expected start (still waiting: now - expected start)
    finished_or_started = [r for r in runs if r.start_time is not None]
    expected_started = sum((r.start_time - r.expected_start_time).total_seconds() for r in finished_or_started)
    qt = F.queued_time(v.hist)
    started_types = {"COMPLETED", "FAILED", "RUNNING"}
    got_started = v.hist[v.hist["state_type"].isin(started_types)]["queued_s"].sum()
    assert math.isclose(got_started, expected_started, abs_tol=1.0 * len(finished_or_started))
    # 10 runs x 60 s == 600 s: the panel's sum is the sum over runs, per bucket
    assert math.isclose(qt["queued_s"].sum(), v.hist["queued_s"].sum())
    assert expected_started > 60 * 9  # runs waited 1..n minutes


def test_state_counts_per_bucket_match_runs(seeded):
    spec = _spec(seeded)
    v = V.load_view(spec, use_cache=False, store=None)
    runs = _client_runs(seeded.run_ids)
    start, _ = S.aligned_range(spec.since, spec.until, spec.interval)
    rows = []
    for r in runs:
        k = math.floor((r.expected_start_time - start).total_seconds() / spec.interval)
        rows.append((start + dt.timedelta(seconds=k * spec.interval), S.STATUS_OF_TYPE[r.state_type.value]))
    want = pd.DataFrame(rows, columns=["bucket", "status"]).value_counts().sort_index()
    got = F.status_counts(v.hist).set_index(["bucket", "status"])["count"].sort_index()
    got.index = got.index.set_levels(pd.to_datetime(got.index.levels[0]).tz_convert(UTC).to_pydatetime(), level=0)
    assert {(pd.Timestamp(b), s): n for (b, s), n in want.items()} == {(pd.Timestamp(b), s): n for (b, s), n in got.items()}
    assert set(got.index.get_level_values("status")) >= {"completed", "failed", "running", "queued"}


def test_gantt_spans_equal_run_timestamps(seeded):
    v = V.load_view(_spec(seeded), use_cache=False, store=None)
    g = F.gantt_frame(v.runs, v.now).set_index("id")
    runs = {str(r.id): r for r in _client_runs(seeded.run_ids)}
    started = {i: r for i, r in runs.items() if r.start_time is not None}
    assert set(g.index) == set(started)
    for i, r in started.items():
        assert g.loc[i, "start"] == pd.Timestamp(r.start_time)
        if r.end_time is not None:
            assert g.loc[i, "bar_end"] == pd.Timestamp(r.end_time)
            assert math.isclose(g.loc[i, "duration_s"], (r.end_time - r.start_time).total_seconds(), abs_tol=1e-3)
        else:
            assert g.loc[i, "bar_end"] == pd.Timestamp(v.now)
        assert math.isclose(g.loc[i, "queued_s"], (r.start_time - r.expected_start_time).total_seconds(), abs_tol=1e-3)


def test_grouping_by_owner_and_job_splits_the_total(seeded):
    runs = _client_runs(seeded.run_ids)
    for grouping, key in (("owner", lambda r: next(t[6:] for t in r.tags if t.startswith("owner:"))),
                          ("job", None)):
        v = V.load_view(_spec(seeded, grouping=grouping), use_cache=False, store=None)
        per = v.hist.groupby("group")["count"].sum().to_dict()
        assert sum(per.values()) == len(runs)
        if key:
            want = pd.Series([key(r) for r in runs]).value_counts().to_dict()
            assert per == want
        else:
            assert per == {seeded.jobs[0]: (len(runs) + 1) // 2, seeded.jobs[1]: len(runs) // 2}


def test_filters_narrow_every_panel(seeded):
    v = V.load_view(_spec(seeded, owners=("alice",), statuses=("failed",)), use_cache=False, store=None)
    runs = [r for r in _client_runs(seeded.run_ids)
            if "owner:alice" in r.tags and r.state_type.value == "FAILED"]
    assert v.totals["runs"] == len(runs) == len(v.runs)
    assert set(v.runs["owner"]) <= {"alice"} and set(v.runs["status"]) <= {"failed"}
    assert set(v.errors["id"]) == {str(r.id) for r in runs}


def test_errors_newest_first_with_message(seeded):
    v = V.load_view(_spec(seeded), use_cache=False, store=None)
    e = v.errors
    assert set(e["id"]) == set(seeded.failed_ids)
    assert list(e["time"]) == sorted(e["time"], reverse=True)
    assert all("loss is NaN" in m for m in e["message"])


def test_now_counts_and_summary(seeded):
    v = V.load_view(_spec(seeded), use_cache=False, store=None)
    row = v.now_counts.set_index("queue").loc[seeded.pool]
    assert (row["queued"], row["running"]) == (len(seeded.queued_ids), len(seeded.running_ids))
    assert seeded.pool in set(v.pools["queue"])
    assert v.pools.set_index("queue").loc[seeded.pool, "type"] == "launch-process"


def test_metrics_join_and_waste(seeded):
    v = V.load_view(_spec(seeded), use_cache=False)
    m = v.metrics
    finished = [i for i in seeded.run_ids if i not in seeded.running_ids + seeded.queued_ids]
    assert set(m["id"]) == set(finished)
    assert m["wasteful"].any() and not m["wasteful"].all()
    w = M.waste_frame(m)
    assert set(w["id"]) == set(m[m["wasteful"]]["id"])


def test_incremental_refresh_reads_new_and_open_runs(seeded):
    AC.RUN_CACHE.clear()
    AC.HISTORY_CACHE.clear()
    spec = _spec(seeded)
    v1 = V.load_view(spec, use_cache=True, store=None)
    assert not v1.incremental
    running = seeded.running_ids[0]
    with get_client(sync_client=True) as client:
        from prefect.states import Completed

        client.set_flow_run_state(uuid.UUID(running), Completed(), force=True)
        dep = client.read_flow_run(uuid.UUID(seeded.run_ids[0])).deployment_id
        new = client.create_flow_run_from_deployment(dep, tags=["launch", "owner:carol", "preset:small"])
        client.set_flow_run_state(new.id, Running(), force=True)
    v2 = V.load_view(spec, use_cache=True, store=None)
    assert v2.incremental
    by_id = v2.runs.set_index("id")
    assert by_id.loc[running, "status"] == "completed"  # an open run was read again
    assert str(new.id) in by_id.index  # a new run was picked up
    assert v2.totals["runs"] == v1.totals["runs"] + 1
    seeded.run_ids.append(str(new.id))
    seeded.running_ids[:] = [str(new.id)]


# ----------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("span,interval", [(dt.timedelta(days=7), 3600), (dt.timedelta(hours=24), 600),
                                           (dt.timedelta(hours=1), 60)], ids=["7d", "24h", "1h"])
def test_interval_follows_the_span(span, interval):
    now = dt.datetime(2026, 1, 5, 12, 34, 56, tzinfo=UTC)
    assert S.interval_for(now - span, now) == interval


def test_alignment():
    now = dt.datetime(2026, 1, 5, 12, 34, 56, tzinfo=UTC)
    s, e = S.aligned_range(now - dt.timedelta(days=1), now, 900)
    assert s.timestamp() % 900 == 0 and e.timestamp() % 900 == 0 and s <= now - dt.timedelta(days=1) and e >= now


def test_queued_and_duration_rule_written_once():
    """The one rule both the run tables and the history's queued seconds use."""
    import numpy as np

    now = 1_000_000_000.0
    s = 1e6
    exp = np.array([0, 0, 0, 500 * s, 10 * s, 0, now + 60 * s])
    start = np.array([60 * s, 60 * s, np.nan, np.nan, 5 * s, np.nan, np.nan])
    end = np.array([160 * s, np.nan, np.nan, np.nan, 20 * s, np.nan, np.nan])
    terminal = np.array([True, False, False, False, True, True, False])
    q, d = F.queued_and_duration(exp, start, end, terminal, now)
    # finished; running; waiting since 0; waiting since 500 s; started early (never below 0);
    # cancelled before it started; due later
    assert q.tolist() == [60, 60, now / s, now / s - 500, 0, 0, 0]
    assert d[:2].tolist() == [100, now / s - 60] and d[4] == 15 and np.isnan(d[[2, 3, 5, 6]]).all()


def test_tag_combos_and_subtract():
    now = dt.datetime.now(UTC)
    spec = S.ViewSpec(since=now, until=now, owners=("a", "b"), presets=("x",))
    assert A.tag_combos(spec) == [("owner:a", "preset:x"), ("owner:b", "preset:x")]
    total = A.history_from_api([{"interval_start": "2026-01-01T00:00:00Z", "states": [
        {"state_type": "COMPLETED", "count_runs": 5, "sum_estimated_run_time": 50, "sum_estimated_lateness": 10}]}])
    part = A.history_from_api([{"interval_start": "2026-01-01T00:00:00Z", "states": [
        {"state_type": "COMPLETED", "count_runs": 3, "sum_estimated_run_time": 30, "sum_estimated_lateness": 4}]}], "a")
    rest = F.subtract_groups(total, part, "other")
    assert rest[["count", "run_s", "queued_s"]].iloc[0].tolist() == [2, 20.0, 6.0]


def test_run_url_uses_ui_base(monkeypatch):
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    api = A.Api("http://127.0.0.1:4200/api")
    assert A.run_url(api.ui_url(), "abc") == "http://127.0.0.1:4200/runs/flow-run/abc"
    monkeypatch.setenv("PREFECT_UI_URL", "https://prefect.example.com")
    assert api.ui_url() == "https://prefect.example.com"


def test_filter_change_derives_runs_from_the_wider_view(seeded, monkeypatch):
    """A narrower filter after a wider view: its runs come from the held ones and equal a fresh read."""
    V.clear_caches()
    wide = _spec(seeded)
    V.load_view(wide, use_cache=True, store=None)
    reads = []
    real = api_cache.fetch_runs
    monkeypatch.setattr(api_cache, "fetch_runs", lambda *a, **k: reads.append(k) or real(*a, **k))
    for narrow in (replace(wide, owners=("alice",)), replace(wide, jobs=(seeded.jobs[1],)),
                   replace(wide, statuses=("failed", "running"), grouping="owner")):
        reads.clear()
        v = V.load_view(narrow, use_cache=True, store=None)
        # the wider view held every run of the range (fewer than detail_limit): none read again
        assert reads == []
        fresh = V.load_view(narrow, use_cache=False, store=None)
        assert len(v.runs) > 0
        assert sorted(zip(v.runs["id"], v.runs["status"])) == sorted(zip(fresh.runs["id"], fresh.runs["status"]))
        assert v.totals["runs"] == fresh.totals["runs"] == len(v.runs)
    V.clear_caches()


def test_narrows_and_run_matches():
    now = dt.datetime.now(UTC)
    wide = S.ViewSpec(since=now, until=now, queues=("a", "b"))
    assert S.narrows(wide, replace(wide, queues=("a",), owners=("x",)))
    assert not S.narrows(wide, replace(wide, queues=()))
    assert not S.narrows(replace(wide, owners=("x",)), replace(wide, owners=("y",)))
    r = {"work_pool_name": "a", "tags": ["owner:x", "preset:p"], "deployment_id": "d", "state_type": "FAILED"}
    deps = {"d": {"name": "train", "pool": "b"}}
    assert A.run_matches(r, replace(wide, owners=("x",), jobs=("train",), statuses=("failed",), presets=("p",)), deps)
    assert not A.run_matches(r, replace(wide, queues=("b",)), deps)
    assert not A.run_matches(r, replace(wide, statuses=("completed",)), deps)


def test_filters_note_names_each_filter_in_force():
    from prefect_launch.dashboard import spec as S

    t = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    assert S.ViewSpec(since=t, until=t).filters_note() == ""
    spec = S.ViewSpec(since=t, until=t, queues=("gpu-a", "gpu-b"), owners=("ana",), statuses=("failed",))
    assert spec.filters_note() == "queues gpu-a, gpu-b · owners ana · statuses failed"
