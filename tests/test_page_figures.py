"""The page's figures over every cost row (dashboard/page_figures.py): made once per page, ahead of the visits.

Pure: a PageData built from frames, no server. The figures are checked against sums of the raw cost
rows written here, and against the cost module's own producers (which ``test_cost.py`` checks against
a real agent's samples).
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from prefect_launch.dashboard import cost as C
from prefect_launch.dashboard import occupancy_panels as OP
from prefect_launch.dashboard import page_figures as PF
from prefect_launch.dashboard.page_data import PageData
from prefect_launch.dashboard.spec import ViewSpec
from prefect_launch.dashboard.view import View

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 12, 6, 12, tzinfo=UTC)
EMPTY = pd.DataFrame()


def _rows() -> pd.DataFrame:
    """Cost rows of 6 runs: 3 owners, GPU runs measured or not, one CPU-only run."""
    raw = [  # owner, job, gpus, held h, gpu used h (None: not measured), cpus, cpu used h, energy source
        ("ana", "train", 2, 3.0, 1.5, 4, 2.0, "nvml"),
        ("ana", "eval", 1, 1.0, None, 2, 1.0, None),
        ("bo", "train", 4, 2.0, 8.0, 8, 4.0, "nvml"),
        ("bo", "train", 0, 5.0, None, 2, 0.5, None),
        ("cy", "eval", 1, 4.0, 0.4, 1, 0.2, "nvml"),
        ("cy", "train", 2, 1.0, 2.0, 2, 2.0, "nvml"),
    ]
    rows = []
    for k, (owner, job, gpus, h, gused, cpus, cused, src) in enumerate(raw):
        rows.append(dict(id=f"run-{k}", run=f"r{k}", job=job, owner=owner, queue="q1", preset="p", state="COMPLETED",
                         start=NOW - dt.timedelta(hours=6), end=NOW, hours=h, gpus=float(gpus), cpus=float(cpus),
                         memory_request_gib=1.0, gpu_alloc_h=gpus * h, gpu_used_h=np.nan if gused is None else gused,
                         cpu_alloc_h=cpus * h, cpu_used_h=cused, peak_memory_gib=1.0, mean_memory_gib=0.5,
                         gpu_energy_wh=100.0 if src else np.nan, cpu_energy_wh=np.nan,
                         gpu_energy_source=src if gpus else None, cpu_energy_source="unavailable: not recorded",
                         samples=10, source="summary"))
    return pd.DataFrame(rows, columns=C.RUN_COLUMNS)


def _page(costs, owners=(), grouping="owner", error=None) -> PageData:
    spec = ViewSpec(since=NOW - dt.timedelta(days=1), until=NOW, grouping=grouping, owners=owners)
    occ = OP.Occupancy(interval_s=3600, status=EMPTY, queued=EMPTY, load=EMPTY, idle=EMPTY, heatmap=EMPTY, runs=0,
                       share={}, capacity={"gpu": 8.0, "cpu": 16.0})
    view = View(spec=spec, now=NOW, interval_s=3600, pools=EMPTY, hist=EMPTY, runs=EMPTY, runs_total=0, errors=EMPTY,
                now_counts=EMPTY, workers=EMPTY, agents=EMPTY, metrics=EMPTY, ui_base="", occupancy=occ)
    return PageData(view=view, costs=costs, costs_error=error)


def test_prime_makes_the_default_figures_once_and_they_equal_the_raw_rows():
    rows = _rows()
    p = _page(rows, owners=("ana", "bo"))
    PF.prime(p)
    assert set(p.view.drawn) == {("view_costs",), ("capacity_used",), ("cost_panel", "owner")}
    made = p.view.drawn[("cost_panel", "owner")]
    mine = rows[rows["owner"].isin(["ana", "bo"])]  # the sidebar's owners only
    # ground truth from the rows: GPU-hours held, the measured GPU runs' idle share, capacity used
    assert made.table.iloc[-1]["gpu_alloc_h"] == pytest.approx(float((mine["gpus"] * mine["hours"]).sum())) == 6 + 1 + 8
    measured = mine[(mine["gpus"] > 0) & mine["gpu_used_h"].notna()]
    alloc = float(measured["gpu_alloc_h"].sum())
    assert made.idle_pct == pytest.approx(100 * (alloc - float(measured["gpu_used_h"].sum())) / alloc)
    assert list(made.table["owner"]) == ["bo", "ana", "total"]  # most GPU-hours held first
    assert made.notes == ["GPU energy: nvml (2 runs)", "CPU energy: unavailable: not recorded (4 runs)"]
    # wasters: measured idle GPU-hours first (run-0: 1.5, run-2: 0), then the rest by idle core-hours (run-3: 9.5,
    # run-1: 1); run-4 and run-5 are cy's (not in the view)
    assert list(made.wasters["id"]) == ["run-0", "run-2", "run-3", "run-1"]
    used = p.view.drawn[("capacity_used",)]
    assert used["gpu"] == pytest.approx(100 * float(mine["gpu_used_h"].sum()) * 3600 / (8.0 * 86400))
    # a visit asking again gets the same objects: nothing is made twice within the page
    assert PF.cost_panel(p, "owner") is made and PF.view_costs(p)[0] is p.view.drawn[("view_costs",)]
    by_job = PF.cost_panel(p, "job")  # another choice is made when asked, and kept beside the first
    assert by_job is not made and set(by_job.table["job"]) == {"train", "eval", "total"}
    assert PF.cost_panel(p, "job") is by_job


def test_the_default_by_follows_the_sidebar_and_an_unread_store_makes_nothing():
    assert PF.default_by("job") == "job" and PF.default_by("preset") == C.BY[0]
    p = _page(_rows(), grouping="job")
    PF.prime(p)
    assert ("cost_panel", "job") in p.view.drawn
    broken = _page(None, error="store down: connection refused")
    PF.prime(broken)
    assert PF.view_costs(broken) == (None, "store down: connection refused")
    assert PF.cost_panel(broken, "owner") is None and ("cost_panel", "owner") not in broken.view.drawn
    assert broken.view.drawn[("capacity_used",)] == {"gpu": None, "cpu": None}


def test_once_builds_each_named_thing_once_and_unnamed_ones_each_time():
    p = _page(_rows())
    made = []
    for _ in range(3):
        PF.once(p.view, ("x",), lambda: made.append("x") or len(made))
        PF.once(p.view, None, lambda: made.append("brushed") or len(made))
    assert made == ["x", "brushed", "brushed", "brushed"] and p.view.drawn[("x",)] == 1


def test_a_failure_making_the_figures_ahead_fails_no_read_and_the_panel_meets_it(caplog):
    broken = _rows().drop(columns=["gpu_alloc_h"])  # a cost frame the table cannot be made from
    p = _page(broken)
    PF.prime(p)  # does not raise: the page read stands
    assert ("cost_panel", "owner") not in p.view.drawn and "failed" in caplog.text
    with pytest.raises(KeyError):  # the cost panel, drawing it, meets the error (and the page shows it there)
        PF.cost_panel(p, "owner")


def test_prime_makes_the_first_pages_charts_and_runs_table_as_a_visit_would():
    """The keeper also makes what the default page sends of a view (load, status and queued charts, the Job
    runs chart, the runs table): each the same bytes / rows a visit would build from the view, and a visit
    then gets that same object (nothing built twice)."""
    from prefect_launch.blocks.run_index import IndexRow
    from prefect_launch.dashboard import chart_data as CD
    from prefect_launch.dashboard import frames as F
    from prefect_launch.dashboard import index_view as IV
    from prefect_launch.dashboard.api import run_url

    t0 = NOW - dt.timedelta(hours=3)
    at = lambda h: IV.us(t0 + dt.timedelta(hours=h))  # noqa: E731
    runs = [dict(id=f"r{k}", name=f"run-{k}", queue="q1", owner=owner, state_type=state, expected_start_us=at(k),
                 queued_us=at(k), pending_us=at(k + 0.1), start_us=at(k + 0.2), end_us=at(k + 1) if state == "COMPLETED" else None,
                 gpu=1, cpu=2, placement=f"agent a1: cpu=2,memory=1Gi,gpu=1; gpus {k}; cores {k}")
            for k, (owner, state) in enumerate([("ana", "COMPLETED"), ("bo", "COMPLETED"), ("ana", "RUNNING")])]
    rows = IV.prepare(pd.DataFrame([dict(IndexRow(**r).model_dump(), synced_ms=0) for r in runs]), {})
    spec = ViewSpec(since=NOW - dt.timedelta(hours=6), until=NOW, grouping="owner")
    occ = OP.compute(rows, rows["owner"].astype(object), spec.since, spec.until, 600, NOW)
    listed = pd.DataFrame(dict(id=[r["id"] for r in runs], name=[r["name"] for r in runs], job="train",
                               owner=[r["owner"] for r in runs], launched_by="", queue="q1", priority="", preset="p",
                               state_name=["Completed", "Completed", "Running"], queued_s=360.0, duration_s=2880.0,
                               start=[pd.Timestamp(r["start_us"], unit="us", tz="UTC") for r in runs],
                               end=[pd.Timestamp(r["end_us"], unit="us", tz="UTC") if r["end_us"] else pd.NaT for r in runs]))
    view = View(spec=spec, now=NOW, interval_s=600, pools=EMPTY, hist=EMPTY, runs=listed, runs_total=3, errors=EMPTY,
                now_counts=EMPTY, workers=EMPTY, agents=EMPTY, metrics=EMPTY, ui_base="http://ui", occupancy=occ)
    p = PageData(view=view, costs=None, costs_error="not read")
    PF.prime(p)
    assert {("load_chart",), ("status_chart",), ("queued_chart",), ("gantt_frame",), ("gantt",), ("runs_table",)} <= set(view.drawn)
    assert view.drawn[("load_chart",)] == CD.load_payload(occ.load, occ.capacity.get("gpu"), spec.since, spec.until, 600).packed()
    assert view.drawn[("status_chart",)] == CD.status_payload(occ.status, spec.since, spec.until, 600).packed()
    g = F.gantt_frame(listed, NOW)
    assert view.drawn[("gantt",)] == CD.gantt_payload(g, "owner", spec.since, spec.until).packed()
    table = view.drawn[("runs_table",)]
    assert list(table["name"]) == list(g["name"]) and list(table["link"]) == [run_url("http://ui", i) for i in g["id"]]
    assert PF.runs_table(view, PF.gantt_rows(view), False) is table and PF.load_chart(view) is view.drawn[("load_chart",)]
    assert PF.runs_chart(view, [1.0, 2.0]) != view.drawn[("gantt",)]  # a brushed chart is made for its visit
