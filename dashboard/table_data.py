"""What each table of the queue monitor sends to the browser (pure: a frame in, a plain payload
out; tested without a server or a browser).

The monitor's tables (queue summary, who waits, agents, idle periods, the runs under the Gantt, and
in the sections cost, wasters, waste and errors) are drawn by :mod:`.light_table`, rows as text in
the page, only those scrolled into view. Streamlit's data grid cost a new visitor about half a second
of the first page's wait and 0.3 s of the browser's CPU (its 1.7 MB of scripts fetched and compiled,
every grid laid out: ``bench/results/dashboard_first_page_tables.txt``) for tables a person reads,
sorts and downloads.

The payload is columnar: ``data[i]`` holds column ``i``'s values, each a number, a string, epoch ms
(``kind == "time"``) or None. Nothing here is HTML: the browser sets every cell as text, and a link
is drawn only for an http(s) URL checked here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, Mapping, Optional

import numpy as np
import pandas as pd
from pydantic import BaseModel

from prefect_launch.blocks.queue_links import validate_url
from prefect_launch.dashboard.component_js import packed

Kind = Literal["text", "number", "time", "link"]


class Column(BaseModel):
    """One column as the browser draws it: ``name`` heads the CSV, ``label`` the table."""

    name: str
    label: str
    kind: Kind = "text"
    digits: int = 0  # decimals shown for a number
    link_text: Optional[str] = None  # a link's text (its URL when None)
    empty: str = ""  # what an empty cell shows (e.g. "unavailable": not measured)


class TablePayload(BaseModel):
    """Everything :mod:`.light_table`'s script needs to draw one table."""

    title: str  # the table's accessible name
    file: str  # the CSV download's file name
    rows_shown: int = 10  # rows in view before the table scrolls
    n: int
    columns: list[Column]
    data: list[list[Any]]

    def packed(self) -> bytes:
        """The payload as the component gets it (:func:`.component_js.packed`: led by ``sig``, by which a
        rerun sending the same table keeps the one drawn, its sort and scroll, without parsing it)."""
        return packed(self.model_dump())

    def dump(self) -> dict:
        """:meth:`packed` as a dict (for checks)."""
        return json.loads(self.packed())

    def frame(self) -> pd.DataFrame:
        """The table as a frame again (times as UTC timestamps): what the page shows, for tests and checks."""
        cols = {}
        for c, vals in zip(self.columns, self.data):
            if c.kind == "time":
                ms = pd.Series(vals, dtype="float64").round().astype("Int64")  # whole ms: no float error in ns
                cols[c.name] = pd.to_datetime(ms, unit="ms", utc=True)
            elif c.kind == "number":
                cols[c.name] = pd.Series(vals, dtype="float64")
            else:
                cols[c.name] = pd.Series(vals, dtype="object")
        return pd.DataFrame(cols, columns=[c.name for c in self.columns])


def safe_link(value: Any) -> Optional[str]:
    """``value`` when it is a URL the queue links accept (:func:`~prefect_launch.blocks.queue_links.validate_url`:
    absolute http(s), a host, no whitespace or control characters), else None: drawn as no link, never a
    ``javascript:`` or relative target."""
    if not isinstance(value, str):
        return None
    try:
        return value if validate_url(value) == value else None
    except ValueError:
        return None


def _number(v: Any) -> Optional[float | int]:
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    f = float(v)
    if not math.isfinite(f):
        return None
    return int(f) if f.is_integer() and abs(f) < 2**53 else f


def _text(v: Any) -> Optional[str]:
    if v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, pd.Timestamp):
        return f"{v:%Y-%m-%d %H:%M:%S}"
    return str(v)


def _kind(s: pd.Series) -> Kind:
    if pd.api.types.is_bool_dtype(s):
        return "text"
    if pd.api.types.is_datetime64_any_dtype(s):
        return "time"
    if pd.api.types.is_numeric_dtype(s):
        return "number"
    vals = s.dropna()
    if len(vals) and all(isinstance(v, pd.Timestamp) for v in vals):
        return "time"
    if len(vals) and all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
                         for v in vals):
        return "number"
    return "text"


def _times(s: pd.Series) -> list[Optional[float]]:
    t = pd.to_datetime(s, utc=True)
    ms = (t - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(milliseconds=1)
    return [None if math.isnan(x) else float(x) for x in ms.astype("float64")]


def table_payload(frame: pd.DataFrame, title: str, *, file: Optional[str] = None,
                  labels: Optional[Mapping[str, str]] = None, digits: Optional[Mapping[str, int]] = None,
                  links: Optional[Mapping[str, str]] = None, empty: Optional[Mapping[str, str]] = None,
                  rows_shown: int = 10) -> TablePayload:
    """``frame`` as the browser draws it. ``labels``: a column's heading (its name otherwise);
    ``digits``: decimals of a number column (0 when every value is whole, else 2); ``links``: columns
    holding URLs, each with the text its links show; ``empty``: what a column's empty cells show
    (nothing otherwise; the CSV leaves them empty)."""
    labels, digits, links, empty = labels or {}, digits or {}, links or {}, empty or {}
    columns, data = [], []
    for name in frame.columns:
        s = frame[name]
        key = str(name)
        if key in links:
            columns.append(Column(name=key, label=labels.get(key, key), kind="link", link_text=links[key],
                                  empty=empty.get(key, "")))
            data.append([safe_link(v) for v in s.tolist()])
            continue
        kind = _kind(s)
        if kind == "time":
            vals: list[Any] = _times(s)
        elif kind == "number":
            vals = [_number(v) for v in s.astype("object").tolist()]
        else:
            vals = [_text(v) for v in s.astype("object").tolist()]
        d = digits.get(key)
        if kind == "number" and d is None:
            d = 0 if all(v is None or float(v).is_integer() for v in vals) else 2
        columns.append(Column(name=key, label=labels.get(key, key), kind=kind, digits=d or 0, empty=empty.get(key, "")))
        data.append(vals)
    return TablePayload(title=title, file=file or re.sub(r"[^A-Za-z0-9_.-]+", "-", title.lower()).strip("-") + ".csv",
                        rows_shown=rows_shown, n=len(frame), columns=columns, data=data)
