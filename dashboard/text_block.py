"""A panel's heading and captions as one Streamlit component (``st.components.v2``: in the page, no
iframe), every text set as text.

``st.subheader`` and ``st.caption`` are each an element that Streamlit's markdown pipeline parses and
renders in the browser, again on every update of the page while it is drawn; the first page held 18 of
them. Their text here is plain (nothing in it is markup), so one element per run of text draws it with
``text_block.js`` for a fraction of that: ``bench/page_parts.py``'s ``markdown-text`` variant puts them
back and times the difference.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import streamlit as st
from pydantic import BaseModel, Field

from prefect_launch.dashboard.component_js import packed, script

COMPONENT = "prefect_launch.text_block"
# Streamlit's own look for a title, a subheader and a caption (its theme's sizes and grey)
CSS = """
.tb-block { color: #31333f; font-family: "Source Sans", "Source Sans Pro", sans-serif; }
.tb-h1 { font-size: 2.75rem; font-weight: 700; line-height: 1.2; margin: 0; padding: 1.25rem 0 0 0; }
.tb-h2 { font-size: 2.25rem; font-weight: 600; line-height: 1.2; margin: 0; padding: 1rem 0 1rem 0; }
.tb-h3 { font-size: 1.5rem; font-weight: 600; line-height: 1.2; margin: 0; padding: 0.5rem 0 0.25rem 0; }
[data-testid="stSidebar"] .tb-h2, [data-testid="stSidebar"] .tb-h3 { font-size: 1.25rem; padding: 0.5rem 0; }
.tb-caption { font-size: 0.875rem; line-height: 1.5; color: rgba(49, 51, 63, 0.6); overflow-wrap: anywhere; }
"""

_mount = st.components.v2.component(COMPONENT, js=script("text_block.js"), css=CSS, isolate_styles=False)


class TextBlock(BaseModel):
    """What one block shows: a heading (``level`` 1: the page's title, 2: a section's, 3: a panel's) and caption
    lines."""

    heading: Optional[str] = None
    level: int = Field(default=3, ge=1, le=3)
    lines: list[str] = Field(default_factory=list)


def text(key: str, heading: Optional[str] = None, lines: Sequence[str] = (), level: int = 3, where=None) -> None:
    """Draw ``heading`` and ``lines`` (plain text, one caption each) as one element under ``key``;
    ``where``: a container to draw in (``st.sidebar``), else where the script draws now."""
    block = TextBlock(heading=heading, level=level, lines=[str(x) for x in lines])
    with where if where is not None else contextlib.nullcontext():
        _mount(key=key, data=packed(block.model_dump()))
