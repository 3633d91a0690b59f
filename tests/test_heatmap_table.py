"""The hour x weekday heatmap drawn as an HTML table: pure, no server (the browser test checks the
drawn cells against occupancy computed from the runs' own state times)."""

from __future__ import annotations

import re

import pandas as pd

from prefect_launch.dashboard import heatmap_table as HT


def _frame(days=HT.DAYS, hours=range(24)) -> pd.DataFrame:
    rows = [dict(weekday=d, hour=h, busy=(i * 24 + h) / 10.0, gpus=h / 4.0, hours=1 + (h % 2))
            for i, d in enumerate(days) for h in hours]
    return pd.DataFrame(rows)


def _cells(html: str) -> list[dict]:
    return [dict(re.findall(r"(data-\w+|title|style)='([^']*)'", td)) for td in re.findall(r"<td class='lh-cell'[^>]*>", html)]


def test_every_cell_says_what_it_holds():
    hm = _frame()
    out = HT.heatmap_html(hm)
    cells = _cells(out)
    assert len(cells) == 168
    by = {(c["data-weekday"], int(c["data-hour"])): c for c in cells}
    for r in hm.itertuples():
        c = by[(r.weekday, r.hour)]
        assert float(c["data-busy"]) == r.busy and float(c["data-gpus"]) == r.gpus
        assert c["title"] == (f"weekday: {r.weekday}; hour: {r.hour}; avg runs holding a slot: {r.busy:.2f}; "
                              f"avg GPUs held: {r.gpus:.2f}; hours averaged: {r.hours}")
    # rows run Monday to Sunday, hours 0..23 across
    order = [(c["data-weekday"], int(c["data-hour"])) for c in cells]
    assert order == [(d, h) for d in HT.DAYS for h in range(24)]
    assert "<span>16.70</span>" in out  # the legend's top: the busiest cell (Sun 23:00)
    assert HT.scale_top(0.0013) == "0.0013" and HT.scale_top(0.0) == "0.00"


def test_shading_is_monotone_from_idle_to_the_busiest():
    top = 7.0
    shades = [HT.colour(v, top) for v in [0, 0.5, 1, 2, 3.5, 5, 6.9, 7]]
    assert shades[0] == HT.BLUES[0] and shades[-1] == HT.BLUES[-1]
    lum = [sum(int(s[i:i + 2], 16) for i in (1, 3, 5)) for s in shades]
    assert all(a > b for a, b in zip(lum, lum[1:])), lum  # darker as the load grows
    assert HT.colour(3.0, 0.0) == HT.BLUES[0]  # nothing held anywhere: all idle
    assert HT.colour(float("nan"), top) == HT.BLUES[0]
    assert HT.colour(99.0, top) == HT.BLUES[-1]


def test_hours_the_range_does_not_hold_are_blank_not_idle():
    out = HT.heatmap_html(_frame(days=("Tue", "Wed"), hours=range(6, 18)))
    cells = _cells(out)
    assert len(cells) == 2 * 12
    assert out.count("not in the range") == 168 - 24
    assert all(c["data-weekday"] in ("Tue", "Wed") for c in cells)


def test_empty_frame_draws_a_blank_week():
    out = HT.heatmap_html(_frame(days=()))
    assert _cells(out) == [] and out.count("not in the range") == 168
