"""The hour x weekday load heatmap as a plain HTML table (the frame from :func:`.occupancy.heatmap` in).

Why not Vega: drawn by Vega, 168 cells cost a 100k-run page ~0.8 s of the browser's time on every
visit (SVG, each cell's description built through Streamlit's expression interpreter), the most of
any chart on it. A table of 168 coloured cells is laid out in a few milliseconds, and each cell still
says what it holds: its tooltip (``title``) and ``aria-label`` give the weekday, hour and figures,
and ``data-*`` attributes carry the raw numbers for scripts and tests. Pure: frame in, HTML out.
"""

from __future__ import annotations

import html
import math

import pandas as pd

from prefect_launch.dashboard.occupancy import DAYS  # the weekday names the heatmap frame carries

# ColorBrewer "Blues" (9 classes), the scheme the Vega heatmap used: light = idle, dark = busy
BLUES = ("#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b")
EMPTY = "#ffffff"  # an hour the range does not hold (a range shorter than a week)


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


def heatmap_html(hm: pd.DataFrame) -> str:
    """One row per weekday, one cell per UTC hour, shaded by the mean runs holding a slot, with a
    legend giving the scale's ends. ``hm``: columns weekday, hour, busy, gpus, hours."""
    top = float(hm["busy"].max()) if len(hm) else 0.0
    cells = {(r.weekday, int(r.hour)): r for r in hm.itertuples(index=False)}
    css = ("<style>.lh-heat{border-collapse:collapse;width:100%;table-layout:fixed;font-size:11px}"
           ".lh-heat td{height:22px;padding:0;border:1px solid #fff}"
           ".lh-heat th{font-weight:400;color:#555;padding:0 4px 0 0;text-align:right;white-space:nowrap}"
           ".lh-heat thead th{text-align:center;padding:0}.lh-heat .lh-day{width:34px}"
           ".lh-legend{display:flex;align-items:center;gap:6px;font-size:11px;color:#555;margin-top:4px}"
           ".lh-legend span.bar{flex:0 0 140px;height:10px;background:linear-gradient(90deg,"
           + ",".join(BLUES) + ")}</style>")
    head = "<tr><th class='lh-day'></th>" + "".join(
        f"<th>{h if h % 3 == 0 else ''}</th>" for h in range(24)) + "</tr>"
    rows = []
    for day in DAYS:
        tds = []
        for hour in range(24):
            r = cells.get((day, hour))
            if r is None:
                tds.append(f"<td style='background:{EMPTY}' title='{day} {hour:02d}:00: not in the range'></td>")
                continue
            busy, gpus, n = float(r.busy), float(r.gpus), int(r.hours)
            text = html.escape(_label(day, hour, busy, gpus, n), quote=True)
            tds.append(f"<td class='lh-cell' style='background:{colour(busy, top)}' title='{text}' aria-label='{text}' "
                       f"data-weekday='{day}' data-hour='{hour}' data-busy='{busy!r}' data-gpus='{gpus!r}'></td>")
        rows.append(f"<tr><th class='lh-day'>{day}</th>{''.join(tds)}</tr>")
    legend = (f"<div class='lh-legend'><span>avg runs holding a slot</span><span>0</span><span class='bar'></span>"
              f"<span>{scale_top(top)}</span></div>")
    return (f"{css}<table class='lh-heat' role='table' aria-label='held load by hour of day and weekday (UTC)'>"
            f"<thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>{legend}")
