"""The first page's time charts as one Streamlit component (``st.components.v2``: mounted in the page,
no iframe, no chart library to fetch): bars, step lines and lanes on a canvas, a tooltip per mark and,
on the Gantt, a brush whose span comes back to the script.

The payloads come from :mod:`.chart_data`; ``timeline.js`` draws them (every label as text).
"""

from __future__ import annotations

from typing import Optional

import streamlit as st

from prefect_launch.dashboard.chart_data import Payload
from prefect_launch.dashboard.component_js import script

CSS = """
.lt-chart { position: relative; width: 100%; font: 12px "Source Sans", "Source Sans Pro", sans-serif; color: #31333f; }
.lt-box { position: relative; }
.lt-canvas { display: block; touch-action: none; }
.lt-legend { display: flex; flex-wrap: wrap; gap: 2px 12px; margin: 0 0 4px 0; }
.lt-legend-title { font-weight: 600; margin-right: 4px; }
.lt-legend-item { display: inline-flex; align-items: center; gap: 4px; white-space: nowrap; }
.lt-swatch { width: 10px; height: 10px; border-radius: 2px; display: inline-block; }
.lt-brush { position: absolute; display: none; background: rgba(30, 136, 229, 0.15);
            border-left: 1px solid #1e88e5; border-right: 1px solid #1e88e5; pointer-events: none; }
.lt-tip { position: absolute; display: none; pointer-events: none; z-index: 5; background: #fff; max-width: 420px;
          border: 1px solid #d0d3da; border-radius: 4px; padding: 4px 8px; box-shadow: 0 2px 6px rgba(0,0,0,.15); }
.lt-tip-label { color: #808495; }
.lt-tip-row { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.lt-note { color: #808495; }
"""

_mount = st.components.v2.component("prefect_launch.timeline", js=script("timeline.js"),
                                    css=CSS, isolate_styles=False)


def _span(state) -> Optional[list[float]]:
    """The brushed span (epoch ms) in a chart's state, or None."""
    brush = state.get("brush") if hasattr(state, "get") else None
    return list(brush) if isinstance(brush, (list, tuple)) and len(brush) == 2 else None


def brush_of(key: str) -> Optional[list[float]]:
    """The span brushed on the chart mounted under ``key``, as the browser last sent it."""
    return _span(st.session_state.get(key))


def chart(payload: Payload | bytes, key: str) -> Optional[list[float]]:
    """Draw ``payload`` (or its :meth:`.Payload.packed`, made once for every visit that shows it); return
    the brushed span (epoch ms), or None."""
    data = payload.packed() if isinstance(payload, Payload) else payload
    return _span(_mount(key=key, data=data, default={"brush": None}, on_brush_change=lambda: None))
