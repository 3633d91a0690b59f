"""The monitor's table links and column config (dashboard/table_data.py, widgets.py): pure, no server, no browser."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from prefect_launch.dashboard.table_data import linked, safe_link


def _frame() -> pd.DataFrame:
    return pd.DataFrame({
        "name": ["<img src=x onerror=alert(1)>", "b", None],
        "priority": pd.array([3, None, 1], dtype="Int64"),
        "queued_s": [1.5, np.nan, 12.25],
        "start": pd.to_datetime(["2026-12-01 10:00:00.250", None, "2026-12-02 00:00:00.000"], utc=True),
        "online": [True, False, True],
        "link": ["https://ui.example/runs/flow-run/1", "javascript:alert(1)", "/runs/flow-run/3"],
    })


def test_link_columns_hold_only_safe_urls():
    f = _frame()
    shown = linked(f, ["link", "not_a_column"])
    assert [v if isinstance(v, str) else None for v in shown["link"]] == ["https://ui.example/runs/flow-run/1", None,
                                                                          None]  # no script or relative target
    assert shown.drop(columns=["link"]).equals(f.drop(columns=["link"]))  # the rest as it was
    assert f["link"].tolist()[1] == "javascript:alert(1)"  # the frame given is left as it is
    assert linked(f, []) is f


def test_table_config_labels_digits_times_and_links():
    """What st.dataframe gets (dashboard/widgets.py): headings, decimals, UTC times, a LinkColumn for URLs."""
    from prefect_launch.dashboard.widgets import column_config

    cfg = column_config(_frame(), labels={"link": "Prefect UI", "name": "run"}, digits={"queued_s": 1},
                        links={"link": "open run"})
    assert cfg["link"]["label"] == "Prefect UI" and cfg["link"]["type_config"]["type"] == "link"
    assert cfg["link"]["type_config"]["display_text"] == "open run"
    assert cfg["queued_s"]["type_config"]["format"] == "%.1f"
    assert cfg["start"]["type_config"]["type"] == "datetime" and cfg["name"]["label"] == "run"
    assert "priority" not in cfg and "online" not in cfg  # Streamlit's own way


@pytest.mark.parametrize("url, ok", [
    ("https://grafana.example.com/d/x?a=1", True), ("http://127.0.0.1:4200/runs/flow-run/1", True),
    ("HTTPS://EXAMPLE.COM", True), ("javascript:alert(1)", False), ("data:text/html,x", False),
    ("//evil.example/x", False), ("https://", False), ("https://a.example/x y", False),
    ("https://a.example/\nx", False), (None, False), (3, False), ("", False),
])
def test_safe_link(url, ok):
    assert safe_link(url) == (url if ok else None)
