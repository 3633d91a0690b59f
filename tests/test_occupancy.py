"""Occupancy's pure functions on hand-built runs (no server): every number below is
worked out by hand from the runs' phase times."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from prefect_launch.blocks.run_index import IndexRow
from prefect_launch.dashboard import index_view as IV
from prefect_launch.dashboard import occupancy as OC
from prefect_launch.dashboard import occupancy_lanes as OL
from prefect_launch.dashboard import occupancy_panels as OP

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 5, 10, 0, tzinfo=UTC)  # a Monday
S = 1_000_000  # one second in microseconds


def at(sec: float) -> int:
    return IV.us(T0) + int(sec * S)


def frame(rows: list[dict]) -> pd.DataFrame:
    raw = pd.DataFrame([dict(IndexRow(**r).model_dump(), synced_ms=0) for r in rows])
    return IV.prepare(raw, {})


# queued 0-25, pending 25-30, running 30-130 (held 25-130), 1 GPU, cores 0,1
LONG = dict(id="long", name="long", queue="q", owner="alice", state_type="COMPLETED", expected_start_us=at(0), queued_us=at(0),
            pending_us=at(25), start_us=at(30), end_us=at(130), gpu=1, cpu=2,
            placement="agent a1: cpu=2,memory=1Gi,gpu=1; gpus 1; cores 0,1")
# queued 95-100, no pending seen, running 100-105, failed
SHORT = dict(id="short", name="short", queue="q", owner="bob", state_type="FAILED", expected_start_us=at(95), start_us=at(100),
             end_us=at(105), gpu=0, cpu=1, placement="agent a1: cpu=1,memory=1Gi,gpu=0; gpus none; cores 2")
# still waiting since 110 (now = 140)
WAITING = dict(id="wait", name="wait", queue="q", owner="bob", state_type="SCHEDULED", expected_start_us=at(110), queued_us=at(110))
# running since 120, claimed at 118, entered its queue (rescheduled) at 112 though first expected at 0
RUNNING = dict(id="run", name="run", queue="q", owner="alice", state_type="RUNNING", expected_start_us=at(0), queued_us=at(112),
               pending_us=at(118), start_us=at(120), gpu=2, cpu=1, placement="agent a2: cpu=1,memory=1Gi,gpu=2; gpus 0,1; cores 0")
NOW = T0 + dt.timedelta(seconds=140)


@pytest.fixture
def rows() -> pd.DataFrame:
    return frame([LONG, SHORT, WAITING, RUNNING])


def test_phases_from_state_times(rows):
    ph = OC.phases(rows, IV.us(NOW)).set_index(rows["id"])
    sec = lambda v: None if np.isnan(v) else (v - IV.us(T0)) / S  # noqa: E731
    got = {i: tuple(sec(ph.loc[i, c]) for c in ("q0", "q1", "p0", "p1", "r0", "r1", "h0", "h1")) for i in ph.index}
    assert got["long"] == (0, 25, 25, 30, 30, 130, 25, 130)
    assert got["short"] == (95, 100, None, None, 100, 105, 100, 105)
    assert got["wait"] == (110, 140, None, None, None, None, None, None)
    assert got["run"] == (112, 118, 118, 120, 120, 140, 118, 140)


def test_status_counts_at_any_moment_and_finished_in_bucket(rows):
    b = OC.Buckets.aligned(T0, NOW, 20)  # 7 buckets: 0-20, 20-40, ..., 120-140
    assert (b.n, b.lo_us) == (7, IV.us(T0))
    ph = OC.phases(rows, IV.us(NOW))
    st = OC.status_frame(rows, ph, b)
    k = lambda sec: pd.Timestamp(T0 + dt.timedelta(seconds=sec))  # noqa: E731
    c = st.set_index(["bucket", "status"])["count"].to_dict()
    avg = st.set_index(["bucket", "status"])["avg"].to_dict()
    # the long run (30-130) counts as running in all six buckets it touches; short adds 100-105, run 120-140
    assert [c.get((k(s), "running"), 0) for s in range(0, 140, 20)] == [0, 1, 1, 1, 1, 2, 2]
    assert [c.get((k(s), "queued"), 0) for s in range(0, 140, 20)] == [1, 1, 0, 0, 1, 2, 1]
    assert [c.get((k(s), "pending"), 0) for s in range(0, 140, 20)] == [0, 1, 0, 0, 0, 1, 0]
    assert c[(k(120), "completed")] == 1 and c[(k(100), "failed")] == 1 and (k(120), "failed") not in c
    # time-weighted: queued 0-25 is 20 s of bucket 0 and 5 s of bucket 20
    assert avg[(k(0), "queued")] == pytest.approx(1.0) and avg[(k(20), "queued")] == pytest.approx(0.25)
    # bucket 100-120: wait queued 110-120 (10 s) + run queued 112-118 (6 s) -> 16/20; short queued 95-100 (0 s here)
    assert avg[(k(100), "queued")] == pytest.approx(0.8)
    assert avg[(k(120), "running")] == pytest.approx((10 + 20) / 20)


def test_queued_time_spreads_waits_over_buckets_with_counts_and_means(rows):
    b = OC.Buckets.aligned(T0, NOW, 20)
    ph = OC.phases(rows, IV.us(NOW))
    q = OC.queued_frame(ph, rows["owner"], b)
    k = lambda sec: pd.Timestamp(T0 + dt.timedelta(seconds=sec))  # noqa: E731
    got = q.set_index(["bucket", "group"])
    assert got.loc[(k(0), "alice"), "queued_s"] == pytest.approx(20) and got.loc[(k(20), "alice"), "queued_s"] == pytest.approx(5)
    assert got.loc[(k(80), "bob"), ["queued_s", "runs"]].tolist() == [pytest.approx(5), 1]
    # bob: short 95-100 (0 s in 100-120, does not count) + wait 110-120
    assert got.loc[(k(100), "bob"), ["queued_s", "runs", "mean_s"]].tolist() == [pytest.approx(10), 1, pytest.approx(10)]
    assert got.loc[(k(100), "alice"), "queued_s"] == pytest.approx(6)
    assert got.loc[(k(120), "bob"), "queued_s"] == pytest.approx(20)
    assert q["queued_s"].sum() == pytest.approx(25 + 5 + 30 + 6)  # every waiting second once


def test_load_idle_capacity_and_heatmap(rows):
    b = OC.Buckets.aligned(T0 - dt.timedelta(seconds=40), NOW, 20)  # two empty buckets first
    ph = OC.phases(rows, IV.us(NOW))
    ld = OC.load_frame(rows, ph, b).set_index("bucket")
    k = lambda sec: pd.Timestamp(T0 + dt.timedelta(seconds=sec))  # noqa: E731
    assert ld.loc[k(20), "run_s"] == pytest.approx(15) and ld.loc[k(20), "gpu_s"] == pytest.approx(15)
    # 100-120: long held all 20 s (1 GPU), short 100-105 (0 GPU, 1 CPU), run held 118-120 (2 GPUs)
    assert ld.loc[k(100), "gpu_s"] == pytest.approx(20 + 4) and ld.loc[k(100), "cpu_s"] == pytest.approx(40 + 5 + 2)
    assert ld.loc[k(100), "held"] == 3 and ld.loc[k(100), "waiting"] == 2  # short left its queue at 100
    idle = OC.idle_periods(ld.reset_index(), 20)
    assert list(idle["from"]) == [k(-40)] and list(idle["to"]) == [k(20)] and idle["waiting"].iloc[0] == 1
    cap = OC.capacity(pd.DataFrame([dict(agent="a1", queue="q", online=True, gpu=2, cpu=4),
                                    dict(agent="a1", queue="q2", online=True, gpu=2, cpu=4),  # same agent, other queue
                                    dict(agent="a2", queue="q", online=True, gpu=2, cpu=4),
                                    dict(agent="a3", queue="q", online=False, gpu=8, cpu=64)]))
    assert cap == dict(gpu=4.0, cpu=8.0)
    share = OC.capacity_share(ld.reset_index(), cap, 140)
    gpu_s = 105 * 1 + 22 * 2  # long held 25-130, run held 118-140
    assert share["gpu"] == pytest.approx(100 * gpu_s / (4 * 140))
    hm = OC.heatmap(rows, ph, T0, NOW)
    assert list(hm[["weekday", "hour"]].itertuples(index=False, name=None)) == [("Mon", 10)]
    held_s = 105 + 5 + 22
    assert hm["busy"].iloc[0] == pytest.approx(held_s / 3600)


def test_interval_maths_against_a_brute_force_count():
    rng = np.random.default_rng(7)
    b = OC.Buckets(lo_us=0, step_s=10, n=50)
    s = rng.uniform(-100, 500, 400)
    e = s + rng.exponential(40, 400)
    e[::7] = s[::7]  # empty intervals count nowhere
    w = rng.integers(0, 4, 400).astype(float)
    codes = rng.integers(0, 3, 400)
    cnt = OC.present(s * S, e * S, b, codes, 3)
    sec = OC.seconds_in(s * S, e * S, b, w, codes, 3)
    for g in range(3):
        for kk in range(b.n):
            lo, hi = kk * 10, kk * 10 + 10
            m = (codes == g) & (e > s)
            assert cnt[g, kk] == int(((s[m] < hi) & (e[m] > lo)).sum())
            assert sec[g, kk] == pytest.approx(float((w[m] * np.clip(np.minimum(e[m], hi) - np.maximum(s[m], lo), 0, None)).sum()),
                                               abs=1e-6)


def test_lanes_per_agent_and_device_merge_below_the_gap(rows):
    ph = OC.phases(rows, IV.us(NOW))
    seg = OL.lanes(rows, ph, rows["owner"], IV.us(T0), IV.us(NOW), gap_s=1)
    got = {(r.lane, r.name) for r in seg.itertuples()}
    assert got == {("a1 · gpu 1", "long"), ("a1 · core 2", "short"), ("a2 · gpu 0", "run"), ("a2 · gpu 1", "run")}
    # two back-to-back runs of one owner on one GPU merge into a segment of 2 runs; another owner's does not
    more = frame([dict(LONG, id=f"r{i}", name=f"r{i}", owner="alice" if i < 2 else "bob", pending_us=None,
                       queued_us=at(10 * i), expected_start_us=at(10 * i), start_us=at(10 * i + 1), end_us=at(10 * i + 10))
                  for i in range(3)])
    seg = OL.lanes(more, OC.phases(more, IV.us(NOW)), more["owner"], IV.us(T0), IV.us(NOW), gap_s=2)
    assert seg[["group", "runs"]].values.tolist() == [["alice", 2], ["bob", 1]]


def test_merged_row_keeps_the_latest_scheduling_before_start_and_the_first_claim_after_it():
    fresh = IndexRow(id="x", state_type="COMPLETED", expected_start_us=at(0), start_us=at(50), end_us=at(90))
    # scheduled at 0, claimed at 5, released and rescheduled at 20, claimed again at 40; retried in-process at 70
    row = fresh.merged(None, scheduled_us=[at(0), at(20), at(70)], pending_us=[at(5), at(40), at(45)])
    assert (row.queued_us, row.pending_us) == (at(20), at(40))
    # what the index held before is kept when the events have gone by
    assert fresh.merged(row).queued_us == at(20) and fresh.merged(row).pending_us == at(40)
    # nothing known: waits from its expected start
    assert fresh.merged(None).queued_us == at(0) and fresh.merged(None).pending_us is None
    # a run submitted for later waits from its scheduled time, not from its submission
    later = IndexRow.from_flow_run(dict(id="y", state_type="SCHEDULED", expected_start_time=T0.isoformat(),
                                        state=dict(type="SCHEDULED", timestamp=(T0 - dt.timedelta(hours=1)).isoformat(),
                                                   state_details=dict(scheduled_time=T0.isoformat()))))
    assert later.merged(None).queued_us == at(0)


def test_resources_come_from_the_agents_placement_else_the_request():
    rows = frame([dict(id="a", state_type="RUNNING", placement="agent x: cpu=0.5,memory=1Gi,gpu=2; gpus 0,1; cores 3"),
                  dict(id="b", state_type="RUNNING", gpu=1, cpu=4),  # not placed by an agent: what it asked for
                  dict(id="c", state_type="SCHEDULED")])
    gpu, cpu = OC.resources(rows)
    assert gpu.tolist() == [2.0, 1.0, 0.0] and cpu.tolist() == [0.5, 4.0, 0.0]


def test_lanes_fold_per_agent_when_devices_outnumber_the_rows_a_chart_can_show():
    """More devices than ``max_lanes``: one lane per agent, the group holding most of its
    devices' time per pixel (here 10 s), the runs holding in each segment counted once."""
    place = "agent {a}: cpu=1,memory=1Gi,gpu={n}; gpus {g}; cores 0"
    runs = frame([
        dict(id="al", name="al", queue="q", owner="alice", state_type="COMPLETED", expected_start_us=at(0), start_us=at(0),
             end_us=at(100), placement=place.format(a="a", n=1, g="0")),
        dict(id="bo", name="bo", queue="q", owner="bob", state_type="COMPLETED", expected_start_us=at(0), start_us=at(0),
             end_us=at(30), placement=place.format(a="a", n=2, g="1,2")),  # 2 GPUs: outweighs alice's one
        dict(id="ca", name="ca", queue="q", owner="carol", state_type="COMPLETED", expected_start_us=at(50), start_us=at(50),
             end_us=at(70), placement=place.format(a="b", n=1, g="3")),
    ])
    now = T0 + dt.timedelta(seconds=200)
    ph = OC.phases(runs, IV.us(now))
    per_device = OL.lanes(runs, ph, runs["owner"], at(0), at(100), gap_s=10)
    assert per_device.attrs["folded"] is False and per_device["lane"].nunique() == 4
    seg = OL.lanes(runs, ph, runs["owner"], at(0), at(100), gap_s=10, max_lanes=3)
    assert seg.attrs["folded"] is True
    got = [(r.lane, r.group, (r.start - pd.Timestamp(T0)).total_seconds(), (r.end - pd.Timestamp(T0)).total_seconds(), r.runs, r.name)
           for r in seg.itertuples()]
    assert got == [("a · GPUs", "bob", 0, 30, 2, "bo"), ("a · GPUs", "alice", 30, 100, 1, "al"),
                   ("b · GPUs", "carol", 50, 70, 1, "ca")]


def test_the_folded_gantts_first_pixel_is_whole_when_the_range_starts_inside_it():
    """A range starting 5 s into a 10-s pixel: the first pixel's group is chosen from all of it. Dave's
    three GPUs held 0-4 s (12 device-seconds, ended before the range) outweigh alice's one GPU from 3 s
    (7); the segment is drawn from the range's start, and counts and names the runs of its pixel."""
    place = "agent a: cpu=1,memory=1Gi,gpu={n}; gpus {g}; cores 0"
    runs = frame([
        dict(id="dv", name="dv", queue="q", owner="dave", state_type="COMPLETED", expected_start_us=at(0), start_us=at(0),
             end_us=at(4), placement=place.format(n=3, g="0,1,2")),
        dict(id="al", name="al", queue="q", owner="alice", state_type="COMPLETED", expected_start_us=at(3), start_us=at(3),
             end_us=at(40), placement=place.format(n=1, g="3")),
        dict(id="bo", name="bo", queue="q", owner="bob", state_type="COMPLETED", expected_start_us=at(20), start_us=at(20),
             end_us=at(25), placement=place.format(n=1, g="4")),  # 5 device-seconds in 20-30: alice's 10 win
    ])
    ph = OC.phases(runs, at(100))
    seg = OL.lanes(runs, ph, runs["owner"], at(5), at(40), gap_s=10, max_lanes=1)
    assert seg.attrs["folded"] is True
    got = [(r.lane, r.group, (r.start - pd.Timestamp(T0)).total_seconds(), (r.end - pd.Timestamp(T0)).total_seconds(), r.runs, r.name)
           for r in seg.itertuples()]
    assert got == [("a · GPUs", "dave", 5, 10, 2, "dv"), ("a · GPUs", "alice", 10, 40, 2, "al")]


def test_newest_runs_only_never_call_the_unread_past_idle():
    """The API path reads the newest runs only: the buckets before the oldest of them are unknown, so
    nothing there is called idle, and averages over the range (heatmap, capacity share) are withheld."""
    newest = frame([SHORT, WAITING, RUNNING])  # LONG (0-130) was not read: it is older than the newest three
    since = T0 - dt.timedelta(seconds=40)
    whole = OP.compute(frame([LONG, SHORT, WAITING, RUNNING]), None, since, NOW, 20, NOW)
    part = OP.compute(newest, None, since, NOW, 20, NOW, complete=False)
    assert not whole.idle.empty and not whole.heatmap.empty  # with every run: -40..20 really was idle
    assert part.idle.empty and part.heatmap.empty and part.share == {"gpu": None, "cpu": None}
    # the load starts at the bucket of the oldest moment a read run was seen (SHORT queued at 95: bucket 80-100)
    assert part.load["bucket"].min() == pd.Timestamp(T0 + dt.timedelta(seconds=80)) and whole.load["bucket"].min() == pd.Timestamp(T0 - dt.timedelta(seconds=40))
    # where it is drawn, it is what those runs held (the same producer)
    both = part.load.merge(whole.load, on="bucket", suffixes=("_part", "_whole"))
    assert (both["run_s_part"] <= both["run_s_whole"] + 1e-9).all() and len(both) == len(part.load)
    assert part.complete is False and not part.status.empty


def test_job_names_where_no_deployment_is_known_fill_as_text_without_a_dtype_warning():
    """A page of runs whose deployments are all unknown (deleted, or not read yet): the mapped names are all
    missing, which pandas types as float; filling them with text warns under pandas 3 and raises under 4."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = IV.job_names(pd.Series(["gone-1", "gone-2"]), {})  # every run has a deployment, none known
        mixed = IV.job_names(pd.Series(["gone", None, "d1"]), {"d1": {"name": "train"}})
    assert list(names) == [IV.UNKNOWN, IV.UNKNOWN]
    assert list(mixed) == [IV.UNKNOWN, IV.NO_DEPLOYMENT, "train"]


def test_group_labels_of_categorical_rows_are_the_same_as_of_text_rows():
    """Prepared rows' labels are categoricals; the group per run (the biggest owners kept, the rest, unknown and
    missing folded into one) is the same as from the same labels as plain text, and stays categorical."""
    from prefect_launch.dashboard.spec import MAX_GROUPS, OTHER, UNKNOWN

    rng = np.random.default_rng(3)
    owners = [f"u{i}" for i in range(MAX_GROUPS + 4)] + [UNKNOWN]
    text = pd.Series(rng.choice(owners, 500).astype(object))
    text[::37] = None
    rows_text = pd.DataFrame({"owner": text})
    rows_cat = pd.DataFrame({"owner": text.astype("category")})
    for chosen in ((), ("u3", "u5")):
        want = IV.group_values(rows_text, "owner", chosen)
        got = IV.group_values(rows_cat, "owner", chosen)
        assert isinstance(got.dtype, pd.CategoricalDtype)
        assert got.astype(object).tolist() == want.tolist()
        assert f"{OTHER} / {UNKNOWN}" in set(want) and UNKNOWN not in set(want)
    assert IV.group_values(rows_cat.assign(job=rows_cat["owner"]), "job").equals(rows_cat["owner"].rename("job"))
