"""The first page's tables as one Streamlit component (``st.components.v2``: mounted in the page, no
iframe, no grid library to fetch): sortable headings, rows built as they scroll into view, a CSV
download. The payloads come from :mod:`.table_data`; ``light_table.js`` draws them (every cell as text). The
monitor draws all its tables so (Streamlit's data grid cost a new visitor about a second, and a
section chosen later the same again); the sessions page keeps the grid.
"""

from __future__ import annotations

from typing import Mapping, Optional

import pandas as pd
import streamlit as st

from prefect_launch.dashboard.component_js import script
from prefect_launch.dashboard.table_data import table_payload

COMPONENT = "prefect_launch.table"
CSS = """
.lt-table { width: 100%; font: 14px "Source Sans", "Source Sans Pro", sans-serif; color: #31333f; }
.lt-table-bar { display: flex; align-items: center; justify-content: space-between; margin: 0 0 4px 0; }
.lt-table-count { color: #808495; font-size: 12px; }
.lt-table-csv { font: inherit; font-size: 12px; color: #31333f; background: #fff; border: 1px solid #d0d3da;
                border-radius: 4px; padding: 1px 8px; cursor: pointer; }
.lt-table-csv:hover { border-color: #ff4b4b; color: #ff4b4b; }
.lt-table-scroll { overflow: auto; border: 1px solid #e6e9ef; border-radius: 4px; }
.lt-table-inner { position: relative; }
.lt-tr { display: grid; grid-template-columns: var(--lt-cols); height: 28px; box-sizing: border-box;
         border-bottom: 1px solid #f0f2f6; }
.lt-rows > .lt-tr { position: absolute; left: 0; right: 0; }
.lt-thead { position: sticky; top: 0; z-index: 1; background: #f8f9fb; border-bottom: 1px solid #e6e9ef; }
.lt-th { font: inherit; font-weight: 600; color: #555867; text-align: left; background: none; border: 0;
         padding: 0 8px; cursor: pointer; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.lt-th[aria-sort="ascending"]::after { content: " ▲"; font-size: 10px; }
.lt-th[aria-sort="descending"]::after { content: " ▼"; font-size: 10px; }
.lt-td { padding: 0 8px; line-height: 27px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.lt-num { text-align: right; font-variant-numeric: tabular-nums; }
.lt-td a { color: #1e88e5; }
.lt-table-empty { color: #808495; padding: 4px 0; }
"""

_mount = st.components.v2.component(COMPONENT, js=script("light_table.js"), css=CSS,
                                    isolate_styles=False)


def payload(frame: pd.DataFrame, title: str, *, labels: Optional[Mapping[str, str]] = None,
            digits: Optional[Mapping[str, int]] = None, links: Optional[Mapping[str, str]] = None,
            empty: Optional[Mapping[str, str]] = None, rows_shown: int = 10, file: Optional[str] = None) -> bytes:
    """What :func:`draw` mounts for ``frame`` (see :func:`.table_data.table_payload` for the options)."""
    return table_payload(frame, title, file=file, labels=labels, digits=digits, links=links, empty=empty,
                         rows_shown=rows_shown).packed()


def draw(data: bytes, key: str) -> None:
    """Mount a table built by :func:`payload` (built once, drawn by every visit that shows it)."""
    _mount(key=key, data=data)


def table(frame: pd.DataFrame, key: str, title: str, **options) -> None:
    """Draw ``frame`` (the options are :func:`payload`'s)."""
    draw(payload(frame, title, **options), key)
