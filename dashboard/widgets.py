"""The monitor's controls, headings, captions, figures and tables, as Streamlit's own widgets.

One place decides how the pages draw each kind of thing, so both pages read the same way and
AppTest (``streamlit.testing.v1``) can read and drive every part of them:

* choices: :func:`pick` (several: ``st.pills``, a ``st.multiselect`` past :data:`PILLS_MAX` options)
  and :func:`single` (one: ``st.segmented_control``, always one chosen);
* :func:`heading`: a title or subheader and its caption lines (``st.caption``), every text drawn as
  written (:func:`.caption_text.plain`: nothing in it is taken as markdown);
* :func:`figures`: a row of ``st.metric``;
* :func:`table`: ``st.dataframe`` with its ``column_config`` (labels, decimals, times, and a
  ``LinkColumn`` for URLs, each checked by :func:`.table_data.safe_link` first: a URL that does not
  validate is shown as no link).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import pandas as pd
import streamlit as st

from prefect_launch.dashboard.caption_text import plain
from prefect_launch.dashboard.table_data import linked

PILLS_MAX = 8  # a choice among at most this many is drawn as pills; among more, as a multiselect
ROW_PX, HEAD_PX = 35, 38  # st.dataframe's row and header heights: a table shows ``rows_shown`` rows, then scrolls


def _where(where):
    return where if where is not None else st


def pick(label: str, options: Sequence[str], key: str, placeholder: str, where=None,
         heading: Optional[str] = None) -> list:
    """Several of ``options`` (none chosen: all), kept in ``st.session_state[key]``. An option that is gone
    is dropped from the choice; the choice stays when the options grow past :data:`PILLS_MAX` (the pills
    become a multiselect under the same key) or shrink back."""
    options = [str(o) for o in options]
    ss = st.session_state
    kind = "pills" if len(options) <= PILLS_MAX else "multiselect"
    was = list(ss.get(key) or []) if ss.get(f"{key}__kind") == kind else list(ss.get(f"{key}__kept") or [])
    now = [v for v in was if v in options]
    if ss.get(f"{key}__kind") != kind or now != was:
        ss[key] = now  # before the widget is drawn (Streamlit allows it then): a new kind of control starts with it
    ss[f"{key}__kind"] = kind
    w = _where(where)
    if heading:
        w.subheader(heading)
    if kind == "pills":
        got = w.pills(label, options, selection_mode="multi", key=key, help=f"None chosen: {placeholder}.")
    else:
        got = w.multiselect(label, options, key=key, placeholder=placeholder)
    ss[f"{key}__kept"] = list(got or [])
    return list(got or [])


def single(label: str, options: Sequence, key: str, default: Any, where=None, shown: Callable[[Any], str] = str,
           hide_label: bool = False):
    """One of ``options`` (``default`` until another is clicked; clicking the chosen one keeps it)."""
    ss = st.session_state
    if ss.get(key) not in options:
        ss[key] = default
    got = _where(where).segmented_control(label, list(options), key=key, required=True, format_func=shown,
                                          label_visibility="collapsed" if hide_label else "visible")
    return default if got is None else got


def heading(title: Optional[str] = None, lines: Sequence[str] = (), level: int = 3, where=None) -> None:
    """``title`` (``level`` 1: the page's title, 3: a panel's) and one caption per line, all drawn as written."""
    w = _where(where)
    if title:
        (w.title if level == 1 else w.header if level == 2 else w.subheader)(plain(title))
    for line in lines:
        w.caption(plain(str(line)))


def figures(items: Sequence[tuple], where=None) -> None:
    """A row of headline figures: ``(label, value)`` or ``(label, value, help)`` each, as ``st.metric``."""
    cols = _where(where).columns(len(items))
    for col, item in zip(cols, items):
        label, value, *rest = item
        col.metric(label, value, help=rest[0] if rest else None)


def column_config(frame: pd.DataFrame, labels: Mapping[str, str], digits: Mapping[str, int],
                  links: Mapping[str, str]) -> dict:
    """``st.dataframe``'s column_config for ``frame``: headings, decimals, UTC times, links."""
    cfg: dict = {}
    for name in frame.columns:
        key = str(name)
        label = labels.get(key, key)
        if key in links:
            cfg[key] = st.column_config.LinkColumn(label, display_text=links[key])
        elif key in digits:
            cfg[key] = st.column_config.NumberColumn(label, format=f"%.{digits[key]}f")
        elif pd.api.types.is_datetime64_any_dtype(frame[name]):
            cfg[key] = st.column_config.DatetimeColumn(label, format="YYYY-MM-DD HH:mm:ss")
        elif key in labels:
            cfg[key] = st.column_config.Column(label)
    return cfg


def table(frame: pd.DataFrame, key: str, *, labels: Optional[Mapping[str, str]] = None,
          digits: Optional[Mapping[str, int]] = None, links: Optional[Mapping[str, str]] = None,
          empty: Optional[str] = None, rows_shown: int = 10, where=None) -> None:
    """``frame`` as ``st.dataframe``. ``labels``: a column's heading; ``digits``: decimals of a number column;
    ``links``: columns of URLs with the text each link shows (URLs that do not validate: no link);
    ``empty``: what an empty cell shows; ``rows_shown``: rows in view before the table scrolls."""
    labels, digits, links = labels or {}, digits or {}, links or {}
    shown = linked(frame, links)
    height: Any = "auto" if len(shown) <= rows_shown else HEAD_PX + ROW_PX * rows_shown
    _where(where).dataframe(shown, hide_index=True, width="stretch", height=height, key=key, placeholder=empty,
                            column_config=column_config(shown, labels, digits, links))
