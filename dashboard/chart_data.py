"""What each time chart of the monitor's first page sends to the browser (pure: frames in, plain
dicts out; tested without a server or a browser).

The first page's time charts (load, job status, queued time, the runs Gantt and its lanes) are drawn
by :mod:`.timeline` on one canvas each. Vega through Streamlit spent seconds per visit on them (its
library fetched and compiled, every mark encoded through a CSP-safe expression interpreter: about
1 s of the renderer's CPU per visit, docs/benchmarks.md), where a person only needs bars, step lines, lanes, a tooltip and a brush.

A payload is columnar: ``items`` holds one entry per mark (``x``/``x2``: epoch ms, ``y0``/``y1``: the
value span a bar covers, or ``row`` for a lane, ``c``: the index of its series in ``names``/``colors``)
and ``tips`` the tooltip's lines, each a label, a format and either a column aligned with the items or
the item field it reads (``"x"``, ``"x2"``, ``"name"``: the series name, ``"row"``: the lane). Nothing
here is HTML: the browser sets every label as text.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field

from prefect_launch.dashboard.spec import STATUS_COLORS, STATUSES

# Tableau 20 (as Vega's "tableau20" scheme), the colours the charts used before
PALETTE = ("#4c78a8", "#9ecae9", "#f58518", "#ffbf79", "#54a24b", "#88d27a", "#b79a20", "#f2cf5b", "#439894",
           "#83bcb6", "#e45756", "#ff9d98", "#79706e", "#bab0ac", "#d67195", "#fcbfd2", "#b279a2", "#d6a5c9",
           "#9e765f", "#d8b5a5")
EPOCH = pd.Timestamp(0, tz="UTC")
TIME = "time"  # a tip's format: the epoch ms as YYYY-MM-DD HH:MM:SS UTC


class Tip(BaseModel):
    """One line of a mark's tooltip: ``label: value``."""

    label: str
    fmt: Any = None  # "time", a number of decimals, or None (as text)
    src: Optional[str] = None  # an item field ("x", "x2", "name", "row") ...
    values: Optional[list] = None  # ... or a column aligned with the items


class Rule(BaseModel):
    """A horizontal line across the plot (the agents' GPUs on the load chart)."""

    y: float
    color: str = "#d62728"
    label: str = ""


class Payload(BaseModel):
    """Everything :mod:`.timeline`'s script needs to draw one chart."""

    kind: str  # "bars" (stacked, y0..y1), "steps" (a step line per series), "lanes" (x..x2 on a row)
    title: str  # the canvas's accessible name
    height: int
    x0: float  # the time axis' domain, epoch ms
    x1: float
    x_title: str = "time"
    y_title: str = ""
    names: list[str] = Field(default_factory=list)
    colors: list[str] = Field(default_factory=list)
    themed: bool = False  # series without a meaning of their own: drawn in the theme's categorical colours
    rows: list[str] = Field(default_factory=list)  # lane labels, top to bottom
    items: dict[str, list] = Field(default_factory=dict)
    tips: list[Tip] = Field(default_factory=list)
    rules: list[Rule] = Field(default_factory=list)
    legend: bool = True
    legend_title: str = ""
    brush: bool = False
    selected: Optional[list[float]] = None  # the brush shown, epoch ms (kept across reruns)
    note: str = ""  # said under the chart (e.g. series folded away)

    def packed(self) -> bytes:
        """The payload as the component gets it (:func:`packed`: led by ``sig``, by which the
        browser tells a rerun's unchanged chart, kept as drawn, from a new one without parsing it)."""
        return packed(self.model_dump(exclude_none=True))

    def dump(self) -> dict:
        """:meth:`packed` as a dict (for checks)."""
        return json.loads(self.packed())


def packed(payload: dict) -> bytes:
    """``payload`` as the bytes the timeline component gets: JSON whose first key is ``sig``, a digest of the rest.

    Streamlit forwards bytes as they are, where a dict is JSON-encoded on every mount, and encoded and
    digested once more for the element's identity (about 60 ms a visit for the lanes at 100k runs, holding
    the GIL). The script reads ``sig`` from the first bytes (``sigOf`` in timeline.js) and parses the rest
    only for a payload it has not drawn (a rerun sending the same one keeps the drawn chart and its brush)."""
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    sig = hashlib.blake2b(body.encode(), digest_size=12).hexdigest()
    return ('{"sig":"' + sig + '"' + ("," + body[1:] if body != "{}" else "}")).encode()


def ms(t: Any) -> np.ndarray:
    """Epoch milliseconds (float) of a datetime column or index, whatever its unit (NaT: NaN)."""
    s = pd.to_datetime(pd.Series(t), utc=True)
    return ((s - EPOCH) / pd.Timedelta(1, "ms")).to_numpy(dtype="float64", na_value=np.nan)


def _floats(a: np.ndarray, nd: int = 3) -> list:
    """JSON-ready floats (NaN: None), rounded: the payload travels on every visit."""
    a = np.round(np.asarray(a, dtype="float64"), nd)
    return [None if x != x else x for x in a.tolist()]


def _domain(since: pd.Timestamp, until: pd.Timestamp) -> tuple[float, float]:
    return float(ms([since])[0]), float(ms([until])[0])


def _palette(names: Sequence[str]) -> list[str]:
    return [PALETTE[i % len(PALETTE)] for i in range(len(names))]


def _stack(buckets: np.ndarray, codes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per item, the span (y0, y1) it covers in its bucket's stack, the series in order of their code."""
    if not len(values):
        return np.zeros(0), np.zeros(0)
    order = np.lexsort((codes, buckets))
    b, v = buckets[order], values[order]
    first = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    before = np.r_[0.0, np.cumsum(v)]  # the running sum before each item
    base = np.repeat(before[first], np.diff(np.r_[first, len(v)]))  # ... before its bucket's first item
    y0, y1 = np.empty(len(v)), np.empty(len(v))
    y0[order] = before[:-1] - base
    y1[order] = before[1:] - base
    return y0, y1


def status_payload(status: pd.DataFrame, since, until, interval_s: int) -> Payload:
    """Job status per interval (:func:`.occupancy.status_frame`): a stacked bar per interval, one
    segment per status; the tooltip has the count and the time-weighted average."""
    names = [s for s in STATUSES if s in set(status["status"])] if not status.empty else []
    code = {s: i for i, s in enumerate(names)}
    x = ms(status["bucket"])
    c = status["status"].map(code).to_numpy(dtype="int64")
    counts = status["count"].to_numpy(dtype="float64")
    y0, y1 = _stack(x, c, counts)
    x0, x1 = _domain(since, until)
    return Payload(
        kind="bars", title="Job status per interval", height=260, x0=x0, x1=x1, x_title="interval", y_title="runs",
        names=names, colors=[STATUS_COLORS[s] for s in names], legend_title="status",
        items={"x": _floats(x, 0), "x2": _floats(x + interval_s * 1000, 0), "y0": _floats(y0), "y1": _floats(y1),
               "c": c.tolist()},
        tips=[Tip(label="from", fmt=TIME, src="x"), Tip(label="status", src="name"),
              Tip(label="runs (at any moment / finished)", fmt=0, values=counts.astype("int64").tolist()),
              Tip(label="time-weighted average", fmt=2, values=_floats(status["avg"].to_numpy(), 3))])


def queued_payload(qt: pd.DataFrame, grouping: str, since, until, interval_s: int) -> Payload:
    """Queued time per interval (:func:`.occupancy.queued_frame`): seconds waited, stacked by group;
    the tooltip has how many runs waited and their mean wait."""
    names = sorted(map(str, set(qt["group"]))) if not qt.empty else []
    code = {s: i for i, s in enumerate(names)}
    x = ms(qt["bucket"])
    c = qt["group"].astype(str).map(code).to_numpy(dtype="int64")
    secs = qt["queued_s"].to_numpy(dtype="float64")
    y0, y1 = _stack(x, c, secs)
    x0, x1 = _domain(since, until)
    return Payload(
        kind="bars", title="Queued time per interval", height=260, x0=x0, x1=x1, x_title="interval",
        y_title="seconds queued", names=names, themed=True, colors=_palette(names), legend_title=grouping,
        items={"x": _floats(x, 0), "x2": _floats(x + interval_s * 1000, 0), "y0": _floats(y0, 1), "y1": _floats(y1, 1),
               "c": c.tolist()},
        tips=[Tip(label="from", fmt=TIME, src="x"), Tip(label=grouping, src="name"),
              Tip(label="runs waiting", fmt=0, values=qt["runs"].astype("int64").tolist()),
              Tip(label="mean wait (s)", fmt=1, values=_floats(qt["mean_s"].to_numpy(), 1)),
              Tip(label="seconds queued", fmt=0, values=_floats(secs, 0))])


LOAD_SERIES = (("busy", "runs holding a slot"), ("gpus", "GPUs held"))


def load_payload(load: pd.DataFrame, gpu_capacity: Optional[float], since, until, interval_s: int) -> Payload:
    """The load (:func:`.occupancy.load_frame`): the time-weighted runs holding a slot and GPUs held
    per interval as step lines, and the agents' GPUs as a rule."""
    x = ms(load["bucket"])
    n = len(load)
    xs, cs, ys, held, waiting = [], [], [], [], []
    for i, (col, _) in enumerate(LOAD_SERIES):
        xs.append(x)
        cs.append(np.full(n, i))
        ys.append(load[col].to_numpy(dtype="float64"))
        held.append(load["held"].to_numpy())
        waiting.append(load["waiting"].to_numpy())
    x_all, y_all = np.concatenate(xs) if n else np.zeros(0), np.concatenate(ys) if n else np.zeros(0)
    x0, x1 = _domain(since, until)
    return Payload(
        kind="steps", title="Load per interval", height=160, x0=x0, x1=x1, x_title="", y_title="time-weighted average",
        names=[name for _, name in LOAD_SERIES], themed=True, colors=["#4c78a8", "#f58518"],
        items={"x": _floats(x_all, 0), "x2": _floats(x_all + interval_s * 1000, 0), "y0": _floats(y_all),
               "y1": _floats(y_all), "c": (np.concatenate(cs) if n else np.zeros(0)).astype("int64").tolist()},
        tips=[Tip(label="from", fmt=TIME, src="x"), Tip(label="series", src="name"), Tip(label="value", fmt=2, src="y1"),
              Tip(label="runs holding a slot at any moment", fmt=0,
                  values=(np.concatenate(held) if n else np.zeros(0)).astype("int64").tolist()),
              Tip(label="runs waiting", fmt=0, values=(np.concatenate(waiting) if n else np.zeros(0)).astype("int64").tolist())],
        rules=[Rule(y=float(gpu_capacity), label="the agents' GPUs")] if gpu_capacity else [])


def _rows_height(n: int, per_row: int, lo: int, hi: int) -> int:
    return int(min(max(per_row * n, lo), hi))


def lanes_payload(seg: pd.DataFrame, grouping: str, since, until, selected: Optional[Sequence[float]] = None) -> Payload:
    """The Gantt over a long range (:func:`.occupancy_lanes.lanes`): one row per agent and device, a bar per
    segment coloured by the group that held it; a brush on time selects a span."""
    folded = bool(seg.attrs.get("folded"))
    rows = sorted(map(str, set(seg["lane"]))) if not seg.empty else []
    row = {s: i for i, s in enumerate(rows)}
    names = sorted(map(str, set(seg["group"]))) if not seg.empty else []
    code = {s: i for i, s in enumerate(names)}
    x0, x1 = _domain(since, until)
    return Payload(
        kind="lanes", title="Runs per agent and device", height=_rows_height(len(rows), 18, 160, 640), x0=x0, x1=x1,
        y_title="agent · devices" if folded else "agent · device", names=names, themed=True, colors=_palette(names),
        rows=rows,
        legend_title=grouping, brush=True, selected=list(selected) if selected else None,
        items={"x": _floats(ms(seg["start"]), 0), "x2": _floats(ms(seg["end"]), 0),
               "row": seg["lane"].astype(str).map(row).astype("int64").tolist(),
               "c": seg["group"].astype(str).map(code).astype("int64").tolist()},
        tips=[Tip(label="lane", src="row"), Tip(label=f"{grouping} holding most" if folded else grouping, src="name"),
              Tip(label="runs holding in it" if folded else "runs in segment", fmt=0,
                  values=seg["runs"].astype("int64").tolist()),
              Tip(label="one of its runs" if folded else "first run", values=seg["name"].astype(str).tolist()),
              Tip(label="start", fmt=TIME, src="x"), Tip(label="end", fmt=TIME, src="x2")])


def gantt_payload(g: pd.DataFrame, grouping_col: str, since, until, selected: Optional[Sequence[float]] = None) -> Payload:
    """A narrow range (:func:`.frames.gantt_frame`): one row and bar per run, newest start on top,
    coloured by the grouping, over the runs' own span; a brush on time selects a span."""
    g = g.sort_values("start", ascending=False, kind="stable")
    rows = [str(n) for n in g["name"]]
    col = grouping_col if grouping_col in g else "job"
    groups = g[col].astype(str) if col in g else pd.Series(["run"] * len(g), index=g.index)
    names = sorted(set(groups))
    code = {s: i for i, s in enumerate(names)}
    x0, x1 = _domain(since, until)
    if len(g):  # the runs' own span, as a Gantt of a few runs reads best (they may sit in a corner of the range)
        lo, hi = float(np.nanmin(ms(g["start"]))), float(np.nanmax(ms(g["bar_end"])))
        x0, x1 = lo - (hi - lo) * 0.02, hi + (hi - lo) * 0.02 + 1
    text = lambda c: g[c].astype(str).where(g[c].notna(), "").tolist() if c in g else [""] * len(g)  # noqa: E731
    return Payload(
        kind="lanes", title="Runs", height=_rows_height(len(g), 14, 200, 520), x0=x0, x1=x1, y_title="run",
        names=names, themed=True, colors=_palette(names), rows=rows, legend_title=col, brush=True,
        selected=list(selected) if selected else None,
        items={"x": _floats(ms(g["start"]), 0), "x2": _floats(ms(g["bar_end"]), 0), "row": list(range(len(g))),
               "c": groups.map(code).astype("int64").tolist()},
        tips=[Tip(label="run", src="row"), Tip(label="id", values=text("id")), Tip(label="job", values=text("job")),
              Tip(label="owner", values=text("owner")), Tip(label="queue", values=text("queue")),
              Tip(label="preset", values=text("preset")), Tip(label="state", values=text("state_name")),
              Tip(label="start", fmt=TIME, src="x"), Tip(label="end", fmt=TIME, src="x2"),
              Tip(label="duration s", fmt=0, values=_floats(g["duration_s"].to_numpy(), 0) if "duration_s" in g else []),
              Tip(label="queued s", fmt=0, values=_floats(g["queued_s"].to_numpy(), 0) if "queued_s" in g else [])])
