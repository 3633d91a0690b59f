"""Headline figures (queues busy, capacity held and used, GPU-hours, energy) as one Streamlit component
per row (``st.components.v2``: in the page, no iframe): a label, a value, an optional explanation on
hover. Streamlit's ``st.metric`` drew the same with an element (and its script chunk) per figure;
``figures.js`` sets every label and value as text.
"""

from __future__ import annotations

from typing import Optional, Sequence

import streamlit as st
from pydantic import BaseModel

from prefect_launch.dashboard.component_js import HELP_CSS, packed, script

COMPONENT = "prefect_launch.figures"
CSS = """
.lf-row { display: grid; gap: 16px; width: 100%; color: #31333f; font-family: "Source Sans", "Source Sans Pro", sans-serif; }
.lf-label { font-size: 14px; display: flex; align-items: center; gap: 6px; }
.lf-value { font-size: 2.25rem; line-height: 1.25; overflow-wrap: anywhere; }
"""

_mount = st.components.v2.component(COMPONENT, js=script("figures.js"), css=CSS + HELP_CSS,
                                    isolate_styles=False)


class Figure(BaseModel):
    """One headline figure: what it is, its value as shown, and how it is made (on hover)."""

    label: str
    value: str
    help: Optional[str] = None


class FiguresPayload(BaseModel):
    figures: list[Figure]
    columns: int = 4


def figures(items: Sequence[Figure], key: str, columns: int = 4) -> None:
    """Draw ``items`` in a row of ``columns`` equal cells (wrapping after that). Sent as bytes, as the charts
    and tables are (:func:`.component_js.packed`): the script leaves a row it has drawn as it is."""
    _mount(key=key, data=packed(FiguresPayload(figures=list(items), columns=columns).model_dump()))
