"""The folded Gantt made from parts (the settled runs' part kept between steps, the rest's
made afresh) is the one made from every run at once: the same segments, groups, run counts
and runs named, step after step and through the index's changes. Pure: no server."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
from occupancy_history import S, T0, History, at

from prefect_launch.dashboard import index_view as IV
from prefect_launch.dashboard import occupancy as OC
from prefect_launch.dashboard import occupancy_lanes as OL
from prefect_launch.dashboard import occupancy_memo as OM
from prefect_launch.dashboard import occupancy_panels as OP


def lanes_equal(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert a.attrs["folded"] == b.attrs["folded"]
    plain = lambda f: f.astype({"lane": str, "agent": str, "group": str, "id": str, "name": str}).sort_values(  # noqa: E731
        ["lane", "start"], ignore_index=True)
    pd.testing.assert_frame_equal(plain(a), plain(b))


def test_folded_lanes_kept_between_steps_are_the_lanes_made_from_every_run(monkeypatch):
    monkeypatch.setattr(OC, "PER_RUN_GANTT_MAX", 0)  # lanes for a few hundred runs
    monkeypatch.setattr(OL, "LANES_MAX", 6)  # 4 agents' GPUs and cores: folded
    h = History(200, seed=11)
    memo = OM.SettledMemo(margin_s=60, renew_s=400)
    events = {900: "retry", 1100: "delete", 1300: "late"}
    early = np.flatnonzero((h.en < 700) & ~h.never_started)
    kept_parts = 0
    for t in range(600, 2200, 80):
        what = next((events.pop(k) for k in sorted(events) if k <= t), None)
        if what == "retry":
            h.retried[int(early[0])] = t
        elif what == "delete":
            h.deleted.add(int(early[3]))
        elif what == "late":
            h.late_from[int(early[5])] = t
        rows = h.index(t, {})
        groups = IV.group_values(rows, "owner")
        now = T0 + dt.timedelta(seconds=t)
        until = T0 + dt.timedelta(seconds=-(-t // 30) * 30)  # a live range ends at its clock's step, after now
        since = until - dt.timedelta(seconds=1200)
        whole = OP.compute(rows, groups, since, until, 60, now)
        kept = OP.compute(rows, groups, since, until, 60, now, memo=memo, key="view")
        assert whole.lanes is not None and not whole.lanes.empty and whole.lanes.attrs["folded"]
        lanes_equal(whole.lanes, kept.lanes)
        kept_parts = max(kept_parts, max((len(e.lane_parts) for e in memo._entries.values()), default=0))
    # one kept part per entry: the pixels keep their width while now moves inside the clock's step
    assert kept_parts == 1 and memo.reused > memo.made and not events


def test_a_range_that_ended_in_the_past_keeps_its_gantt_part(monkeypatch):
    """A fixed range ending before now (last week's view): the settled runs are those ended a margin
    before the range's end, so the Gantt's kept part serves it (a cut-off at the clock would not)."""
    monkeypatch.setattr(OC, "PER_RUN_GANTT_MAX", 0)
    monkeypatch.setattr(OL, "LANES_MAX", 6)
    h = History(200, seed=3)
    memo = OM.SettledMemo(margin_s=10, eager=True)
    # the range ends inside a bucket (buckets to 1560 s): settled means ended before 1495 s, not 1550 s
    since, until = T0 + dt.timedelta(seconds=300), T0 + dt.timedelta(seconds=1505)
    for t in (2400, 2460, 2520):
        rows = h.index(t, {})
        groups = IV.group_values(rows, "owner")
        now = T0 + dt.timedelta(seconds=t)
        lanes_equal(OP.compute(rows, groups, since, until, 60, now).lanes,
                    OP.compute(rows, groups, since, until, 60, now, memo=memo, key="last week").lanes)
    assert memo.reused == 2 and len(memo._entries["last week"].lane_parts) == 1


def test_the_folded_frame_of_two_parts_is_the_frame_of_their_runs_together():
    h = History(250, seed=4)
    rows = h.index(1800, {})
    ph = OC.phase_arrays(rows, float(at(1800)))
    since, until = float(at(300)), float(at(1800))
    grid = OL.pixel_grid(since, until, 7.3)
    rng = np.random.default_rng(1)
    side = rng.random(len(rows)) < 0.5
    part = lambda m: OL.folded_part(rows[m], {k: v[m] for k, v in ph.items()}, rows["owner"][m], grid, until)  # noqa: E731
    one = OL.folded_frame([part(np.ones(len(rows), dtype=bool))], grid, since, until)
    two = OL.folded_frame([part(side), part(~side)], grid, since, until)
    assert len(one) > 10
    lanes_equal(one, two)
    lanes_equal(one, OL.folded_frame([part(~side), part(side)], grid, since, until))  # the parts' order does not matter
    # every segment's named run is of its group and lane, and held a device there in the segment
    by_id = rows.set_index("id")
    for r in one.itertuples():
        run = by_id.loc[r.id]
        assert run["owner"] == r.group and str(r.lane).startswith(str(run["placement"]).split(":")[0].removeprefix("agent "))


def test_pixels_are_whole_multiples_of_their_width_so_a_later_range_lines_up():
    since = float(at(0)) + 123_456
    a = OL.pixel_grid(since, since + 600 * S, 1.5)
    b = OL.pixel_grid(since + 37 * S, since + 637 * S, 1.5)
    assert a.lo_us <= since < a.lo_us + 1_500_000 and a.lo_us % 1_500_000 == 0
    assert (b.lo_us - a.lo_us) % 1_500_000 == 0 and b.lo_us > a.lo_us
    assert a.lo_us + a.n * 1_500_000 >= since + 600 * S
