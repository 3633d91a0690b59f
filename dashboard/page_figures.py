"""The page's figures over every cost row of the range, made once per page and ahead of the visits.

Why: the cost panel's table, idle share, energy notes and top wasters, and the summary's
capacity-used figures each read every cost row of the range (1M rows at 1M runs: about a second
of each visit's script). Built here, once per :class:`PageData` (``View.drawn``), and for the
page's default choices already when the page keeper reads the page (:func:`prime`), a visit
finds them made. Pure of Streamlit: tested without a server.
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


def prime(p: Any) -> None:
    """Make the figures a visit with the page's default choices reads (called where the page is read).
    A failure here fails no read: it is logged, nothing is kept, and the panel that draws the figure
    meets (and shows) the error itself, as it did before the figures were made ahead."""
    try:
        if p.view.occupancy is not None:
            capacity_used(p)
        runs, _ = view_costs(p)
        if runs is not None and not runs.empty:
            cost_panel(p, default_by(p.view.spec.grouping))
    except Exception:
        log.exception("making the page's cost figures ahead failed; the cost panel will make them")
