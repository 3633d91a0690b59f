"""The settled runs' sums kept between steps (:mod:`.occupancy_memo`) give the same panels
as summing every run afresh, step after step, while runs move through their states, and
when the index changes under them: a settled run retried, one deleted, an old run synced
late, a job renamed. Pure: hand-made index rows, no server."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from occupancy_history import S, T0, History, at

from prefect_launch.dashboard import index_view as IV
from prefect_launch.dashboard import occupancy as OC
from prefect_launch.dashboard import occupancy_memo as OM
from prefect_launch.dashboard import occupancy_panels as OP
from prefect_launch.dashboard import occupancy_sums as OSU


def panels_equal(a: OP.Occupancy, b: OP.Occupancy) -> None:
    for f in ("status", "load", "idle", "heatmap"):
        pd.testing.assert_frame_equal(getattr(a, f).reset_index(drop=True), getattr(b, f).reset_index(drop=True),
                                      check_exact=False, rtol=1e-9, atol=1e-6)
    order = lambda q: q.sort_values(["bucket", "group"], ignore_index=True)  # noqa: E731  (groups may come in another order)
    pd.testing.assert_frame_equal(order(a.queued), order(b.queued), check_exact=False, rtol=1e-9, atol=1e-6)
    assert (a.runs, a.share) == (b.runs, b.share)


@pytest.mark.parametrize("interval_s, step_s", [(60, 60), (3600, 100)])
def test_kept_sums_give_the_same_panels_as_summing_every_run_step_after_step(interval_s, step_s):
    h = History(200)
    memo = OM.SettledMemo(margin_s=60, renew_s=400)
    deployments = {f"d{k}": {"name": f"job-{k}"} for k in range(3)}
    events = {900: "retry", 1100: "delete", 1300: "late", 1500: "rename"}  # each at the first step from then on
    n_events = len(events)
    first_settled = h.en < 700  # runs that end early: candidates for the faults below
    checked = 0
    for t in range(600, 2200, step_s):
        what = next((events.pop(k) for k in sorted(events) if k <= t), None)
        if what == "retry":
            h.retried[int(np.flatnonzero(first_settled & ~h.never_started)[0])] = t
        elif what == "delete":
            h.deleted.add(int(np.flatnonzero(first_settled)[3]))
        elif what == "late":  # an old run's row reaches the index only now (a sync that was behind)
            i = int(np.flatnonzero(first_settled)[5])
            h.late_from[i] = t
        elif what == "rename":
            deployments = dict(deployments, d1={"name": "job-1-renamed"})
        rows = h.index(t, deployments)
        groups = IV.group_values(rows, "job")
        now = T0 + dt.timedelta(seconds=t)
        since = now - dt.timedelta(seconds=1200)
        whole = OP.compute(rows, groups, since, now, interval_s, now)
        kept = OP.compute(rows, groups, since, now, interval_s, now, memo=memo, key="view")
        panels_equal(whole, kept)
        checked += 1
    # the kept sums were used most steps, and made again after each change and as the cut-off aged
    assert memo.reused > memo.made and memo.made >= 1 + n_events and not events
    assert checked == len(range(600, 2200, step_s))


def test_an_entry_is_made_again_when_a_settled_run_changes_and_not_otherwise():
    h = History(120, seed=9)
    memo = OM.SettledMemo(margin_s=60, renew_s=10_000, eager=True)
    deployments: dict = {}
    t = 1800
    now = T0 + dt.timedelta(seconds=t)
    since = now - dt.timedelta(seconds=1200)

    def step(rows: pd.DataFrame) -> None:
        OP.compute(rows, IV.group_values(rows, "owner"), since, now, 60, now, memo=memo, key="v")

    rows = h.index(t, deployments)
    step(rows)
    step(rows.iloc[::-1].reset_index(drop=True))  # the same runs in another order (the index's splice moves rows)
    assert (memo.made, memo.reused) == (1, 1)
    settled = np.flatnonzero((rows["state_type"].astype(str) == "COMPLETED").to_numpy() & (rows["end_us"] < at(t - 600)).to_numpy())
    changed = rows.copy()
    changed.loc[settled[0], "end_us"] += 1 * S  # the same write time, another end: the checksum sees it
    step(changed)
    assert memo.made == 2
    moved = rows.copy()
    moved.loc[settled[1], "owner"] = "cy" if moved.loc[settled[1], "owner"] != "cy" else "ana"  # its group changes
    step(moved)
    assert memo.made == 3


def test_runs_swapping_ends_or_owners_make_the_entry_again_though_every_sum_and_count_stays():
    """Writes the index's watermark may not show (a writer whose clock is behind): two settled runs swap
    their ends, then their owners. Every column's sum and every group's count stay the same; the panels
    do not, and the kept sums must not be used."""
    h = History(160, seed=5)
    memo = OM.SettledMemo(margin_s=60, renew_s=10_000, eager=True)
    t = 1800
    now = T0 + dt.timedelta(seconds=t)
    since = now - dt.timedelta(seconds=1200)

    def step(rows: pd.DataFrame) -> None:
        groups = IV.group_values(rows, "owner")
        kept = OP.compute(rows, groups, since, now, 60, now, memo=memo, key="v")
        panels_equal(kept, OP.compute(rows, groups, since, now, 60, now))

    rows = h.index(t, {})
    step(rows)
    done = rows[(rows["state_type"].astype(str) == "COMPLETED").to_numpy() & (rows["end_us"] < at(t - 600)).to_numpy()
                & (rows["start_us"] > at(t - 1100)).to_numpy()]
    # two settled runs in range, each ending after the other started, holding different GPUs, of different owners
    pair = next((a, b) for a in done.index for b in done.index
                if a < b and max(done.at[a, "start_us"], done.at[b, "start_us"]) < min(done.at[a, "end_us"], done.at[b, "end_us"])
                and done.at[a, "end_us"] != done.at[b, "end_us"] and done.at[a, "gpu"] != done.at[b, "gpu"]
                and done.at[a, "owner"] != done.at[b, "owner"])
    swapped = rows.copy()
    swapped.loc[list(pair), "end_us"] = rows.loc[list(pair[::-1]), "end_us"].to_numpy()
    step(swapped)
    assert (memo.made, memo.reused) == (2, 0)
    regrouped = swapped.copy()
    regrouped["owner"] = regrouped["owner"].astype(object)
    regrouped.loc[list(pair), "owner"] = swapped.loc[list(pair[::-1]), "owner"].astype(object).to_numpy()
    regrouped["owner"] = regrouped["owner"].astype("category")
    step(regrouped)
    assert (memo.made, memo.reused) == (3, 0)
    step(regrouped)
    assert (memo.made, memo.reused) == (3, 1)


def test_a_view_read_once_is_made_from_every_run_and_kept_from_its_second_read():
    h = History(120, seed=9)
    memo = OM.SettledMemo(margin_s=60)
    rows = h.index(1800, {})
    now = T0 + dt.timedelta(seconds=1800)
    since = now - dt.timedelta(seconds=1200)
    read = lambda key: OP.compute(rows, IV.group_values(rows, "owner"), since, now, 60, now, memo=memo, key=key)  # noqa: E731
    whole = OP.compute(rows, IV.group_values(rows, "owner"), since, now, 60, now)
    panels_equal(read("default"), whole)
    assert (memo.made, memo.reused) == (0, 0)  # read once: nothing kept
    panels_equal(read("default"), whole)
    assert (memo.made, memo.reused) == (1, 0)  # read again: kept from now on
    panels_equal(read("default"), whole)
    panels_equal(read("a filter tried once"), whole)
    assert (memo.made, memo.reused) == (1, 1)


def test_sums_add_and_move_to_a_later_range():
    h = History(200, seed=2)
    rows = h.index(2000, {})
    now_us = float(at(2000))
    ph = OC.phase_arrays(rows, now_us)
    b = OC.Buckets(lo_us=at(0), step_s=60, n=40)
    later = OC.Buckets(lo_us=at(600), step_s=60, n=35)  # starts 10 buckets later, ends 5 later
    ended = ~np.isnan(ph["end"]) & (ph["end"] < at(2000))
    a, z = np.flatnonzero(ended), np.flatnonzero(~ended)
    part = lambda idx, grid: OSU.sums(rows.iloc[idx], {k: v[idx] for k, v in ph.items()}, rows["owner"].iloc[idx], grid)  # noqa: E731
    whole = OSU.sums(rows, ph, rows["owner"], later)
    both = part(a, b).window(later, None).plus(part(z, later))
    for f in ("present", "seconds", "finished", "held", "held_s"):
        np.testing.assert_allclose(getattr(both, f), getattr(whole, f), rtol=1e-9, atol=1e-6)
    by_group = lambda s: {g: s.queued_s[i] for i, g in enumerate(s.groups)}  # noqa: E731
    assert by_group(both).keys() == by_group(whole).keys()
    for g, v in by_group(whole).items():
        np.testing.assert_allclose(by_group(both)[g], v, rtol=1e-9, atol=1e-6)
    with pytest.raises(ValueError):
        part(a, later).window(b, None)  # an earlier range: the sums do not reach back
    with pytest.raises(ValueError):
        part(a, b).window(OC.Buckets(lo_us=at(630), step_s=60, n=30), None)  # half a bucket later: not whole buckets


def test_buckets_move_columns_onto_a_later_grid_of_the_same_width():
    """What kept sums and kept Gantt parts use (pixels of fractional seconds too): columns move by
    whole buckets, those past the old grid's end are zero, and any other grid is refused."""
    px = OC.Buckets(lo_us=at(0), step_s=1.5, n=4)  # type: ignore[arg-type]  # a Gantt pixel of 1.5 s
    a = np.arange(8.0).reshape(2, 4)
    moved = px.moved(a, OC.Buckets(lo_us=at(3), step_s=1.5, n=3))  # type: ignore[arg-type]  # two pixels on
    assert moved.tolist() == [[2.0, 3.0, 0.0], [6.0, 7.0, 0.0]]
    for other in (OC.Buckets(lo_us=at(3), step_s=3, n=3), OC.Buckets(lo_us=at(2), step_s=1.5, n=3),  # type: ignore[arg-type]
                  OC.Buckets(lo_us=at(-1.5), step_s=1.5, n=3)):  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            px.moved(a, other)
