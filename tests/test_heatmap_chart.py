"""The hour x weekday heatmap as an Altair chart (dashboard/charts.py): pure, no server (the browser test
checks the page's figures against occupancy computed from the runs' own state times)."""

from __future__ import annotations

import pandas as pd

from prefect_launch.dashboard import charts
from prefect_launch.dashboard.occupancy import DAYS


def _frame(days=DAYS, hours=range(24)) -> pd.DataFrame:
    rows = [dict(weekday=d, hour=h, busy=(i * 24 + h) / 10.0, gpus=h / 4.0, hours=1 + (h % 2))
            for i, d in enumerate(days) for h in hours]
    return pd.DataFrame(rows)


def test_one_cell_per_hour_shaded_by_load_with_its_figures():
    hm = _frame()
    spec = charts.heatmap_chart(hm).to_dict()
    assert spec["mark"]["type"] == "rect"
    enc = spec["encoding"]
    assert enc["y"]["sort"] == list(DAYS) and enc["x"]["sort"] == list(range(24))  # Monday first, hours across
    assert enc["color"]["field"] == "busy" and "scale" not in enc["color"]  # the theme's colours
    assert [t["field"] for t in enc["tooltip"]] == ["weekday", "hour", "busy", "gpus", "hours"]
    data = pd.DataFrame(next(iter(spec["datasets"].values())))
    assert len(data) == 168 and data[["busy", "gpus", "hours"]].equals(hm[["busy", "gpus", "hours"]])


def test_a_short_range_draws_only_its_hours():
    spec = charts.heatmap_chart(_frame(days=DAYS[:2], hours=range(3))).to_dict()
    assert len(next(iter(spec["datasets"].values()))) == 6
