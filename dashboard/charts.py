"""Altair charts of the queue monitor (frames from :mod:`.frames`, :mod:`.occupancy`, :mod:`.cost` and
:mod:`.metrics_source` in; nothing is computed here)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from prefect_launch.dashboard.spec import STATUS_COLORS, STATUSES

alt.data_transformers.disable_max_rows()
HEIGHT = 260
# charts of many marks are drawn on a canvas: as SVG each mark is a DOM node with its own accessible
# label (the job-status and queued-time charts are 1,000 bars over 7 days), which the browser lays
# out on every visit (the hour x weekday heatmap is an HTML table: see heatmap_table.py)
CANVAS = {"embedOptions": {"renderer": "canvas"}}


def _on_canvas(chart, **props):
    """``chart`` drawn on a canvas, without per-mark ARIA descriptions: a canvas has no element per mark
    to carry them, yet Vega would build one string per mark (timeFormat included) through Streamlit's
    expression interpreter on every visit - most of a 7-day page's drawing before this."""
    return chart.properties(usermeta=CANVAS, **props).configure(aria=False)


def _status_scale() -> alt.Scale:
    return alt.Scale(domain=list(STATUSES), range=[STATUS_COLORS[s] for s in STATUSES])


def gantt_chart(g: pd.DataFrame, grouping_col: str) -> alt.Chart:
    """One bar per run from start to end (a colour per run); brush on x selects a span."""
    brush = alt.selection_interval(encodings=["x"], name="brush")
    n = max(len(g), 1)
    return (
        alt.Chart(g)
        .mark_bar(height={"band": 0.8} if n < 400 else 1)
        .encode(
            x=alt.X("start:T", title="time"),
            x2="bar_end:T",
            y=alt.Y("name:N", sort=alt.EncodingSortField("start", order="descending"), axis=alt.Axis(labels=n <= 60, ticks=False), title="run"),
            color=alt.Color("id:N", legend=None, scale=alt.Scale(scheme="tableau20")),
            tooltip=["name:N", "id:N", "job:N", "owner:N", "queue:N", "preset:N", "state_name:N",
                     alt.Tooltip("start:T", format="%Y-%m-%d %H:%M:%S"), alt.Tooltip("bar_end:T", title="end", format="%Y-%m-%d %H:%M:%S"),
                     alt.Tooltip("duration_s:Q", format=",.0f"), alt.Tooltip("queued_s:Q", format=",.0f")],
        )
        .add_params(brush)
        .properties(height=min(max(14 * n, 200), 520))
    )


def metric_chart(m: pd.DataFrame, y: str, title: str, grouping_col: str) -> alt.Chart:
    """x = run duration (s), y = the metric; waste flagged runs drawn as red crosses."""
    # only the columns the marks and tooltips read: the chart's data travels to the browser as it is
    used = list(dict.fromkeys(["id", "run", "flow", "job", "queue", "owner", "duration_s", y, grouping_col, "wasteful",
                               "waste_reasons"]))
    d = m.loc[m[y].notna() & m["duration_s"].notna(), [c for c in used if c in m]].copy()
    d["flag"] = d.pop("wasteful").map({True: "waste", False: "ok"})
    return (
        alt.Chart(d)
        .mark_point(filled=True, size=50, opacity=0.75)
        .encode(
            x=alt.X("duration_s:Q", title="run duration (s)", scale=alt.Scale(type="symlog")),
            y=alt.Y(f"{y}:Q", title=title),
            color=alt.Color(f"{grouping_col}:N", title=grouping_col),
            shape=alt.Shape("flag:N", scale=alt.Scale(domain=["ok", "waste"], range=["circle", "cross"]), title="verdict"),
            stroke=alt.condition("datum.flag == 'waste'", alt.value("red"), alt.value(None)),
            strokeWidth=alt.condition("datum.flag == 'waste'", alt.value(2), alt.value(0)),
            tooltip=[alt.Tooltip("id:N", title="run id"), "run:N", "flow:N", "job:N", "queue:N", "owner:N",
                     alt.Tooltip("duration_s:Q", format=",.0f"), alt.Tooltip(f"{y}:Q", format=".2f"), "waste_reasons:N"],
        )
        .properties(height=HEIGHT)
    )


# ---------------------------------------------------------------- occupancy


def occupancy_status_chart(status: pd.DataFrame) -> alt.Chart:
    """Stacked bars per interval: runs queued / pending / running at any moment of it and
    runs that finished in it (by end state); the tooltip adds the time-weighted average."""
    chart = (
        alt.Chart(status)
        .mark_bar()
        .encode(
            x=alt.X("bucket:T", title="interval"),
            y=alt.Y("sum(count):Q", title="runs"),
            color=alt.Color("status:N", scale=_status_scale(), legend=alt.Legend(title="status", orient="right")),
            order=alt.Order("status:N"),
            tooltip=[alt.Tooltip("bucket:T", title="from", format="%Y-%m-%d %H:%M:%S"), "status:N",
                     alt.Tooltip("count:Q", title="runs (at any moment / finished)"),
                     alt.Tooltip("avg:Q", title="time-weighted average", format=".2f")],
        )
    )
    return _on_canvas(chart, height=HEIGHT)


def occupancy_queued_chart(qt: pd.DataFrame, grouping: str) -> alt.Chart:
    """Stacked bars: seconds of waiting inside each interval, coloured by the grouping;
    the tooltip shows how many runs waited and their mean wait in it."""
    chart = (
        alt.Chart(qt)
        .mark_bar()
        .encode(
            x=alt.X("bucket:T", title="interval"),
            y=alt.Y("queued_s:Q", title="seconds queued", stack="zero"),
            color=alt.Color("group:N", title=grouping),
            tooltip=[alt.Tooltip("bucket:T", title="from", format="%Y-%m-%d %H:%M:%S"), alt.Tooltip("group:N", title=grouping),
                     alt.Tooltip("runs:Q", title="runs waiting"), alt.Tooltip("mean_s:Q", title="mean wait (s)", format=",.1f"),
                     alt.Tooltip("queued_s:Q", title="seconds queued", format=",.0f")],
        )
    )
    return _on_canvas(chart, height=HEIGHT)


def occupancy_load_chart(load: pd.DataFrame, gpu_capacity: float | None) -> alt.Chart:
    """Average runs holding a slot and GPUs held per interval (red rule: the agents' GPUs)."""
    long = load.melt(id_vars=["bucket", "held", "waiting"], value_vars=["busy", "gpus"], var_name="series", value_name="value")
    long["series"] = long["series"].map({"busy": "runs holding a slot", "gpus": "GPUs held"})
    base = alt.Chart(long).mark_line(interpolate="step-after").encode(
        x=alt.X("bucket:T", title=None),
        y=alt.Y("value:Q", title="time-weighted average"),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="top")),
        tooltip=[alt.Tooltip("bucket:T", format="%Y-%m-%d %H:%M:%S"), "series:N", alt.Tooltip("value:Q", format=".2f"),
                 alt.Tooltip("held:Q", title="runs holding a slot at any moment"), alt.Tooltip("waiting:Q", title="runs waiting")],
    )
    if gpu_capacity:
        rule = alt.Chart(pd.DataFrame({"capacity": [gpu_capacity]})).mark_rule(color="red", strokeDash=[4, 3]).encode(y="capacity:Q")
        return _on_canvas(base + rule, height=160)
    return _on_canvas(base, height=160)


def lanes_chart(seg: pd.DataFrame, grouping: str) -> alt.Chart:
    """One lane per agent and device with the runs that held it (merged below a pixel);
    brush on x selects a span."""
    brush = alt.selection_interval(encodings=["x"], name="brush")
    n = max(seg["lane"].nunique(), 1)
    folded = bool(seg.attrs.get("folded"))  # one lane per agent: the group holding most of its devices per pixel
    # only the columns the marks and tooltips read (the data travels to the browser as it is: run ids
    # and agents were a third of it); label columns come as categoricals (cheap to build), the chart
    # gets plain strings
    seg = seg[[c for c in ("lane", "start", "end", "group", "runs", "name") if c in seg]]
    seg = seg.astype({c: object for c in ("lane", "group") if isinstance(seg[c].dtype, pd.CategoricalDtype)})
    chart = (
        alt.Chart(seg)
        .mark_bar(height={"band": 0.8})
        .encode(
            x=alt.X("start:T", title="time"),
            x2="end:T",
            y=alt.Y("lane:N", title="agent · devices" if folded else "agent · device", sort="ascending"),
            color=alt.Color("group:N", title=grouping, scale=alt.Scale(scheme="tableau20")),
            tooltip=["lane:N", alt.Tooltip("group:N", title=f"{grouping} holding most" if folded else grouping),
                     alt.Tooltip("runs:Q", title="runs holding in it" if folded else "runs in segment"),
                     alt.Tooltip("name:N", title="one of its runs" if folded else "first run"), alt.Tooltip("start:T", format="%Y-%m-%d %H:%M:%S"),
                     alt.Tooltip("end:T", format="%Y-%m-%d %H:%M:%S")],
        )
        .add_params(brush)
    )
    return _on_canvas(chart, height=min(max(18 * n, 160), 640))


# ------------------------------------------------------------------------ cost


def cost_chart(table: pd.DataFrame, by: str, n: int = 12) -> alt.Chart:
    """GPU-hours held and used per group (bars side by side); groups without GPUs: core-hours."""
    t = table[table[by] != "total"].head(n)
    gpu = float(t["gpu_alloc_h"].sum()) > 0
    held, used, unit = ("gpu_alloc_h", "gpu_used_h", "GPU-hours") if gpu else ("cpu_alloc_h", "cpu_used_h", "core-hours")
    long = t[[by, held, used]].melt(id_vars=[by], value_vars=[held, used], var_name="series", value_name="hours")
    long["series"] = long["series"].map({held: "held", used: "used"})
    return (
        alt.Chart(long.dropna(subset=["hours"]))
        .mark_bar()
        .encode(
            y=alt.Y(f"{by}:N", title=by, sort=list(t[by])),
            x=alt.X("hours:Q", title=unit),
            yOffset=alt.YOffset("series:N"),
            color=alt.Color("series:N", title=None, scale=alt.Scale(domain=["held", "used"], range=["#9ecae1", "#08519c"]),
                            legend=alt.Legend(orient="top")),
            tooltip=[alt.Tooltip(f"{by}:N"), "series:N", alt.Tooltip("hours:Q", title=unit, format=",.3f")],
        )
        .properties(height=min(max(34 * len(t), 120), 480))
    )
