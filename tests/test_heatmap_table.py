"""The hour x weekday heatmap's cells: pure, no server (the browser test checks the drawn cells against
occupancy computed from the runs' own state times)."""

from __future__ import annotations

import json

import pandas as pd

from prefect_launch.dashboard import heatmap_table as HT


def _frame(days=HT.DAYS, hours=range(24)) -> pd.DataFrame:
    rows = [dict(weekday=d, hour=h, busy=(i * 24 + h) / 10.0, gpus=h / 4.0, hours=1 + (h % 2))
            for i, d in enumerate(days) for h in hours]
    return pd.DataFrame(rows)


def _cells(p: HT.HeatmapPayload) -> list[tuple[str, int, HT.HeatCell]]:
    return [(row.day, hour, c) for row in p.rows for hour, c in enumerate(row.cells) if c is not None]


def test_every_cell_says_what_it_holds():
    hm = _frame()
    p = HT.heatmap_payload(hm)
    cells = _cells(p)
    assert len(cells) == 168
    by = {(d, h): c for d, h, c in cells}
    for r in hm.itertuples():
        c = by[(r.weekday, r.hour)]
        assert c.busy == r.busy and c.gpus == r.gpus
        assert c.label == (f"weekday: {r.weekday}; hour: {r.hour}; avg runs holding a slot: {r.busy:.2f}; "
                           f"avg GPUs held: {r.gpus:.2f}; hours averaged: {r.hours}")
        assert c.colour == HT.colour(r.busy, hm["busy"].max())
    # rows run Monday to Sunday, hours 0..23 across
    assert [row.day for row in p.rows] == list(HT.DAYS) and all(len(row.cells) == 24 for row in p.rows)
    assert p.top == "16.70"  # the legend's top: the busiest cell (Sun 23:00)
    assert HT.scale_top(0.0013) == "0.0013" and HT.scale_top(0.0) == "0.00"
    sent = json.loads(HT.payload(hm))  # the bytes the script gets: led by their digest, the same cells
    assert list(sent)[0] == "sig" and sent["rows"] == json.loads(p.model_dump_json())["rows"]


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
    p = HT.heatmap_payload(_frame(days=("Tue", "Wed"), hours=range(6, 18)))
    cells = _cells(p)
    assert len(cells) == 2 * 12
    assert sum(c is None for row in p.rows for c in row.cells) == 168 - 24
    assert {d for d, _h, _c in cells} == {"Tue", "Wed"} and {h for _d, h, _c in cells} == set(range(6, 18))


def test_empty_frame_draws_a_blank_week():
    p = HT.heatmap_payload(_frame(days=()))
    assert _cells(p) == [] and all(c is None for row in p.rows for c in row.cells) and p.top == "0.00"
