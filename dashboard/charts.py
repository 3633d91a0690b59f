"""Altair charts of the monitor's sections drawn on demand (resource use by job, cost and waste): frames
from :mod:`.metrics_source` and :mod:`.cost` in; nothing is computed here. The first page's time charts
are :mod:`.timeline`'s (see :mod:`.chart_data` for why they are not Vega charts).
"""

from __future__ import annotations

import altair as alt
import pandas as pd

alt.data_transformers.disable_max_rows()
HEIGHT = 260


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


# ------------------------------------------------------------------------ load by hour and weekday


def heatmap_chart(hm: pd.DataFrame) -> alt.Chart:
    """Held load by UTC hour (x) and weekday (y), Monday first: one cell per hour the range holds, shaded by
    the mean runs holding a slot in the theme's sequential colours; the tooltip gives the weekday, hour, mean
    runs holding a slot, mean GPUs held and the hours averaged. ``hm``: :func:`.occupancy.heatmap`'s frame
    (weekday, hour, busy, gpus, hours)."""
    from prefect_launch.dashboard.occupancy import DAYS

    d = hm[["weekday", "hour", "busy", "gpus", "hours"]]
    return (
        alt.Chart(d)
        .mark_rect()
        .encode(
            x=alt.X("hour:O", title="hour (UTC)", sort=list(range(24)), axis=alt.Axis(labelAngle=0)),
            y=alt.Y("weekday:O", title=None, sort=list(DAYS)),
            color=alt.Color("busy:Q", title="avg runs holding a slot"),
            tooltip=[alt.Tooltip("weekday:O"), alt.Tooltip("hour:O"),
                     alt.Tooltip("busy:Q", title="avg runs holding a slot", format=".2f"),
                     alt.Tooltip("gpus:Q", title="avg GPUs held", format=".2f"),
                     alt.Tooltip("hours:Q", title="hours averaged")],
        )
        .properties(height=7 * 26)
    )
