"""The time charts' payloads (dashboard/chart_data.py) against the frames they are built from:
what the browser draws and says in a tooltip is the frame's figure, mark for mark."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from prefect_launch.dashboard import chart_data as CD

UTC = dt.timezone.utc
SINCE = pd.Timestamp("2026-11-01 00:00", tz=UTC)
UNTIL = pd.Timestamp("2026-11-01 06:00", tz=UTC)
STEP = 3600


def _ms(t: str) -> float:
    return pd.Timestamp(t, tz=UTC).value / 1e6


def _tip(p: CD.Payload, label: str) -> CD.Tip:
    return next(t for t in p.tips if t.label == label)


def test_ms_is_epoch_milliseconds_whatever_the_unit():
    t = dt.datetime(2026, 11, 1, 1, 2, 3, 4000, tzinfo=UTC)
    want = t.timestamp() * 1000
    for col in (pd.Series([t]), pd.Series([t]).astype("datetime64[us, UTC]"), pd.Series([t]).astype("datetime64[ms, UTC]"),
                pd.DatetimeIndex([t])):
        assert CD.ms(col)[0] == pytest.approx(want)
    assert np.isnan(CD.ms(pd.Series([pd.NaT, t]))[0])


def test_status_bars_stack_each_intervals_counts():
    status = pd.DataFrame({"bucket": pd.to_datetime(["2026-11-01 01:00", "2026-11-01 01:00", "2026-11-01 01:00",
                                                     "2026-11-01 03:00", "2026-11-01 03:00"], utc=True),
                           "status": ["running", "queued", "failed", "completed", "running"],
                           "count": [4, 2, 1, 3, 5], "avg": [2.5, 0.75, np.nan, np.nan, 4.0]})
    p = CD.status_payload(status, SINCE, UNTIL, STEP)
    assert p.kind == "bars" and (p.x0, p.x1) == (_ms("2026-11-01 00:00"), _ms("2026-11-01 06:00"))
    # the series in the page's status order, each with its status colour
    assert p.names == ["queued", "running", "completed", "failed"]
    it = p.items
    counts = _tip(p, "runs (at any moment / finished)").values
    avgs = _tip(p, "time-weighted average").values
    for i, row in enumerate(status.itertuples()):  # item i is row i of the frame
        assert p.names[it["c"][i]] == row.status
        assert it["x"][i] == _ms(str(row.bucket.tz_convert(None))) and it["x2"][i] - it["x"][i] == STEP * 1000
        assert it["y1"][i] - it["y0"][i] == pytest.approx(row.count) and counts[i] == row.count
        assert (avgs[i] is None) if np.isnan(row.avg) else avgs[i] == pytest.approx(row.avg)
    # per interval the segments tile 0 .. the interval's total, in status order
    for b, grp in status.assign(i=range(len(status))).groupby("bucket"):
        spans = sorted((it["y0"][i], it["y1"][i], p.names[it["c"][i]]) for i in grp["i"])
        assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(grp["count"].sum())
        assert all(a[1] == pytest.approx(b_[0]) for a, b_ in zip(spans, spans[1:]))
        assert [s for *_, s in spans] == [s for s in p.names if s in set(grp["status"])]


def test_a_payloads_sig_changes_with_any_mark_and_only_then():
    """The browser keeps a drawn chart while its ``sig`` is unchanged (timeline.js): one count more must
    change it; the same figures computed again must not."""
    status = pd.DataFrame({"bucket": pd.to_datetime(["2026-11-01 01:00", "2026-11-01 02:00"], utc=True),
                           "status": ["running", "queued"], "count": [4, 2], "avg": [2.5, 0.75]})
    a, b = (CD.status_payload(status.copy(), SINCE, UNTIL, STEP).dump() for _ in range(2))
    assert a["sig"] == b["sig"] and len(a["sig"]) == 24
    c = CD.status_payload(status.assign(count=[4, 3]), SINCE, UNTIL, STEP).dump()
    d = CD.status_payload(status, SINCE, UNTIL + dt.timedelta(hours=1), STEP).dump()
    assert len({a["sig"], c["sig"], d["sig"]}) == 3
    assert {k: v for k, v in a.items() if k != "sig"} == CD.status_payload(status, SINCE, UNTIL, STEP).model_dump(exclude_none=True)


def test_queued_bars_carry_runs_and_mean_wait():
    qt = pd.DataFrame({"bucket": pd.to_datetime(["2026-11-01 02:00", "2026-11-01 02:00"], utc=True),
                       "group": ["train", "eval"], "queued_s": [600.0, 90.0], "runs": [10, 3]})
    qt["mean_s"] = qt["queued_s"] / qt["runs"]
    p = CD.queued_payload(qt, "job", SINCE, UNTIL, STEP)
    assert p.names == ["eval", "train"] and p.legend_title == "job"
    i = p.names.index("train")
    k = p.items["c"].index(i)
    assert _tip(p, "runs waiting").values[k] == 10 and _tip(p, "mean wait (s)").values[k] == 60.0
    assert p.items["y1"][k] - p.items["y0"][k] == 600.0
    assert max(p.items["y1"]) == 690.0  # stacked


def test_load_steps_and_the_agents_gpus():
    load = pd.DataFrame({"bucket": pd.date_range(SINCE, periods=3, freq="h"), "busy": [0.5, 2.0, 0.0],
                         "gpus": [1.0, 4.0, 0.0], "held": [1, 3, 0], "waiting": [0, 2, 1]})
    p = CD.load_payload(load, 8.0, SINCE, UNTIL, STEP)
    assert p.kind == "steps" and [r.y for r in p.rules] == [8.0]
    busy = [y for y, c in zip(p.items["y1"], p.items["c"]) if p.names[c] == "runs holding a slot"]
    gpus = [y for y, c in zip(p.items["y1"], p.items["c"]) if p.names[c] == "GPUs held"]
    assert busy == [0.5, 2.0, 0.0] and gpus == [1.0, 4.0, 0.0]
    assert _tip(p, "runs waiting").values == [0, 2, 1, 0, 2, 1]
    assert CD.load_payload(load, None, SINCE, UNTIL, STEP).rules == []


def test_lanes_map_every_segment_to_its_lane_and_group():
    seg = pd.DataFrame({"lane": ["n1 · GPU 1", "n1 · GPU 0", "n1 · GPU 0"], "agent": "n1",
                        "start": pd.to_datetime(["2026-11-01 01:00", "2026-11-01 00:30", "2026-11-01 02:00"], utc=True),
                        "end": pd.to_datetime(["2026-11-01 03:00", "2026-11-01 01:30", "2026-11-01 02:10"], utc=True),
                        "group": ["train", "eval", "train"], "runs": [1, 2, 1], "id": ["a", "b", "c"],
                        "name": ["run-a", "<b>run-b</b>", "run-c"]})
    p = CD.lanes_payload(seg, "job", SINCE, UNTIL, selected=[1.0, 2.0])
    assert p.rows == ["n1 · GPU 0", "n1 · GPU 1"] and p.brush and p.selected == [1.0, 2.0]
    for i, r in enumerate(seg.itertuples()):
        assert p.rows[p.items["row"][i]] == r.lane and p.names[p.items["c"][i]] == r.group
        assert (p.items["x"][i], p.items["x2"][i]) == (r.start.value / 1e6, r.end.value / 1e6)
    # names travel as data; the browser sets them as text (timeline.js never writes HTML)
    assert _tip(p, "first run").values[1] == "<b>run-b</b>"


def test_gantt_one_row_per_run_newest_on_top():
    g = pd.DataFrame({"id": ["a", "b"], "name": ["old", "new"], "job": ["train", "eval"], "owner": "ann", "queue": "q",
                      "preset": None, "state_name": ["Completed", "Running"],
                      "start": pd.to_datetime(["2026-11-01 01:00", "2026-11-01 02:00"], utc=True),
                      "bar_end": pd.to_datetime(["2026-11-01 01:30", "2026-11-01 05:00"], utc=True),
                      "duration_s": [1800.0, 10800.0], "queued_s": [5.0, np.nan]})
    p = CD.gantt_payload(g, "job", SINCE, UNTIL)
    assert p.rows == ["new", "old"] and p.items["row"] == [0, 1]
    assert p.names[p.items["c"][0]] == "eval" and _tip(p, "preset").values == ["", ""]
    assert _tip(p, "queued s").values == [None, 5.0]
    assert p.selected is None and "selected" not in p.dump()
    # the time axis spans the runs (with a margin), not the whole range they sit in
    assert _ms("2026-11-01 00:55") < p.x0 < _ms("2026-11-01 01:00") and _ms("2026-11-01 05:00") < p.x1 < _ms("2026-11-01 05:05")



def test_the_chart_script_writes_text_never_html():
    """Run, job and lane names reach the page only through timeline.js: it sets them as text
    (textContent, canvas fillText), never as markup."""
    import re
    from pathlib import Path

    js = (Path(CD.__file__).with_name("timeline.js")).read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", js)
    assert "textContent" in js


def test_series_without_a_meaning_of_their_own_take_the_themes_colours():
    """Groupings and load are drawn in the theme's categorical palette (timeline.js reads Streamlit's
    --st-chart-categorical-colors, falling back to ``colors``); the job statuses keep their own colours."""
    status = pd.DataFrame({"bucket": pd.to_datetime(["2026-11-01 01:00"], utc=True), "status": ["failed"],
                           "count": [1], "avg": [np.nan]})
    qt = pd.DataFrame({"bucket": pd.to_datetime(["2026-11-01 02:00"], utc=True), "group": ["train"],
                       "queued_s": [60.0], "runs": [1], "mean_s": [60.0]})
    load = pd.DataFrame({"bucket": pd.date_range(SINCE, periods=1, freq="h"), "busy": [1.0], "gpus": [1.0],
                         "held": [1], "waiting": [0]})
    s = CD.status_payload(status, SINCE, UNTIL, STEP)
    assert not s.themed and s.colors == [CD.STATUS_COLORS["failed"]]
    assert CD.queued_payload(qt, "job", SINCE, UNTIL, STEP).themed
    assert CD.load_payload(load, None, SINCE, UNTIL, STEP).themed
    from pathlib import Path

    js = (Path(CD.__file__).with_name("timeline.js")).read_text()
    assert "--st-chart-categorical-colors" in js and "p.themed" in js and "--st-text-color" in js


def _fallback_app() -> None:
    import pandas as pd
    import streamlit as st

    from prefect_launch.dashboard import chart_data as CD
    from prefect_launch.dashboard import timeline

    timeline._mount = None  # as in a Streamlit without st.components.v2
    counts = pd.DataFrame({"bucket": pd.to_datetime(["2026-11-01 01:00"], utc=True), "status": ["running"],
                           "count": [2], "avg": [1.5]})
    since, until = pd.Timestamp("2026-11-01", tz="UTC"), pd.Timestamp("2026-11-01 06:00", tz="UTC")
    st.session_state["brush"] = timeline.chart(CD.status_payload(counts, since, until, 3600), key="status_chart",
                                               fallback=counts)


def test_without_the_component_a_chart_is_its_table(monkeypatch):
    from streamlit.testing.v1 import AppTest

    from prefect_launch.dashboard import timeline

    monkeypatch.setattr(timeline, "_mount", timeline._mount)  # the app's change is undone after the test
    at = AppTest.from_function(_fallback_app).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.get("bidi_component") and at.session_state["brush"] is None
    shown = at.dataframe[0].value
    assert list(shown.columns) == ["bucket", "status", "count", "avg"] and shown["count"].tolist() == [2]
