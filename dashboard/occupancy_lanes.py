"""The runs Gantt over a long range: lanes per agent and device, or folded per agent.

Up to :data:`LANES_MAX` devices, one lane per agent and GPU (CPU-only runs: per agent and
core) with merged segments of the runs that held it. More devices cannot be told apart at
the chart's height: each agent's GPUs (and its cores) fold into one lane showing, per pixel
of the range, the group that held most of its devices' time. The folded view is sums over
runs per pixel (device-seconds per lane and group) plus sorted start and end times per lane
(how many runs held in a segment, and which of them held longest), so, like the other
panels' sums (:mod:`.occupancy_sums`), the settled runs' part (:class:`FoldedPart`) is
kept between steps of the page (:mod:`.occupancy_memo`) and the rest's made afresh; the
pixels are whole multiples of their width (epoch based) so a kept part lines up with a
later range. Pure numpy / pandas; no server.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd
from pandas.api.extensions import ExtensionArray

from prefect_launch.dashboard.occupancy import Buckets, Phases, group_codes, label_codes, parse_placement, phase_col, seconds_in

LANES_MAX = 64  # more devices than this (lanes under ~10 px at the chart's height): one lane per agent
LANE_PIXELS = 600  # what a pixel of the Gantt's range is: 1/600 of it
LANE_COLUMNS = ["lane", "agent", "start", "end", "group", "runs", "id", "name"]


# ---------------------------------------------------------------- lane tables


@dataclass
class LaneTables:
    """How runs map to Gantt lanes: a key per distinct placement label (runs no agent placed:
    one key per queue), the lanes (devices) each key held, and each lane's agent lane."""

    key: np.ndarray  # per run
    lane_flat: np.ndarray  # every key's lane ids, key after key
    lane_count: np.ndarray  # per key: how many of ``lane_flat`` are its
    agent_of: list[str]  # per key
    lane_names: list[str]  # per lane: "agent · gpu 3"
    fold_of: list[int]  # per lane: its agent lane ("agent · GPUs" / "agent · cores")
    fold_names: list[str]
    fold_agent: list[str]


@functools.lru_cache(maxsize=1 << 18)
def _label_lanes(label: Optional[str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """One placement label -> (agent, its lanes "agent · gpu 3", their agent lanes "agent · GPUs").

    Cached like :func:`.occupancy.parse_placement`: at 1M runs a month holds ~50k distinct labels, each
    read by every step of the page's clock."""
    agent, _, _, slots = parse_placement(label)
    agent = agent or "unreadable placement"
    return agent, *_slot_lanes(agent, slots)


def _slot_lanes(agent: str, slots: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(lanes, their agent lanes) of an agent's slots; no slot: one "unplaced" lane."""
    slots = slots or ("unplaced",)
    fold = tuple(f"{agent} · " + ("GPUs" if x.startswith("gpu") else "cores" if x.startswith("core") else x) for x in slots)
    return tuple(f"{agent} · {x}" for x in slots), fold


def _keys(rows: pd.DataFrame, at: Optional[np.ndarray] = None) -> tuple[np.ndarray, list[tuple[str, tuple[str, ...], tuple[str, ...]]]]:
    """(key per run, (agent, lanes, agent lanes) per key): a key per placement label in use,
    runs no agent placed one per queue; ``at``: of those rows only (positions)."""
    if "placement" in rows:
        pcodes, plabels = label_codes(rows["placement"])
    else:
        pcodes, plabels = np.zeros(len(rows), dtype="int64"), [None]
    qcodes, qlabels = label_codes(rows["queue"])
    if at is not None:
        pcodes, qcodes = pcodes[at], qcodes[at]
    n = len(pcodes)
    placed = np.array([bool(x) for x in plabels], dtype=bool)[pcodes] if n else np.zeros(0, dtype=bool)
    raw_key = np.where(placed, pcodes, len(plabels) + qcodes)
    used, key = np.unique(raw_key, return_inverse=True)
    per_key = [_label_lanes(str(plabels[u])) if u < len(plabels)
               else (str(qlabels[u - len(plabels)]), *_slot_lanes(str(qlabels[u - len(plabels)]), ())) for u in used]
    return key.astype("int64"), per_key


def _device_count(per_key: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> int:
    """How many device lanes the keys held (what decides whether the Gantt folds)."""
    return len(set().union(*(k[1] for k in per_key)))


def _lane_tables(rows: pd.DataFrame, keys: Optional[tuple[np.ndarray, list]] = None) -> LaneTables:
    """``keys``: :func:`_keys` of ``rows`` where the caller has them already."""
    key, per_key = keys if keys is not None else _keys(rows)
    # lanes and agent lanes numbered in order of first appearance (as the keys list them)
    flat = [x for k in per_key for x in k[1]]
    if not flat:
        return LaneTables(key, np.zeros(0, dtype="int64"), np.zeros(len(per_key), dtype="int64"), [k[0] for k in per_key],
                          [], [], [], [])
    lane_code, lane_names = pd.factorize(np.asarray(flat, dtype=object))
    first = np.unique(lane_code, return_index=True)[1]
    fold_code, fold_names = pd.factorize(np.asarray([x for k in per_key for x in k[2]], dtype=object)[first])
    agents = np.asarray([k[0] for k in per_key for _ in k[1]], dtype=object)[first]
    fold_agent = agents[np.unique(fold_code, return_index=True)[1]].tolist()
    count = np.fromiter((len(k[1]) for k in per_key), dtype="int64", count=len(per_key))
    return LaneTables(key, np.asarray(lane_code, dtype="int64"), count, [k[0] for k in per_key], list(lane_names),
                      np.asarray(fold_code, dtype="int64").tolist(), list(fold_names), fold_agent)


def _pairs(t: LaneTables) -> tuple[np.ndarray, np.ndarray]:
    """(run, lane) per lane each run held: lane ids of a key are a slice of one flat table."""
    offs = np.concatenate([[0], np.cumsum(t.lane_count)[:-1]])
    lens = t.lane_count[t.key]
    rep = np.repeat(np.arange(len(t.key)), lens)
    within = np.arange(len(rep)) - np.repeat(np.cumsum(lens) - lens, lens)
    return rep, t.lane_flat[offs[t.key][rep] + within]


# ---------------------------------------------------------------- folded lanes


def pixel_grid(since_us: float, until_us: float, px_s: float) -> Buckets:
    """Pixels of ``px_s`` (whole microseconds) from the multiple of that width at or before
    ``since_us`` to ``until_us``: the same pixels for a range that moves on by whole pixels."""
    px = max(1, int(round(px_s * 1e6)))
    lo = int(since_us) // px * px
    return Buckets(lo_us=lo, step_s=px / 1e6, n=max(1, int(math.ceil((until_us - lo) / px))))  # type: ignore[arg-type]


@dataclass(frozen=True)
class FoldedPart:
    """One set of runs' part of the folded Gantt: device-seconds per agent lane, group and
    pixel, and the sorted times that count runs in a segment and find who held longest."""

    grid: Buckets
    lanes: tuple[str, ...]
    lane_agent: tuple[str, ...]
    groups: tuple[str, ...]
    secs: np.ndarray  # (lanes, groups, pixels) device-seconds
    origin: int  # times are kept as whole microseconds from here, clipped to [0, width)
    width: int
    starts: np.ndarray  # sorted lane * width + start
    ends: np.ndarray  # sorted lane * width + end
    block_starts: np.ndarray  # sorted (lane * groups + group) * width + start
    block_top: np.ndarray  # running maximum of the same blocks' ends, in that order
    who: np.ndarray  # per position of block_starts: the row (of ids / names) holding that maximum
    # per row of the arrays above, the run's id and name: the rows' own arrays (at 1M runs Arrow strings, about a
    # third of the memory of a Python string per run; a kept part holds a row per run and agent lane)
    ids: ExtensionArray
    names: ExtensionArray

    def rel(self, t_us: np.ndarray) -> np.ndarray:
        return np.clip(np.asarray(t_us, dtype="float64") - self.origin, 0, self.width - 1).astype("int64")

    def runs_holding(self, lane: np.ndarray, a_us: np.ndarray, z_us: np.ndarray) -> np.ndarray:
        """Per segment (lane in this part's numbering, -1: none here), the runs holding in [a, z)."""
        ok = lane >= 0
        base = np.where(ok, lane, 0) * self.width
        c = np.searchsorted(self.starts, base + self.rel(z_us), "left") - np.searchsorted(self.ends, base + self.rel(a_us), "right")
        return np.where(ok, c, 0)

    def longest(self, lane: np.ndarray, group: np.ndarray, z_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per segment, of this part's runs of the group in the lane started before z, the one
        that holds longest: (its end, -inf where none; its row)."""
        if not len(self.block_starts):
            return np.full(len(lane), -np.inf), np.zeros(len(lane), dtype="int64")
        ok = (lane >= 0) & (group >= 0)
        block = (np.where(ok, lane, 0) * len(self.groups) + np.where(ok, group, 0)) * self.width
        last = np.searchsorted(self.block_starts, block + self.rel(z_us), "left") - 1
        at = np.maximum(last, 0)
        ok &= (last >= 0) & (self.block_starts[at] >= block)  # a run of this block, not of one before it
        end = (self.block_top[at] - block + self.origin).astype("float64")
        return np.where(ok, end, -np.inf), self.who[at]


def folded_part(rows: pd.DataFrame, ph: Phases, groups: Optional[pd.Series], grid: Buckets, until_us: float) -> FoldedPart:
    """The folded Gantt's part of ``rows`` (the runs that held a slot; their phases and group
    labels aligned with them) on the pixels ``grid``, up to ``until_us``."""
    h0, h1 = phase_col(ph, "h0"), phase_col(ph, "h1")
    held = np.flatnonzero(~np.isnan(h0) & (h1 > h0))
    r = rows.iloc[held]
    t = _lane_tables(r)
    rep, lane = _pairs(t)
    nf = len(t.fold_names)
    fold = np.asarray(t.fold_of, dtype="int64")[lane] if len(lane) else np.zeros(0, dtype="int64")
    # one row per (run, agent lane), weighted by the devices of that lane it held
    _, first_of, devices = np.unique(rep * max(nf, 1) + fold, return_index=True, return_counts=True)
    run, fold = rep[first_of], fold[first_of]
    g = pd.Series(groups).iloc[held] if groups is not None else pd.Series(np.full(len(r), "all", dtype=object))
    gcodes, gnames = group_codes(g, len(r))
    grp = gcodes[run]
    ng = len(gnames)
    s, e = h0[held][run], h1[held][run]
    secs = (seconds_in(s, e, grid, weights=devices.astype("float64"), codes=fold * ng + grp, n_groups=nf * ng)
            if nf * ng else np.zeros((0, grid.n)))
    origin = int(grid.lo_us) - 1_000_000
    width = 1 << int(math.ceil(math.log2(max(until_us - origin + 2_000_000, 2))))
    rel = lambda x: np.clip(x - origin, 0, width - 1).astype("int64")  # noqa: E731
    block = fold * ng + grp
    bs = block * width + rel(s)
    by_start = np.argsort(bs, kind="stable")
    be = (block * width + rel(e))[by_start]
    top = np.maximum.accumulate(be) if len(be) else be
    at_top = np.maximum.accumulate(np.where(be == top, np.arange(len(be)), 0)) if len(be) else be
    names = r["name"] if "name" in r else r["id"]
    return FoldedPart(
        grid=grid, lanes=tuple(t.fold_names), lane_agent=tuple(t.fold_agent), groups=tuple(str(x) for x in gnames),
        secs=secs.reshape(nf, ng, grid.n), origin=origin, width=width,
        starts=np.sort(fold * width + rel(s)), ends=np.sort(fold * width + rel(e)), block_starts=bs[by_start], block_top=top,
        who=by_start[at_top] if len(be) else be, ids=r["id"].array.take(run), names=names.array.take(run))


def folded_frame(parts: Sequence[FoldedPart], grid: Buckets, since_us: float, until_us: float) -> pd.DataFrame:
    """The folded Gantt from the parts of disjoint sets of runs: per agent lane and pixel, the
    group that held most of its devices' time (device-seconds; consecutive pixels of one group
    are one segment); runs = the runs holding a device of the lane at any moment of the
    segment's pixels (the first pixel whole, as its group was chosen, though drawn from
    ``since``); id / name: of the segment's group, the run started before its end that holds
    longest. Lanes and groups in name order, so the parts' order does not matter."""
    lanes = sorted({x for p in parts for x in p.lanes})
    agent = {x: a for p in parts for x, a in zip(p.lanes, p.lane_agent)}
    groups = sorted({x for p in parts for x in p.groups})
    li, gi = {x: i for i, x in enumerate(lanes)}, {x: i for i, x in enumerate(groups)}
    nl, ng, n = len(lanes), len(groups), grid.n
    secs = np.zeros((nl, ng, n))
    for p in parts:
        if p.secs.size:
            secs[np.ix_([li[x] for x in p.lanes], [gi[x] for x in p.groups])] += p.grid.moved(p.secs, grid)
    lab = np.where(secs.sum(axis=1) > 0, secs.argmax(axis=1), -1).ravel()  # (lane, pixel) -> group, -1: none held
    new = np.r_[True, lab[1:] != lab[:-1]] if len(lab) else np.zeros(0, dtype=bool)
    new[::n] = True  # a lane's first pixel starts a segment
    seg = np.flatnonzero(new)
    seg_end = np.r_[seg[1:], len(lab)]
    held = lab[seg] >= 0
    seg, seg_end = seg[held], seg_end[held]
    f, k0, k1 = seg // n, seg % n, (seg_end - 1) % n + 1
    px = int(round(grid.step_s * 1e6))
    pixel_us = (grid.lo_us + k0 * px).astype("float64")  # the first pixel is whole: its runs count, as its time did
    a_us = np.maximum(pixel_us, since_us)  # drawn from the range's start
    z_us = np.minimum(grid.lo_us + k1 * px, until_us).astype("float64")
    g = lab[seg]
    runs = np.zeros(len(seg), dtype="int64")
    best = np.full(len(seg), -np.inf)
    ids = np.empty(len(seg), dtype=object)
    names = np.empty(len(seg), dtype=object)
    for p in parts:
        p_lane, p_group = {x: i for i, x in enumerate(p.lanes)}, {x: i for i, x in enumerate(p.groups)}
        pl = np.array([p_lane.get(x, -1) for x in lanes] or [-1], dtype="int64")[f]
        pg = np.array([p_group.get(x, -1) for x in groups] or [-1], dtype="int64")[g]
        runs += p.runs_holding(pl, pixel_us, z_us)
        end, row = p.longest(pl, pg, z_us)
        better = end > best
        best = np.where(better, end, best)
        sel = row[better]
        ids[better], names[better] = np.asarray(p.ids.take(sel), dtype=object), np.asarray(p.names.take(sel), dtype=object)
    agent_names, agent_code = np.unique(np.asarray([agent[x] for x in lanes] or [""], dtype=object), return_inverse=True)
    cat = pd.Categorical.from_codes
    out = pd.DataFrame({
        "lane": cat(f, lanes), "agent": cat(agent_code[f], list(agent_names)),
        "start": pd.to_datetime(a_us.astype("int64"), unit="us", utc=True),
        "end": pd.to_datetime(z_us.astype("int64"), unit="us", utc=True),
        "group": cat(g, groups), "runs": runs, "id": pd.array(ids, dtype=object), "name": pd.array(names, dtype=object),
    })[LANE_COLUMNS]
    out.attrs["folded"] = True
    return out


# ---------------------------------------------------------------- the Gantt


@dataclass
class KeptLanes:
    """The settled runs' folded part, kept by :mod:`.occupancy_memo`: which of the rows given
    to :func:`lanes` it holds, and the part on a pixel grid (None: it cannot serve this range)."""

    held: np.ndarray  # bool per row given to lanes(): in the kept part
    part: Callable[[Buckets, float], Optional[FoldedPart]] = field(repr=False)


def lanes(rows: pd.DataFrame, ph: Phases, groups: pd.Series, since_us: float, until_us: float,
          gap_s: Optional[float] = None, max_lanes: Optional[int] = None, kept: Optional[KeptLanes] = None) -> pd.DataFrame:
    """The Gantt over a long range: one lane per agent and GPU (CPU-only runs: per agent
    and core) with the runs that held it; runs in the same lane and group closer than
    ``gap_s`` (default: 1/600 of the range, below a pixel) merge into one segment.

    More devices than ``max_lanes`` (default :data:`LANES_MAX`) cannot be told apart at the
    chart's height: then each agent's GPUs (and its cores) fold into one lane that shows,
    per pixel of the range (``gap_s``), the group that held most of its devices' time
    (:func:`folded_frame`; the frame's ``attrs["folded"]`` says so). ``kept``: the settled
    runs' part of the folded view, kept between steps.

    Columns: lane, agent, start, end, group, runs (in the segment), id and name (its first run).
    """
    h0, h1 = phase_col(ph, "h0"), phase_col(ph, "h1")
    s = np.maximum(h0, since_us)  # NaN (never held) stays NaN
    e = np.minimum(h1, until_us)
    keep = np.flatnonzero(~np.isnan(s) & (e > s))
    if not len(keep):
        return pd.DataFrame(columns=LANE_COLUMNS)
    gap_s = gap_s if gap_s is not None else (until_us - since_us) / 1e6 / LANE_PIXELS
    groups = pd.Series(groups)  # aligned with rows
    keys = _keys(rows, keep)  # the placement keys of the runs in range: they decide whether the Gantt folds
    if _device_count(keys[1]) <= (max_lanes if max_lanes is not None else LANES_MAX):
        r = rows.iloc[keep]
        return _device_lanes(rows, r, _lane_tables(r, keys), keep, s, e, groups, gap_s, since_us)
    grid = pixel_grid(since_us, until_us, gap_s)
    # the first pixel is whole: runs that held in it before ``since`` count there too
    wide = ~np.isnan(h0) & (np.minimum(h1, until_us) > np.maximum(h0, grid.lo_us))
    part = kept.part(grid, until_us) if kept is not None else None
    parts = [part] if part is not None else []
    mine = np.flatnonzero(wide & ~kept.held) if part is not None and kept is not None else np.flatnonzero(wide)
    parts.append(folded_part(rows.iloc[mine], {k: np.asarray(v)[mine] for k, v in ph.items()}, groups.iloc[mine], grid, until_us))
    return folded_frame(parts, grid, since_us, until_us)


def _device_lanes(rows: pd.DataFrame, r: pd.DataFrame, t: LaneTables, keep: np.ndarray, s: np.ndarray, e: np.ndarray,
                  groups: pd.Series, gap_s: float, since_us: float) -> pd.DataFrame:
    """One lane per device: runs in the same lane and group closer than ``gap_s`` merge."""
    rep, lane = _pairs(t)
    gcodes, gnames = group_codes(groups.iloc[keep], len(r))
    grp = gcodes[rep]
    names = rows["name"] if "name" in rows else rows["id"]
    cat = pd.Categorical.from_codes  # labels repeat: codes into their few names, no string per segment
    # relative integer microseconds: a lane's offset above every time of the lanes before it
    # turns one running maximum over all rows into one per lane (rows sorted by lane, start)
    base = int(since_us)
    gap_us = gap_s * 1e6
    st = (s[keep][rep] - base).astype("int64")
    en = (e[keep][rep] - base).astype("int64")
    order = np.lexsort((st, lane))
    lane, grp, st, en, rep = lane[order], grp[order], st[order], en[order], rep[order]
    width = int(en.max()) + 1
    reach = np.maximum.accumulate(en + lane * width) - lane * width
    prev_reach = np.r_[np.iinfo("int64").min // 2, reach[:-1]]
    new = np.r_[True, (lane[1:] != lane[:-1]) | (grp[1:] != grp[:-1])] | (st > prev_reach + gap_us)
    first = np.flatnonzero(new)
    starts = np.minimum.reduceat(st, first) + base
    ends = np.maximum.reduceat(en, first) + base
    counts = np.diff(np.r_[first, len(st)])
    lead = keep[rep[first]]  # the segments' first runs, as positions in ``rows``
    agent_names, agent_code = np.unique(np.asarray(t.agent_of, dtype=object), return_inverse=True)
    out = pd.DataFrame({
        "lane": cat(lane[first], t.lane_names), "agent": cat(agent_code[t.key[rep[first]]], list(agent_names)),
        "start": pd.to_datetime(starts, unit="us", utc=True), "end": pd.to_datetime(ends, unit="us", utc=True),
        "group": cat(grp[first], [str(x) for x in gnames]), "runs": counts,
        "id": rows["id"].iloc[lead].array, "name": names.iloc[lead].array,
    })[LANE_COLUMNS]
    out.attrs["folded"] = False
    return out
