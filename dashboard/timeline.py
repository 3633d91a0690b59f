"""The first page's time charts as the monitor's one custom Streamlit component (``st.components.v2``:
mounted in the page, no iframe): bars, step lines and lanes on a canvas, a tooltip per mark and, on the
Gantt, a brush whose span comes back to the script. Streamlit has nothing that draws a Gantt of 100k
runs with a brush; everything else on the pages is Streamlit's own (:mod:`.widgets`).

The payloads come from :mod:`.chart_data`; ``timeline.js`` draws them (every label as text) in the
theme's colours (Streamlit's ``--st-*`` variables: text, grid, font and the categorical palette).
Where this Streamlit has no ``st.components.v2`` (or the component cannot be made), each chart is a
table of the frame it was drawn from instead (:func:`chart`'s ``fallback``), and the Gantt's runs are
in the runs table under it, as always.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st

from prefect_launch.dashboard.chart_data import Payload

CSS = """
.lt-chart { position: relative; width: 100%; font: 12px var(--st-font, "Source Sans", sans-serif);
            color: var(--st-text-color, #31333f); }
.lt-box { position: relative; }
.lt-canvas { display: block; touch-action: none; }
.lt-legend { display: flex; flex-wrap: wrap; gap: 2px 12px; margin: 0 0 4px 0; }
.lt-legend-title { font-weight: 600; margin-right: 4px; }
.lt-legend-item { display: inline-flex; align-items: center; gap: 4px; white-space: nowrap; }
.lt-swatch { width: 10px; height: 10px; border-radius: 2px; display: inline-block; }
.lt-brush { position: absolute; display: none; background: color-mix(in srgb, var(--st-primary-color, #1e88e5) 15%, transparent);
            border-left: 1px solid var(--st-primary-color, #1e88e5); border-right: 1px solid var(--st-primary-color, #1e88e5);
            pointer-events: none; }
.lt-tip { position: absolute; display: none; pointer-events: none; z-index: 5; max-width: 420px;
          background: var(--st-background-color, #fff); color: var(--st-text-color, #31333f);
          border: 1px solid var(--st-border-color, #d0d3da); border-radius: 4px; padding: 4px 8px;
          box-shadow: 0 2px 6px rgba(0,0,0,.15); }
.lt-tip-label { color: var(--st-gray-text-color, #808495); }
.lt-tip-row { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.lt-note { color: var(--st-gray-text-color, #808495); }
"""


def _make():
    """The component, or None where this Streamlit cannot make it (then the charts are tables)."""
    try:
        return st.components.v2.component("prefect_launch.timeline", css=CSS, isolate_styles=False,
                                          js=(Path(__file__).parent / "timeline.js").read_text())
    except Exception:  # noqa: BLE001  no components.v2 in this Streamlit, or it refused the component
        return None


_mount = _make()


def available() -> bool:
    """Whether the charts are drawn by the component (False: as tables)."""
    return _mount is not None


def _span(state) -> Optional[list[float]]:
    """The brushed span (epoch ms) in a chart's state, or None."""
    brush = state.get("brush") if hasattr(state, "get") else None
    return list(brush) if isinstance(brush, (list, tuple)) and len(brush) == 2 else None


def brush_of(key: str) -> Optional[list[float]]:
    """The span brushed on the chart mounted under ``key``, as the browser last sent it."""
    return _span(st.session_state.get(key))


def chart(payload: Payload | bytes, key: str, fallback: Optional[pd.DataFrame] = None) -> Optional[list[float]]:
    """Draw ``payload`` (or its :meth:`.Payload.packed`, made once for every visit that shows it); return
    the brushed span (epoch ms), or None. Without the component: ``fallback`` (the frame the chart was
    made from) as a table, and no brush."""
    if _mount is None:
        if fallback is not None:
            shown = fallback if isinstance(fallback.index, pd.RangeIndex) else fallback.reset_index()
            st.dataframe(shown, hide_index=True, width="stretch", height=min(38 + 35 * len(shown), 300), key=key)
        return None
    data = payload.packed() if isinstance(payload, Payload) else payload
    return _span(_mount(key=key, data=data, default={"brush": None}, on_brush_change=lambda: None))
