"""The links in the monitor's tables (pure: a frame in, a frame out; tested without a server).

The tables (queue summary, who waits, agents, idle periods, the runs under the Gantt, and in the
sections cost, wasters, waste and errors) are Streamlit's ``st.dataframe``
(:func:`.widgets.table`); a column of URLs is a ``LinkColumn``. Every URL it gets is checked here
first: a link is drawn only for an absolute http(s) URL that the queue links accept, never a
``javascript:`` or relative target.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import pandas as pd

from prefect_launch.blocks.queue_links import validate_url


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


def linked(frame: pd.DataFrame, links: Iterable[str]) -> pd.DataFrame:
    """``frame`` with each column named in ``links`` holding only safe URLs (:func:`safe_link`; others None).
    ``frame`` itself is left as it is."""
    cols = [c for c in links if c in frame.columns]
    if not cols:
        return frame
    return frame.assign(**{c: [safe_link(v) for v in frame[c].tolist()] for c in cols})
