"""The hour x weekday load heatmap as a table of shaded cells (the frame from :func:`.occupancy.heatmap`
in), drawn by a Streamlit component (``heatmap.js``, ``st.components.v2``: in the page, no iframe).

Why not Vega: drawn by Vega, 168 cells cost a 100k-run page ~0.8 s of the browser's time on every
visit (SVG, each cell's description built through Streamlit's expression interpreter), the most of
any chart on it. Why not ``st.html``: Streamlit runs its HTML through DOMPurify, a script each new
visitor fetches and runs for this one table. A table of 168 coloured cells is laid out in a few
milliseconds, and each cell still says what it holds: its tooltip (``title``) and ``aria-label`` give
the weekday, hour and figures, and ``data-*`` attributes carry the raw numbers for scripts and tests.
:func:`heatmap_payload` is pure: frame in, cells out; the script sets every text as text.
"""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd
import streamlit as st
from pydantic import BaseModel

from prefect_launch.dashboard.component_js import packed, script
from prefect_launch.dashboard.occupancy import DAYS  # the weekday names the heatmap frame carries

# ColorBrewer "Blues" (9 classes), the scheme the Vega heatmap used: light = idle, dark = busy
BLUES = ("#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b")
EMPTY = "#ffffff"  # an hour the range does not hold (a range shorter than a week)

CSS = """
.lh-heat { border-collapse: collapse; width: 100%; table-layout: fixed; font: 11px "Source Sans", "Source Sans Pro", sans-serif; }
.lh-heat td { height: 22px; padding: 0; border: 1px solid #fff; }
.lh-heat th { font-weight: 400; color: #555; padding: 0 4px 0 0; text-align: right; white-space: nowrap; }
.lh-heat thead th { text-align: center; padding: 0; }
.lh-heat .lh-day { width: 34px; }
.lh-legend { display: flex; align-items: center; gap: 6px; font: 11px "Source Sans", "Source Sans Pro", sans-serif; color: #555;
             margin-top: 4px; }
.lh-legend span.bar { flex: 0 0 140px; height: 10px; }
"""

_mount = st.components.v2.component("prefect_launch.heatmap", js=script("heatmap.js"), css=CSS, isolate_styles=False)


def _mix(a: str, b: str, t: float) -> str:
    ca, cb = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (a, b))
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))


def colour(value: float, top: float) -> str:
    """``value`` on a linear 0..``top`` scale through BLUES (``top`` <= 0: every cell the lightest)."""
    if not math.isfinite(value) or top <= 0:
        return BLUES[0]
    x = min(max(value / top, 0.0), 1.0) * (len(BLUES) - 1)
    k = min(int(x), len(BLUES) - 2)
    return _mix(BLUES[k], BLUES[k + 1], x - k)


def scale_top(top: float) -> str:
    """The legend's top figure: two decimals, or two significant digits for a load below 0.1."""
    return f"{top:,.2f}" if top >= 0.1 or top == 0 else f"{top:.2g}"


def _label(day: str, hour: int, busy: float, gpus: float, hours: int) -> str:
    return (f"weekday: {day}; hour: {hour}; avg runs holding a slot: {busy:.2f}; avg GPUs held: {gpus:.2f}; "
            f"hours averaged: {hours}")


class HeatCell(BaseModel):
    """One hour of one weekday the range holds: its shade and what it says (tooltip and screen reader)."""

    colour: str
    label: str
    busy: float
    gpus: float


class HeatRow(BaseModel):
    day: str
    cells: list[Optional[HeatCell]]  # hours 0..23; None: an hour the range does not hold


class HeatmapPayload(BaseModel):
    rows: list[HeatRow]  # Monday to Sunday
    top: str  # the legend's top figure
    legend: list[str] = list(BLUES)
    empty: str = EMPTY


def heatmap_payload(hm: pd.DataFrame) -> HeatmapPayload:
    """One row per weekday, one cell per UTC hour, shaded by the mean runs holding a slot, with a
    legend giving the scale's ends. ``hm``: columns weekday, hour, busy, gpus, hours."""
    top = float(hm["busy"].max()) if len(hm) else 0.0
    cells = {(r.weekday, int(r.hour)): r for r in hm.itertuples(index=False)}
    rows = []
    for day in DAYS:
        out: list[Optional[HeatCell]] = []
        for hour in range(24):
            r = cells.get((day, hour))
            if r is None:
                out.append(None)
                continue
            busy, gpus = float(r.busy), float(r.gpus)
            out.append(HeatCell(colour=colour(busy, top), label=_label(day, hour, busy, gpus, int(r.hours)),
                                busy=busy, gpus=gpus))
        rows.append(HeatRow(day=day, cells=out))
    return HeatmapPayload(rows=rows, top=scale_top(top))


def payload(hm: pd.DataFrame) -> bytes:
    """What :func:`draw` mounts for ``hm`` (built once per view)."""
    return packed(heatmap_payload(hm).model_dump())


def draw(data: bytes, key: str) -> None:
    """Mount a heatmap built by :func:`payload`."""
    _mount(key=key, data=data)
