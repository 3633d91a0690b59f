"""The first page's table payloads (dashboard/table_data.py): pure, no server, no browser."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from prefect_launch.dashboard.table_data import safe_link, table_payload


def _frame() -> pd.DataFrame:
    return pd.DataFrame({
        "name": ["<img src=x onerror=alert(1)>", "b", None],
        "priority": pd.array([3, None, 1], dtype="Int64"),
        "queued_s": [1.5, np.nan, 12.25],
        "start": pd.to_datetime(["2026-12-01 10:00:00.250", None, "2026-12-02 00:00:00.000"], utc=True),
        "online": [True, False, True],
        "link": ["https://ui.example/runs/flow-run/1", "javascript:alert(1)", "/runs/flow-run/3"],
    })


def test_payload_kinds_values_and_json():
    p = table_payload(_frame(), "Job runs", labels={"link": "Prefect UI"}, links={"link": "open run"},
                      digits={"queued_s": 1})
    kinds = {c.name: c.kind for c in p.columns}
    assert kinds == {"name": "text", "priority": "number", "queued_s": "number", "start": "time", "online": "text",
                     "link": "link"}
    cols = {c.name: c for c in p.columns}
    assert cols["link"].label == "Prefect UI" and cols["link"].link_text == "open run"
    assert cols["priority"].digits == 0 and cols["queued_s"].digits == 1
    data = dict(zip(kinds, p.data))
    assert data["name"] == ["<img src=x onerror=alert(1)>", "b", None]  # sent as text: the browser sets textContent
    assert data["priority"] == [3, None, 1] and data["queued_s"] == [1.5, None, 12.25]
    assert data["start"][0] == pd.Timestamp("2026-12-01 10:00:00.250", tz="UTC").value / 1e6 and data["start"][1] is None
    assert data["online"] == ["yes", "no", "yes"]
    assert data["link"] == ["https://ui.example/runs/flow-run/1", None, None]  # no script or relative target
    assert p.n == 3 and p.file == "job-runs.csv"
    dumped = p.dump()
    json.dumps(dumped, allow_nan=False)  # strict JSON: no NaN reaches the browser
    assert dumped["sig"] == table_payload(_frame(), "Job runs", labels={"link": "Prefect UI"}, links={"link": "open run"},
                                          digits={"queued_s": 1}).dump()["sig"]
    assert dumped["sig"] != table_payload(_frame().head(2), "Job runs").dump()["sig"]


def test_empty_cells_say_what_they_are():
    p = table_payload(pd.DataFrame({"gpu_energy_wh": [1.5, np.nan], "owner": ["a", None]}), "Cost",
                      empty={"gpu_energy_wh": "unavailable"})
    assert [(c.name, c.empty) for c in p.columns] == [("gpu_energy_wh", "unavailable"), ("owner", "")]
    assert p.data == [[1.5, None], ["a", None]]  # the value stays empty (the CSV too): only the page says why


def test_default_digits_follow_the_values():
    p = table_payload(pd.DataFrame({"whole": [1.0, 2.0], "part": [1.0, 2.5]}), "t")
    assert [c.digits for c in p.columns] == [0, 2]


def test_frame_round_trips_what_the_page_shows():
    f = _frame()
    back = table_payload(f, "t", links={"link": "open"}).frame()
    assert list(back.columns) == list(f.columns)
    assert back["start"].tolist()[::2] == f["start"].tolist()[::2] and pd.isna(back["start"][1])
    assert back["queued_s"].equals(f["queued_s"])
    assert back["priority"].tolist()[0] == 3 and np.isnan(back["priority"].tolist()[1])
    assert back["link"].tolist() == ["https://ui.example/runs/flow-run/1", None, None]


def test_empty_frame_keeps_its_columns():
    p = table_payload(pd.DataFrame(columns=["from", "to", "hours"]), "Idle periods")
    assert p.n == 0 and [c.name for c in p.columns] == ["from", "to", "hours"] and p.data == [[], [], []]


@pytest.mark.parametrize("url, ok", [
    ("https://grafana.example.com/d/x?a=1", True), ("http://127.0.0.1:4200/runs/flow-run/1", True),
    ("HTTPS://EXAMPLE.COM", True), ("javascript:alert(1)", False), ("data:text/html,x", False),
    ("//evil.example/x", False), ("https://", False), ("https://a.example/x y", False),
    ("https://a.example/\nx", False), (None, False), (3, False), ("", False),
])
def test_safe_link(url, ok):
    assert safe_link(url) == (url if ok else None)
