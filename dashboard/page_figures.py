"""What a visit of the monitor's page draws from a page's data, made once per page and ahead of the visits.

Why: the cost panel's table, idle share, energy notes and top wasters, and the summary's
capacity-used figures each read every cost row of the range (1M rows at 1M runs: about a second
of each visit's script); the first page's charts and runs table are megabytes at 1M runs. Built
here, once per :class:`PageData` (``View.drawn``), and for the page's default choices already when
the page keeper reads the page (:func:`prime`), a visit finds them made. Pure of Streamlit: tested
without a server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import pandas as pd

if TYPE_CHECKING:
    from prefect_launch.dashboard.view import View

log = logging.getLogger("prefect_launch.dashboard")

# ``p`` below is a :class:`prefect_launch.dashboard.page_data.PageData` (page_data imports this module)


def once(v: "View", what: Optional[tuple], make: Callable[[], Any]) -> Any:
    """``make()`` for this view, built by the first caller that asks for ``what``: every visit within a step
    of the page's clock gets the same View, so the next ones draw the same payloads and frames without
    building them again. ``what`` None: built each time (a brushed span is one person's, and would only grow
    the view)."""
    if what is None:
        return make()
    got = v.drawn.get(what, _MISSING)
    if got is _MISSING:
        got = v.drawn[what] = make()
    return got


_MISSING = object()


@dataclass(frozen=True)
class CostPanel:
    """What the cost panel shows for one "By" choice."""

    table: pd.DataFrame  # cost.cost_table: per group, then a total row
    idle_pct: Optional[float]  # cost.idle_share
    notes: list[str]  # energy sources and how many runs each
    wasters: pd.DataFrame  # cost.wasters


def view_costs(p: Any) -> tuple[Optional[pd.DataFrame], Optional[str]]:
    """(the cost rows filtered like the page, error text or None)."""
    from prefect_launch.dashboard import cost as C

    if p.costs is None:
        return None, p.costs_error or "not read"
    spec = p.view.spec
    return once(p.view, ("view_costs",), lambda: C.filter_runs(p.costs, spec.owners, spec.jobs, spec.presets)), None


def default_by(grouping: str) -> str:
    """The cost panel's "By" before anyone picks one: the sidebar's grouping where it is one of the choices."""
    from prefect_launch.dashboard import cost as C

    return grouping if grouping in C.BY else C.BY[0]


def cost_panel(p: Any, by: str) -> Optional[CostPanel]:
    """The cost panel's figures by ``by`` (None: the cost rows were not read)."""
    from prefect_launch.dashboard import cost as C

    runs, _ = view_costs(p)
    if runs is None:
        return None

    def make() -> CostPanel:
        notes = [f"GPU energy: {s} ({n} runs)" for s, n in runs["gpu_energy_source"].dropna().value_counts().items()]
        notes += [f"CPU energy: {s} ({n} runs)" for s, n in runs["cpu_energy_source"].dropna().value_counts().items()]
        return CostPanel(table=C.cost_table(runs, by), idle_pct=C.idle_share(runs), notes=notes, wasters=C.wasters(runs))

    return once(p.view, ("cost_panel", by), make)


def capacity_used(p: Any) -> dict:
    """Share (%) of the agents' GPU- and CPU-seconds over the range that runs used (measured)."""
    from prefect_launch.dashboard import summary as SM

    v = p.view
    runs, _ = view_costs(p)
    return once(v, ("capacity_used",), lambda: SM.capacity_used(
        runs, v.occupancy.capacity, (min(v.spec.until, v.now) - v.spec.since).total_seconds()))


# ------------------------------------------------------------- the first page's charts and runs table
# what the default page (the summary, status and queued panels, the "Job runs" section) sends of a view, built
# once per view by whoever asks first: the page keeper (prime), else the first visit of the step

RUN_TABLE_COLUMNS = ["name", "job", "owner", "launched_by", "queue", "priority", "preset", "state_name", "queued_s",
                     "duration_s", "start", "end", "link"]


def load_chart(v: "View") -> bytes:
    """The load chart's payload (:func:`.chart_data.load_payload`)."""
    from prefect_launch.dashboard import chart_data as CD

    occ = v.occupancy
    return once(v, ("load_chart",), lambda: CD.load_payload(occ.load, occ.capacity.get("gpu"), v.spec.since, v.spec.until,
                                                             v.interval_s).packed())


def status_chart(v: "View") -> bytes:
    """The job status chart's payload (the view's status counts must not be empty)."""
    from prefect_launch.dashboard import chart_data as CD

    return once(v, ("status_chart",), lambda: CD.status_payload(v.occupancy.status, v.spec.since, v.spec.until,
                                                                 v.interval_s).packed())


def queued_total(v: "View") -> float:
    """Seconds runs spent waiting over the range (the queued panel draws its chart only when above 0)."""
    qt = v.occupancy.queued
    return float(qt["queued_s"].sum()) if not qt.empty else 0.0


def queued_chart(v: "View") -> bytes:
    """The queued-time chart's payload (the view's queued time must not be empty)."""
    from prefect_launch.dashboard import chart_data as CD

    return once(v, ("queued_chart",), lambda: CD.queued_payload(v.occupancy.queued, v.spec.grouping, v.spec.since,
                                                                 v.spec.until, v.interval_s).packed())


def gantt_rows(v: "View") -> pd.DataFrame:
    """The listed runs that started, one bar each (:func:`.frames.gantt_frame`)."""
    from prefect_launch.dashboard import frames as F

    return once(v, ("gantt_frame",), lambda: F.gantt_frame(v.runs, v.now))


def runs_chart(v: "View", shown: Optional[list]) -> bytes:
    """The Job runs chart's payload: lanes per agent and device (many runs), else a bar per run; ``shown``: the
    brushed span (a brushed chart is one person's: made each time, not kept)."""
    from prefect_launch.dashboard import chart_data as CD
    from prefect_launch.dashboard import spec as S

    if v.occupancy.lanes is not None:
        return once(v, None if shown else ("lanes",), lambda: CD.lanes_payload(
            v.occupancy.lanes, v.spec.grouping, v.spec.since, v.spec.until, shown).packed())
    g = gantt_rows(v)
    return once(v, None if shown else ("gantt",), lambda: CD.gantt_payload(
        g, S.group_column(v.spec.grouping), v.spec.since, v.spec.until, shown).packed())


def linked(v: "View", runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` (with their ``id``) and a ``link`` column: each run's page in Prefect's UI."""
    from prefect_launch.dashboard.api import run_url

    return runs.assign(link=[run_url(v.ui_base, i) for i in runs["id"]])


def with_members(table: pd.DataFrame, ids: pd.Series, metrics: pd.DataFrame) -> pd.DataFrame:
    """A cluster run stays one row; its members (GPUs, CPU seconds, memory each) go in one more column,
    shown only when a run in the table has members."""
    if metrics is None or metrics.empty or "members" not in metrics:
        return table
    per_run = metrics.drop_duplicates("id").set_index("id")["members"]
    shown = [per_run.get(i, "") or "" for i in ids]
    return table.assign(members=shown) if any(shown) else table


def runs_table(v: "View", sel: pd.DataFrame, brushed: bool) -> pd.DataFrame:
    """The runs table under the Gantt for the runs ``sel`` (all the listed runs that started, unless
    ``brushed``), with a link to each run and, for cluster runs, their members."""
    return once(v, None if brushed else ("runs_table",), lambda: with_members(
        linked(v, sel)[RUN_TABLE_COLUMNS], sel["id"], v.metrics))


def prime(p: Any) -> None:
    """Make the figures and payloads a visit with the page's default choices reads (called where the page
    is read). A failure here fails no read: it is logged, nothing is kept, and the panel that draws the
    figure meets (and shows) the error itself, as it did before they were made ahead."""
    try:
        if p.view.occupancy is not None:
            capacity_used(p)
        runs, _ = view_costs(p)
        if runs is not None and not runs.empty:
            cost_panel(p, default_by(p.view.spec.grouping))
    except Exception:
        log.exception("making the page's cost figures ahead failed; the cost panel will make them")
    v = p.view
    occ = v.occupancy
    if occ is None or occ.load.empty:  # nothing the charts could be drawn from
        return
    try:  # the conditions are the panels' own (dashboard/app.py): what an empty panel does not draw is not made
        load_chart(v)
        if not occ.status.empty:
            status_chart(v)
        if queued_total(v) > 0:
            queued_chart(v)
        if occ.lanes is not None or not gantt_rows(v).empty:
            runs_chart(v, None)
        runs_table(v, gantt_rows(v), False)
    except Exception:
        log.exception("making the page's charts ahead failed; the first visit will make them")
