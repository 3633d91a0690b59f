"""prefect-launch queue monitor (Streamlit): the app's frame and its first page.

    PREFECT_API_URL=http://127.0.0.1:4200/api streamlit run dashboard/app.py

The frame (the end of this file) sets the page up, holds the shared clients with
``st.cache_resource`` (:func:`api_client`, :func:`run_index`) and lists the pages with
``st.navigation``: the queue monitor (:func:`monitor`, below) and Sessions
(``pages/1_Sessions.py``).

Sidebar: queues, time range, grouping and filters drive every panel. Run panels come
from the run index (a copy of the runs' filter columns in the metrics store, kept in
step with Prefect, see :mod:`prefect_launch.dashboard.index_sync`) once it covers the
range, and from Prefect's API (server-side aggregation + bounded, incrementally
refreshed run reads, see :mod:`prefect_launch.dashboard.view`) until then. Every frame a
panel draws comes from a pure producer (:mod:`.frames`, :mod:`.occupancy`, :mod:`.summary`,
:mod:`.cost`); this file only lays them out.
"""

from __future__ import annotations

import datetime as dt
import html
from typing import Any

import pandas as pd
import streamlit as st

from pathlib import Path

from prefect_launch.dashboard import api as A
from prefect_launch.dashboard import index_sync as X
from prefect_launch.dashboard.caption_text import as_written
from prefect_launch.dashboard import metrics_source as M
from prefect_launch.dashboard import page_data as P
from prefect_launch.dashboard import page_figures as PF
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import summary as SM
from prefect_launch.dashboard.sidebar import sidebar
from prefect_launch.dashboard import timeline
from prefect_launch.dashboard import view as V
from prefect_launch.dashboard import widgets as W

st.set_page_config(page_title="Queue monitor · prefect-launch", layout="wide")
st.set_option("client.toolbarMode", "minimal")  # no Deploy button or developer menu for the people who read the page
PAGES = Path(__file__).resolve().parent / "pages"


@st.cache_resource(show_spinner=False)
def api_client() -> A.Api:
    """Prefect's API client, one per process (thread-safe; the keeper's reads share it through api.get_api)."""
    return A.get_api()


@st.cache_resource(show_spinner=False, ttl=60)
def run_index() -> "X.IndexService | None":
    """The run index's service for the metrics store (None without a store), one per process; looked up
    again each minute, so a store configured meanwhile is found."""
    store = M.metrics_store()
    return None if store is None else X.service_for(store, api_client())


def panel_waiting(p: P.PageData) -> None:
    """Who waits and why, with queue position and predicted start (inside the summary panel)."""
    if p.waiting_error is not None:  # the rest of the page stands without it
        W.heading(lines=[f"Waiting runs: unavailable ({p.waiting_error})"])
        return
    waits = p.waiting
    if not waits:
        W.heading(lines=["Who waits and why: no run is waiting."])
        return
    W.heading(lines=["Who waits and why: each waiting run's position in its queue (1 = next; empty while "
                                   "its starts-at is ahead) and predicted start (ETA, UTC: the agents' placement replayed "
                                   "forward with each run's expected length; empty when it cannot be told)."])
    W.table(SM.waiting_frame(waits, dt.datetime.now(S.UTC)), "waiting_table",  # as of this visit
            labels={"eta": "ETA (UTC)", "waited_s": "waited s", "eta_in_s": "starts in s"},
            digits={"position": 0, "waited_s": 0, "eta_in_s": 0})


RUN_LINK = dict(labels={"link": "Prefect UI"}, links={"link": "open run"})  # how every runs table shows the link


def _runs_table(v: V.View, runs: pd.DataFrame, key: str, drop_id: bool = False, **kw) -> None:
    """A table of runs (``runs`` has their ``id``) with a link to each in Prefect's UI."""
    shown = PF.linked(v, runs)
    W.table(shown.drop(columns=["id"]) if drop_id else shown, key,
            labels={**RUN_LINK["labels"], **kw.pop("labels", {})}, links=RUN_LINK["links"], **kw)


def _links_block():
    from prefect_launch.blocks.queue_links import QueueLinks

    return QueueLinks


def panel_summary(p: P.PageData) -> None:
    v = p.view
    with st.container(key="panel-summary", border=True):
        W.heading("Queue summary")
        summary = v.summary
        occ = v.occupancy
        load, idle, share = occ.load, occ.idle, occ.share
        head = SM.headline(summary)
        W.figures([("Queues busy now", f"{head['busy']} / {head['queues']}"), ("Queued now", f"{head['queued']:,}"),
                   ("Running now", f"{head['running']:,}"), ("Runs in range", f"{v.totals['runs']:,}")])
        used = PF.capacity_used(p)
        cap_help = ("{what} over the range / the {unit} the online agents serving these queues publish x the range "
                    "(n/a without agents)")
        figures = [("GPU capacity held", share.get("gpu"), "GPU-seconds runs held", "GPUs"),
                   ("GPU capacity used", used.get("gpu"), "GPU-seconds used (utilisation-weighted, measured)", "GPUs"),
                   ("CPU capacity held", share.get("cpu"), "CPU-seconds runs held", "CPUs"),
                   ("CPU capacity used", used.get("cpu"), "CPU-seconds used (measured)", "CPUs")]
        if any(val is not None for _, val, _, _ in figures):
            W.figures([(label, f"{val:.0f}%" if val is not None else "n/a", cap_help.format(what=what, unit=unit))
                       for label, val, what, unit in figures])
        elif not occ.complete:
            W.heading(lines=["Capacity held and used: shown once the run index covers the range (only the "
                                            "newest runs are read from Prefect's API yet)."])
        else:
            W.heading(lines=["Capacity held and used: n/a (no online agent publishes capacity for these "
                                            "queues)."])
        shown = summary if "sharing" in summary and summary["sharing"].astype(bool).any() else summary.drop(
            columns=["sharing"], errors="ignore")  # the column only where a queue shares by owner
        W.table(shown, "summary_table")
        panel_waiting(p)
        if not v.agents.empty:
            W.heading(lines=["Agents (capacity published by launch workers)"])
            W.table(v.agents, "agents_table", digits={"memory_gib": 1, "free_memory_gib": 1})
        left, right = st.columns([3, 2])
        with left:
            W.heading(lines=["Load: runs holding a slot (claimed or running) and GPUs held, time-weighted per "
                                        "interval (red: the agents' GPUs). Idle stretches on fixed capacity are room for "
                                        "low-priority work." + ("" if occ.complete else " Only the span the newest runs "
                                        "read so far cover is drawn: the run index does not cover the range yet.")])
            timeline.chart(PF.load_chart(v), key="load_chart", fallback=load)
            if not occ.complete:
                W.heading(lines=["Idle periods: shown once the run index covers the range (an interval none "
                                            "of the newest runs touch is not known to be idle)."])
            else:
                W.heading(lines=[f"Idle periods (no run held a slot at any moment of the interval): {len(idle)}, "
                                            f"{idle['hours'].sum() if not idle.empty else 0:.1f} h in total; 'waiting' > 0: "
                                            "runs waited meanwhile"])
            if not idle.empty:
                W.table(idle.head(10), "idle_table", digits={"hours": 2})
        with right:
            W.heading(lines=["Held load by hour of day and weekday (UTC): periodic bursts are where scheduled "
                                           "cloud capacity pays."])
            if not occ.complete:
                st.info("Shown once the run index covers the range (averages need every run of it).")
            elif occ.heatmap.empty:
                st.info("No runs in this range.")
            else:
                from prefect_launch.dashboard import charts  # Altair: imported once a heatmap is drawn

                st.altair_chart(charts.heatmap_chart(occ.heatmap), width="stretch", key="heatmap")


def panel_cost(p: P.PageData) -> None:
    from prefect_launch.dashboard import cost as C

    v = p.view
    with st.container(key="panel-cost", border=True):
        W.heading("Cost and waste")
        runs, error = PF.view_costs(p)
        if runs is None:
            st.info(f"Metrics store not readable: {error}")
            return
        if runs.empty:
            st.info("No measured runs in this range.")
            return
        by = W.single("By", C.BY, f"cost_by_{v.spec.grouping}",  # follows the sidebar's grouping
                      PF.default_by(v.spec.grouping))
        made = PF.cost_panel(p, by)
        table, notes = made.table, made.notes
        total = table.iloc[-1]
        idle = made.idle_pct

        def num(x, fmt="{:,.1f}"):  # short: a figure wraps past ~10 characters at laptop width
            return "n/a" if x is None or x != x else fmt.format(x)

        W.figures([
            ("GPU-hours used / held", f"{num(total['gpu_used_h'])} / {num(total['gpu_alloc_h'])}",
             "Held: GPUs x time. Used: utilisation-weighted, from the agents' samples (n/a: not measured). "
             f"Core-hours: {num(total['cpu_used_h'])} used of {num(total['cpu_alloc_h'])} held."),
            ("Held GPU time idle", num(idle, "{:.0f}%"),
             "Of the GPU time held by runs whose GPUs were measured, the share not used"),
            ("GPU energy", num(total["gpu_energy_wh"], "{:,.0f} Wh"),
             f"NVML energy counters of the runs' GPUs; measured for {total['gpu_energy_runs']} GPU runs "
             "(n/a: none could be measured; never estimated)"),
            ("CPU energy", num(total["cpu_energy_wh"], "{:,.0f} Wh"),
             f"The runs' share of the CPU packages' RAPL energy; measured for {total['cpu_energy_runs']} runs "
             "(n/a: RAPL not readable by the agents; never estimated)")])
        W.heading(lines=["Allocated vs used over the range, by " + by + ". " + "; ".join(notes)])
        left, right = st.columns([2, 3])
        with left:
            from prefect_launch.dashboard import charts

            st.altair_chart(charts.cost_chart(table, by), width="stretch")
        with right:
            W.table(table, "cost_table", digits={c: 1 for c in table.columns if c.endswith("_h")}, empty="unavailable")
        W.heading(lines=["Top wasters: runs that left the most of what they held idle (GPU-hours, then "
                                       "core-hours)"])
        w = made.wasters
        if w.empty:
            st.success("No run left held hardware idle in this range.")
        else:
            _runs_table(v, w, "wasters_table", empty="unavailable")


def _partial_note(v: V.View) -> str:
    o = v.occupancy
    return "" if o.complete else " (from the newest runs read from Prefect's API only, until the run index covers the range)"


def panel_status(v: V.View) -> None:
    with st.container(key="panel-status", border=True):
        W.heading("Job status", ["Per interval: runs queued, pending and running at any moment of it, and runs "
                                              "that finished in it by end state; the tooltip gives the time-weighted average "
                                              "number." + _partial_note(v)])
        counts = v.occupancy.status
        if counts.empty:
            st.info("No runs in this range.")
        else:
            timeline.chart(PF.status_chart(v), key="status_chart", fallback=counts)


def panel_queued(v: V.View) -> None:
    with st.container(key="panel-queued", border=True):
        qt = v.occupancy.queued
        total = PF.queued_total(v)
        W.heading("Queued time", [f"Seconds runs spent waiting inside each interval (a long wait spreads over the "
                                               f"intervals it spans), by {v.spec.grouping}; the tooltip shows how many waited "
                                               f"and their mean. Total: {total:,.0f} s." + _partial_note(v)])
        if total <= 0:
            st.info("No queued time in this range.")
        else:
            timeline.chart(PF.queued_chart(v), key="queued_chart", fallback=qt)


def _when(t: pd.Timestamp) -> str:
    """A brush edge to the millisecond (a span of seconds can hold many runs)."""
    return f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond // 1000:03d}"


def panel_runs(v: V.View) -> None:
    with st.container(key="panel-runs", border=True):
        g = PF.gantt_rows(v)
        lanes = v.occupancy.lanes
        if lanes is not None:
            _panel_lanes(v, lanes, g)
            return
        note = f"{len(g)} runs that started"
        if v.truncated:
            note += f" (the newest {len(v.runs):,} of {v.runs_total:,} in range; narrow the range or filters to see older ones)"
        W.heading("Job runs", [note + ". Drag across the chart to select a span; the table lists the runs in it."])
        if g.empty:
            st.info("No run started in this range.")
            return
        brush = timeline.chart(PF.runs_chart(v, timeline.brush_of("gantt")), key="gantt")
        _runs_under_brush(v, g, brush, "runs")


def _runs_under_brush(v: V.View, g: pd.DataFrame, brush, counted: str) -> None:
    """The runs table under the Gantt: the runs of ``g`` that overlap the brushed span (all without one),
    with a caption naming the span (``counted``: what its count is of)."""
    sel = g
    if brush:
        lo, hi = pd.to_datetime(brush[0], unit="ms", utc=True), pd.to_datetime(brush[1], unit="ms", utc=True)
        sel = g[(g["start"] <= hi) & (g["bar_end"] >= lo)]
        W.heading(lines=[f"Selected {_when(lo)} – {_when(hi)} UTC: {len(sel)} {counted}"])

    W.table(PF.runs_table(v, sel, bool(brush)), "runs_table", rows_shown=12,
            labels={**RUN_LINK["labels"], "queued_s": "queued s", "duration_s": "duration s", "launched_by": "launched by"},
            digits={"queued_s": 0, "duration_s": 0}, links=RUN_LINK["links"])


def _panel_lanes(v: V.View, lanes: pd.DataFrame, g: pd.DataFrame) -> None:
    """Many runs: one lane per agent and device with the runs that held it."""
    how = (f"one lane per agent for its GPUs (and one for its cores), coloured by the {v.spec.grouping} that held most of "
           "its devices' time in each pixel (more devices than lanes the chart can show)" if lanes.attrs.get("folded") else
           f"one lane per agent and GPU (CPU-only runs: per core) with the runs that held it, coloured by {v.spec.grouping} "
           "(runs closer than a pixel merge)")
    W.heading("Job runs", [f"{v.occupancy.runs:,} runs in range: {how}. Drag across the chart to select a span; "
                                      "the table lists the runs in it."])
    brush = timeline.chart(PF.runs_chart(v, timeline.brush_of("gantt")), key="gantt")
    _runs_under_brush(v, g, brush, f"of the newest {len(v.runs):,} runs")


METRICS = [
    ("gpu_util_pct", "GPU use by job", "avg GPU utilisation %"),
    ("cpu_pct", "CPU use by job", "avg CPU % (100 = one core)"),
    ("gpu_mem_gib", "GPU memory by job", "peak GPU memory (GiB)"),
    ("rss_gib", "System memory by job", "peak RSS (GiB)"),
]


def panel_metrics(v: V.View) -> None:
    from prefect_launch.dashboard import charts  # Altair: only when the section is drawn

    m = v.metrics
    col = S.group_column(v.spec.grouping)
    for i in range(0, len(METRICS), 2):
        cols = st.columns(2)
        for c, (y, title, ytitle) in zip(cols, METRICS[i : i + 2]):
            with c, st.container(key=f"panel-{y}", border=True):
                W.heading(title)
                d = m[m[y].notna()] if not m.empty else m
                if d.empty:
                    st.info("No measured runs in this range" + ("" if v.metrics_available else " (metrics store not reachable)") + ".")
                else:
                    st.altair_chart(charts.metric_chart(d, y, ytitle, col), width="stretch")
    with st.container(key="panel-waste", border=True):
        W.heading("Runs that waste hardware")
        w = M.waste_frame(m) if not m.empty else pd.DataFrame()
        if w.empty:
            st.success("No run flagged as waste in this range.")
        else:
            _runs_table(v, w, "waste_table")


def panel_errors(v: V.View) -> None:
    with st.container(key="panel-errors", border=True):
        e = v.errors
        W.heading("Errors", [] if e.empty else [
            f"{len(e)} failed or crashed runs, newest first (message: the state's, else the run's last ERROR log)"])
        if e.empty:
            st.success("No failed or crashed run in this range.")
            return
        _runs_table(v, e, "errors_table", drop_id=True)


def _links_unlocked() -> bool:
    """The login gate before Manage Links writes: the gateway's users (dashboard/login_form.py: the links are
    then saved as the signed-in user, whom the gateway lets change blocks only if an admin), else the
    monitor's password (off unless configured, see dashboard/links_auth.py)."""
    from prefect_launch.dashboard import links_auth, login_form
    from prefect_launch.dashboard import monitor_login as L

    mode = login_form.mode_or_error()
    if mode is None:
        return False
    if mode is L.Mode.USERS:
        return login_form.users_gate(st, "links_login", "link changes")
    if not links_auth.gate_enabled() or st.session_state.get("links_authed"):
        return True
    with st.form("links_login"):
        st.caption("Changing links needs the monitor's password.")
        given = st.text_input("Password", type="password", key="links_password")
        sign_in = st.form_submit_button("Sign in")
    if sign_in:
        try:
            ok = links_auth.check_password(given)
        except links_auth.GateUnavailable as exc:
            st.error(f"Sign-in unavailable: {exc}")
            return False
        if ok:
            st.session_state["links_authed"] = True  # the Manage Links toggle stays on
            st.rerun()
        st.error("Wrong password.")
    return False


def panel_links(p: P.PageData, opts: dict) -> None:
    QueueLinks = _links_block()
    v = p.view
    with st.container(key="panel-links", border=True):
        queues = [q for q in (list(v.spec.queues) or opts["queues"]) if p.links.get(q)]
        W.heading("External Links",
                [f"Links: unavailable ({p.links_error})"] if p.links_error is not None else [] if queues else
                ["No links yet: add Grafana, Datadog, a cloud console… with Manage Links."])
        for q in queues:  # anchors built (and escaped) by QueueLinks.html
            st.markdown(f"**{html.escape(q)}**: {p.links[q]}", unsafe_allow_html=True)
        # the form is drawn only when asked for (its widgets cost every visit a share of the drawing)
        if not st.toggle("Manage Links", key="links_open"):
            return
        if not opts["queues"]:
            st.info("No queue exists yet.")
            return
        if not _links_unlocked():
            return
        from prefect_launch.dashboard import login_form
        from prefect_launch.dashboard.monitor_login import acting_as

        with acting_as(login_form.signed_in()):  # the signed-in user's key reads and saves (none: the monitor's)
            _links_form(QueueLinks, opts)


def _links_form(QueueLinks: Any, opts: dict) -> None:
    """Manage Links' form: pick a queue, add, change or remove one of its links."""
    from prefect_launch.dashboard.monitor_login import refusal_text

    q = st.selectbox("Queue", opts["queues"], key="links_queue")
    try:
        blk = QueueLinks.for_queue(q)
    except Exception as exc:  # an empty form saved now would replace the links it could not read
        why = html.escape(str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
        # a refused document says how to fix it (ValueError); anything else is the server not answering
        then = "" if isinstance(exc, ValueError) else " Try again once the Prefect server answers."
        st.error(f"Cannot read the links of {html.escape(q)}: {why}. Nothing can be changed until they can be read.{then}")
        return
    labels = [x.label for x in blk.links]
    with st.form("link_form", clear_on_submit=False):
        target = st.selectbox("Link", ["(new link)"] + labels, key="link_target")
        label = st.text_input("Label", key="link_label")
        url = st.text_input("URL (http:// or https://)", key="link_url")
        c1, c2 = st.columns(2)
        save = c1.form_submit_button("Save link")
        remove = c2.form_submit_button("Remove link")
    if save:
        try:
            blk.upsert(label, url, replace_label=None if target == "(new link)" else target)
            blk.store()
            P.links_changed(q, blk.html() if blk.links else "")
            st.success(f"Saved link {label.strip()!r} for {q}.")
        except ValueError as exc:
            msg = str(exc).splitlines()
            st.error("Link not saved: " + next((m for m in msg if "URL" in m or "label" in m or "only" in m), msg[0]))
        except Exception as exc:  # the gateway refused the signed-in user (403 names why), or Prefect is away
            st.error("Link not saved: " + html.escape(refusal_text(exc), quote=False))
    if remove:
        if target == "(new link)":
            st.error("Pick the link to remove.")
        elif blk.remove(target):
            try:
                blk.store()
            except Exception as exc:  # the gateway refused the signed-in user, or Prefect is away
                st.error("Link not removed: " + html.escape(refusal_text(exc), quote=False))
                return
            P.links_changed(q, blk.html() if blk.links else "")
            st.success(f"Removed link {target!r} from {q}.")


def _source_note(v: V.View) -> str:
    """Where the run panels came from: the run index, or Prefect's API while it is built."""
    if v.source == "index":
        return "from the run index"
    try:
        svc = run_index()
        st_ = svc.status() if svc is not None else None
    except Exception as e:  # noqa: BLE001  the store cannot be opened: said as the index being unavailable
        st_ = dict(built=False, building=False, build_error=f"{type(e).__name__}: {e}")
    if not st_:
        return "from Prefect's API"
    if st_.get("building"):
        return f"from Prefect's API (run index building: {st_.get('build_progress', 0):,} runs read)"
    if st_.get("build_error"):
        return f"from Prefect's API (run index unavailable: {st_['build_error']})"
    return "from Prefect's API"


def _step_note() -> str:
    """Said where the page's clock moves in longer steps than usual (its reads take long: many runs)."""
    step = S.page_step()
    return "" if step <= S.PAGE_STEP_S else (f" · figures move on every {step} s (reading them takes long at this "
                                             "size; the next step's are read ahead)")


def _unreadable(spec: S.ViewSpec, exc: Exception) -> P.PageData:
    """The page when its reads fail: the reason and what to do, then the newest page read for this
    sidebar state with its age (or nothing more, when there is none)."""
    reason = html.escape(str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
    page = P.last_good(spec)
    fix = ("Check that the Prefect server at PREFECT_API_URL is up; the page reads again on the next visit "
           "or with Refresh now.")
    if page is None:
        st.error(f"Cannot read the queues from Prefect's API: {reason}. {fix}")
        st.stop()
    when = page.view.now
    age = (dt.datetime.now(S.UTC) - when).total_seconds()
    st.warning(as_written(f"Cannot read the queues from Prefect's API: {reason}. Showing the figures read at "
                          f"{when:%H:%M:%S} UTC ({age:,.0f} s ago). {fix}"))
    return page


def _until_newer(spec: S.ViewSpec, shown: dt.datetime) -> None:
    """The page shows figures read earlier while newer ones are read (a view that takes longer than a
    step of the page's clock): say how old they are, and rerun once newer ones are ready."""
    age = (dt.datetime.now(S.UTC) - shown).total_seconds()
    st.info(as_written(f"Showing the figures read at {shown:%H:%M:%S} UTC ({age:,.0f} s ago) while newer ones are "
                       "read; the page updates itself."))

    @st.fragment(run_every=1.0)
    def watch() -> None:
        if P.newer_than(spec, shown):
            st.rerun()

    watch()


def monitor() -> None:
    """The queue monitor page."""
    W.heading("Queue monitor", level=1)
    try:
        opts = P.options()
    except Exception as exc:  # server down or misconfigured: say so plainly
        st.error(f"Cannot reach the Prefect API: {exc}")
        st.stop()
    spec = sidebar(opts, P.refresh)
    stale = False
    try:
        if P.ready(spec):  # read ahead (dashboard/serve.py keeps the views visited lately ready) or by a rerun
            p = P.get(spec)
        else:
            with st.spinner("Reading queues…"):
                p, stale = P.get_or_newest(spec)
    except Exception as exc:  # Prefect's API (or the run index) cannot be read now: say so, show the last good page
        p = _unreadable(spec, exc)
    v = p.view
    if stale:
        _until_newer(spec, v.now)
    filters = v.spec.filters_note()
    W.heading(lines=[
        f"{v.spec.since:%Y-%m-%d %H:%M} – {v.spec.until:%Y-%m-%d %H:%M} UTC · interval {v.interval_s // 60} min · "
        f"grouping {v.spec.grouping} · " + (f"{filters} · " if filters else "")
        + f"read at {v.now:%H:%M:%S} UTC in {v.timings.get('total', 0):.2f} s"
        + (" (incremental)" if v.incremental else "") + f" · {_source_note(v)}" + _step_note()])
    panel_summary(p)
    c1, c2 = st.columns(2)
    with c1:
        panel_status(v)
    with c2:
        panel_queued(v)
    # the panels below: one section at a time, only the chosen one drawn (the browser's drawing of
    # charts and grids is most of what a visit waits for; each section stays one click away)
    section = W.single("Section", list(SECTIONS), "section", next(iter(SECTIONS)), hide_label=True)
    SECTIONS[section](p)
    panel_links(p, opts)


SECTIONS = {"Job runs": lambda p: panel_runs(p.view), "Resource use": lambda p: panel_metrics(p.view),
            "Cost and waste": panel_cost, "Errors": lambda p: panel_errors(p.view)}


def main() -> None:
    """The frame: the pages in the sidebar's navigation, the chosen one drawn."""
    st.navigation([st.Page(monitor, title="Queue monitor", default=True),
                   st.Page(PAGES / "1_Sessions.py", title="Sessions", url_path="Sessions")]).run()


main()
