"""Sessions page of the monitor: launch a session in steps, recent launches, the session list and
one session's detail (scheduling history, idle checks, app links, rename, terminate).

The monitor's frame (``dashboard/app.py``) lists this file in its ``st.navigation`` next to the queue
monitor (URL ``/Sessions``). Layout only: validation and launching are
:mod:`prefect_launch.deployments.sessions`'s, reads and actions are in
:mod:`prefect_launch.dashboard.sessions_ops`, tables in :mod:`prefect_launch.dashboard.sessions_frames`.
"""

from __future__ import annotations

import contextlib

import streamlit as st

from prefect_launch.dashboard import login_form
from prefect_launch.dashboard import monitor_login as L
from prefect_launch.dashboard import sessions_frames as F
from prefect_launch.dashboard import sessions_ops as O

st.set_page_config(page_title="Sessions · prefect-launch", layout="wide")
st.set_option("client.toolbarMode", "minimal")

S = st.session_state
MODE = login_form.mode_or_error(st.sidebar)  # None: LAUNCH_DASHBOARD_LOGIN is wrong (nothing writes)
SIGNED = login_form.signed_in() if MODE is L.Mode.USERS else None  # the gateway's user the page acts as
ME = L.viewer(MODE, SIGNED) if MODE is not None else None
_RUN_CLIENT = None  # one Prefect client for a whole script run (see main)


@contextlib.contextmanager
def _client():
    """The run's Prefect client; callbacks (run before the script) open their own."""
    if _RUN_CLIENT is not None:
        yield _RUN_CLIENT
    else:
        with O.client(SIGNED) as c:
            yield c


# ----------------------------------------------------------------------------- reads (cached briefly)
@st.cache_data(ttl=30, show_spinner=False)
def _queues() -> list[dict]:
    with _client() as c:
        return O.launch_queues(c)


@st.cache_data(ttl=5, show_spinner=False)
def _sessions(owner, include_ended: bool) -> list:
    with _client() as c:
        return O.sessions(c, owner, include_ended)


@st.cache_data(ttl=5, show_spinner=False)
def _history(run_id: str):
    return O.history(run_id)


def _refresh() -> None:
    _sessions.clear()
    _history.clear()
    _queues.clear()


def _flash(kind: str, text: str, new: bool = True) -> None:
    """Say how an action went ("area:level"); shown in its panel until the area's next action."""
    area = kind.split(":", 1)[0]
    kept = [(k, t) for k, t in S.get("sl_flash", []) if not (new and k.split(":", 1)[0] == area)]
    S["sl_flash"] = kept + [(kind, text)]


def _failure(exc: BaseException) -> str:
    """What went wrong, for the page: a refusal's own words, else the error's kind and first line."""
    if isinstance(exc, (ValueError, LookupError)):  # LaunchValidationError is a ValueError
        return str(exc)
    return L.refusal_text(exc)  # a gateway refusal says which rule (403 and its detail)


def _show_flash(where: str) -> None:
    for kind, text in S.get("sl_flash", []):
        if kind.startswith(where + ":"):
            getattr(st, kind.split(":", 1)[1])(F.plain(text, 600))


def _unlocked() -> bool:
    """The monitor's login before anything here starts or changes a session: the gateway's users
    (dashboard/login_form.py), or the monitor's password (dashboard/links_auth.py)."""
    from prefect_launch.dashboard import links_auth

    if MODE is None:
        return False
    if MODE is L.Mode.USERS:
        return login_form.users_gate(st.sidebar, "sessions_login", "launching and changing sessions")
    if not links_auth.gate_enabled() or S.get("links_authed"):
        return True
    with st.sidebar.form("sessions_login"):
        st.caption("Starting or changing sessions needs the monitor's password.")
        given = st.text_input("Password", type="password", key="sessions_password")
        if st.form_submit_button("Sign in"):
            try:
                if links_auth.check_password(given):
                    S["links_authed"] = True
                    st.rerun()
                st.error("Wrong password.")
            except links_auth.GateUnavailable as exc:
                st.error(f"Sign-in unavailable: {F.plain(exc)}")
    return False


# ----------------------------------------------------------------------------- launcher state
S.setdefault("sl_step", 0)
S.setdefault("sl_form", F.empty_form())
S.setdefault("sl_gen", 0)
S.setdefault("sl_errors", {})
S.setdefault("sl_warnings", [])
S.setdefault("sl_planned", None)


def _key(field: str) -> str:
    return f"lf_{field}_{S.sl_gen}"


def _collect() -> None:
    """Copy the shown widgets' values into the form (widgets of other steps are not kept by Streamlit)."""
    for f in F.TEXT_FIELDS:
        if _key(f) in S:
            v = S[_key(f)]
            S.sl_form[f] = "" if v is None else str(v)


def _validate() -> tuple[object, dict]:
    from prefect_launch.deployments.sessions import check

    req, errors = F.request_from_form(S.sl_form, ME)
    problems, S.sl_warnings = check(req)
    return req, F.merge_errors(errors, F.field_errors(problems))


def _dry_run(req) -> None:
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    S.sl_planned = None
    try:
        with _client() as c:
            S.sl_planned = O.start(c, req, dry_run=True)
        S.sl_warnings = S.sl_planned.warnings
    except LaunchValidationError as exc:
        S.sl_errors = F.field_errors(getattr(exc, "problems", None) or [str(exc)])
    except Exception as exc:  # Prefect unreachable: say so at review rather than fail the page
        S.sl_errors = {"general": [_failure(exc)]}


def _next() -> None:
    _collect()
    step = S.sl_step
    req, errors = _validate()
    blocking = F.errors_through(errors, step)
    S.sl_errors = blocking
    if blocking:
        return
    S.sl_step = step + 1
    if S.sl_step == F.REVIEW:
        S.sl_errors = errors
        if not errors:
            _dry_run(req)


def _goto(step: int) -> None:
    _collect()
    S.sl_step = step


def _launch() -> None:
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    _collect()
    req, errors = _validate()
    S.sl_errors = errors
    if errors:
        return
    try:
        with _client() as c:
            out = O.start(c, req, dry_run=False)
    except LaunchValidationError as exc:
        S.sl_errors = F.field_errors(getattr(exc, "problems", None) or [str(exc)])
        return
    except Exception as exc:
        S.sl_errors = {"general": [_failure(exc)]}
        return
    _flash("launch:success", f"Started {len(out.names)} {out.type} session(s) on {out.queue}: "
                             + ", ".join(f"{n} ({i[:8]})" for n, i in zip(out.names, out.run_ids)))
    for w in out.warnings:
        _flash("launch:warning", w, new=False)
    if out.run_ids:
        S["sel_session"] = out.run_ids[0]
    keep = {k: S.sl_form[k] for k in ("type", "queue")}
    S.sl_form = F.empty_form() | keep
    S.sl_gen += 1
    S.sl_step, S.sl_errors, S.sl_planned, S.sl_warnings = 0, {}, None, []
    S.pop("recent_pick", None)  # the recent list's picker starts again at this launch
    _refresh()


def _load_form(form: dict) -> None:
    S.sl_form = form
    S.sl_gen += 1
    S.sl_step, S.sl_errors, S.sl_planned = 0, {}, None


def _field_errors(*fields: str) -> None:
    for f in fields:
        msgs = S.sl_errors.get(f)
        if msgs:
            with st.container(key=f"err-{f}"):
                for m in msgs:
                    st.error(F.plain(m, 600), icon=":material/error:")


def _text(field: str, label: str, area: bool = False, **kw) -> None:
    widget = st.text_area if area else st.text_input
    widget(label, value=S.sl_form.get(field, ""), key=_key(field), **kw)
    _field_errors(field)


def _step_type() -> None:
    kinds = ["batch", "interactive"]
    kind = st.radio("Session type", kinds, index=kinds.index(S.sl_form.get("type") or "batch"), key=_key("type"),
                    horizontal=True, help="batch: runs its startup command once and ends with its exit; "
                                          "interactive: serves JupyterLab until terminated or reclaimed")
    _field_errors("type")
    _text("name", "Name", placeholder="empty: a readable random name",
          help="4-64 letters, digits, '_', '.' or '-', starting and ending with a letter or digit")
    if kind == "batch":
        _text("startup_command", "Startup command", placeholder="python train.py")
        c1, c2 = st.columns(2)
        with c1:
            _text("starts_at", "Starts at (optional)", placeholder="2026-12-01T09:00:00Z or 1h")
        with c2:
            _text("timeout", "Timeout (optional)", placeholder="30m")


def _step_resources(queues: list[dict]) -> None:
    names = [q["name"] for q in queues]
    if not names:
        st.warning("No launch queue exists yet: `prefect-launch queue apply deployments/queues.yaml`.")
        return
    current = S.sl_form.get("queue") or names[0]
    q = st.selectbox("Queue", names, index=names.index(current) if current in names else 0, key=_key("queue"))
    _field_errors("queue")
    spec = next(x for x in queues if x["name"] == q)
    presets = [""] + spec["presets"]
    chosen = S.sl_form.get("preset") or ""
    # the empty option's label is the same for every queue: a label that changed with the queue made
    # Streamlit keep the old label as the value when the queue changed ("unknown preset '(queue default: s)'")
    st.selectbox("Preset", presets, index=presets.index(chosen) if chosen in presets else 0, key=_key("preset"),
                 format_func=lambda p: p or "(queue default)")
    st.caption(f"Queue default: {spec['default_preset']}")
    _field_errors("preset")
    cols = st.columns(4)
    for col, (f, label, ph) in zip(cols, (("cpu", "CPUs", "preset's"), ("memory", "Memory", "e.g. 4Gi"),
                                          ("gpu", "GPUs", "preset's"), ("shm_size", "Shared memory", "e.g. 1Gi"))):
        with col:
            _text(f, label, placeholder=ph)
    _field_errors("resources")
    c1, c2 = st.columns(2)
    with c1:
        _text("count", "Number of sessions", help="N > 1 starts name-1..N; those that do not fit wait")
    with c2:
        _text("omp_threads", "OMP threads (optional)", placeholder="default: the session's CPUs")
    c1, c2, c3 = st.columns(3)
    with c1:
        _text("cluster_size", "Cluster size (optional)", placeholder="1: no cluster",
              help="N members (main1, sub1, ...), each with these resources, placed all or none; batch: every "
                   "member runs the command with its RANK; interactive: main1 serves the apps")
    with c2:
        modes = ["single-node", "multi-node"]
        mode = S.sl_form.get("cluster_mode") or "single-node"
        st.selectbox("Cluster mode", modes, index=modes.index(mode) if mode in modes else 0, key=_key("cluster_mode"),
                     help="single-node: all members on one agent; multi-node: spread over the queue's agents")
        _field_errors("cluster_mode")
    with c3:
        st.checkbox("Preemptible", value=S.sl_form.get("preemptible") == "True", key=_key("preemptible"),
                    help="Fills idle hardware; regular work may preempt it (it then waits again, keeping its "
                         "submit time)")
        _field_errors("preemptible")
    _text("image", "Environment image (docker queues)", placeholder="empty: the agent's environment")
    _text("env", "Environment variables, one NAME=value per line", area=True, height=90)


def _step_storage() -> None:
    _text("mounts", "Mounts, one HOST_FOLDER:PATH_IN_SESSION per line", area=True, height=90,
          help="Host folders outlive the session; its scratch folder is deleted when it ends")
    st.caption("Without a mount nothing the session writes is kept after it ends.")


def _step_network() -> None:
    _text("ports", "Ports for the session's apps (comma separated)", placeholder="empty: a free port",
          help="1024-65535; JupyterLab listens on the first one, on 127.0.0.1")
    st.caption("Apps bind to 127.0.0.1 only; open them from this machine (or through an SSH tunnel).")


def _step_review() -> None:
    req, _ = F.request_from_form(S.sl_form, ME)
    st.dataframe(F.review_rows(req, S.sl_planned), hide_index=True, width="stretch", key="review_table")
    for w in S.sl_warnings:
        st.warning(F.plain(w, 600))
    if S.sl_errors:
        with st.container(key="review-errors"):
            st.error("Fix these before launching:")
            for f, msgs in S.sl_errors.items():
                step = F.FIELD_STEP.get(f, F.REVIEW)
                for m in msgs:
                    st.markdown(f"- **{F.plain(F.FIELD_LABEL.get(f, f))}** ({F.plain(F.STEPS[step])}): {F.plain(m, 600)}")
            for step in sorted({F.FIELD_STEP.get(f, F.REVIEW) for f in S.sl_errors} - {F.REVIEW}):
                st.button(f"Edit: {F.STEPS[step]}", key=f"goto_{step}", on_click=_goto, args=(step,))


def panel_launcher(can_write: bool) -> None:
    with st.container(key="panel-launcher", border=True):
        st.subheader("Launch a session")
        _show_flash("launch")
        step = S.sl_step
        st.progress((step + 1) / len(F.STEPS))
        st.caption(" → ".join(f"**{i + 1}. {s}**" if i == step else f"{i + 1}. {s}" for i, s in enumerate(F.STEPS)))
        if not can_write:
            st.info("Sign in (sidebar) to launch sessions.")
            return
        try:
            queues = _queues()
        except Exception as exc:
            st.error(f"Cannot read the queues: {F.plain(exc)}")
            return
        with st.container(key=f"launch-step-{step}"):
            [_step_type, lambda: _step_resources(queues), _step_storage, _step_network, _step_review][step]()
        c1, c2, _ = st.columns([1, 1, 3])
        if step < F.REVIEW:
            c1.button("Next", key="launch_next", type="primary", on_click=_next)
        else:
            c1.button("Launch", key="launch_go", type="primary", on_click=_launch, disabled=bool(S.sl_errors))
        if step > 0:
            c2.button("Back", key="launch_back", on_click=_goto, args=(step - 1,))


# ----------------------------------------------------------------------------- recent launches
def panel_recent(can_write: bool) -> None:

    with st.container(key="panel-recent", border=True):
        st.subheader("Recent launches")
        _show_flash("recent")
        if ME is None:
            st.caption("Sign in (sidebar) to see your recent launches.")
            return
        try:
            with _client() as c:
                entries = O.recent(c, ME)
        except Exception as exc:
            st.error(f"Cannot read recent launches: {F.plain(exc)}")
            return
        if not entries:
            st.caption("No launches yet: your last five launch configurations (and pinned ones) appear here.")
            return
        st.dataframe(F.recent_frame(entries), hide_index=True, width="stretch", key="recent_table")
        if not can_write:
            return
        by_id = {e.id: e for e in entries}
        eid = st.selectbox("Launch configuration", list(by_id), key="recent_pick",
                           format_func=lambda i: f"{i} · {F.one_line(by_id[i].label, 80)}")
        entry = by_id[eid]
        c1, c2, c3 = st.columns([1, 1, 1])
        if c1.button("Relaunch", key="recent_relaunch"):
            try:
                with _client() as c:
                    out = O.relaunch(c, ME, eid)
                _flash("recent:success", f"Relaunched {entry.label}: {', '.join(out.names)}")
                if out.run_ids:
                    S["sel_session"] = out.run_ids[0]
            except Exception as exc:
                _flash("recent:error", _failure(exc))
            _refresh()
            st.rerun()
        if c2.button("Edit", key="recent_edit", help="Load it into the launcher, change it, launch"):
            _load_form(F.form_from_request(entry.request))
            st.rerun()
        if c3.button("Unpin" if entry.pinned else "Pin", key="recent_pin"):
            try:
                with _client() as c:
                    O.pin(c, ME, eid, not entry.pinned)
            except Exception as exc:
                _flash("recent:error", _failure(exc))
            st.rerun()


# ----------------------------------------------------------------------------- sessions and detail
def panel_sessions(all_owners: bool, include_ended: bool) -> list:
    """The session list; a click on a row opens it in the detail panel."""
    with st.container(key="panel-sessions", border=True):
        st.subheader("Sessions")
        try:
            rows = _sessions(None if all_owners else ME, include_ended)
        except Exception as exc:
            st.error(f"Cannot read sessions: {F.plain(exc)}")
            return []
        st.caption(("Every owner's" if all_owners or ME is None else f"{F.plain(ME)}'s") + " sessions"
                   + (", ended ones included" if include_ended else ", live ones") + f": {len(rows)} · "
                   "click a row for its detail")
        if not rows:
            return rows
        frame = F.sessions_frame(rows)
        event = st.dataframe(frame, hide_index=True, width="stretch", key="sessions_table", on_select="rerun",
                             selection_mode="single-row",
                             column_config={"position": st.column_config.NumberColumn("position", format="%d")})
        picked = list(event.selection.rows) if event and event.selection else []
        if picked != S.get("sessions_table_seen"):  # a click (not a stale index after the list changed)
            S["sessions_table_seen"] = picked
            if picked and picked[0] < len(frame) and frame["id"].iloc[picked[0]] != S.get("sel_session"):
                S["sel_session"] = frame["id"].iloc[picked[0]]
                S["sl_flash"] = [(k, t) for k, t in S.get("sl_flash", []) if not k.startswith("manage:")]
        return rows


def _history_section(run_id: str) -> None:
    st.markdown("**Scheduling history**")
    available, records, error = _history(run_id)
    if not available:
        st.caption("history not available (this installation has no scheduling history yet)")
        return
    if error:
        st.caption(f"history not available: {F.plain(error)}")
        return
    if not records:
        st.caption("No scheduling decisions recorded for this run yet.")
        return
    frame = F.history_frame(records)
    phases = sorted(set(F.PHASES) | set(frame["phase"]) - {""})
    results = sorted(set(F.RESULTS) | set(frame["result"]) - {""})
    c1, c2 = st.columns(2)
    ph = c1.multiselect("Phase", phases, key="hist_phase", placeholder="every phase")
    rs = c2.multiselect("Result", results, key="hist_result", placeholder="every result")
    chosen = F.filter_history(records, ph, rs)
    st.caption(f"{len(chosen)} of {len(records)} records")
    if not chosen:
        return
    st.dataframe(F.history_frame(chosen).drop(columns=["id"]), hide_index=True, width="stretch", key="history_table")
    for i, r in enumerate(chosen[:50]):
        subs = F.substeps_frame(r)
        with st.expander(F.plain(F.history_title(r)) + (f" · {len(subs)} sub-steps" if len(subs) else "")):
            msg = F.record_message(r)
            if msg:
                st.text(msg[:1000])
            if len(subs):
                st.dataframe(subs, hide_index=True, width="stretch", key=f"substeps_{i}")
            else:
                st.caption("no sub-steps")


def _actions(detail: dict, run_id: str) -> None:
    st.markdown("**Manage**")
    _show_flash("manage")
    running = detail.get("status") == "Running"
    c1, c2 = st.columns([2, 1])
    with c1:
        new = st.text_input("New name", key=f"rename_{run_id}", disabled=not running,
                            help="Only while it runs; the same naming rule as at launch")
        if st.button("Rename", key="rename_go", disabled=not running):
            try:
                with _client() as c:
                    old = O.rename(c, run_id, new, ME)
                _flash("manage:success", f"Renamed {old} -> {new.strip()}")
            except Exception as exc:
                _flash("manage:error", _failure(exc))
            _refresh()
            st.rerun()
        if not running:
            st.caption("Only a running session can be renamed.")
    with c2:
        if not F.is_live(detail.get("status")):
            st.caption("This session has ended.")
            return
        if detail.get("status") == "Cancelling":
            st.caption("Being terminated: its agent is stopping it.")
            return
        if not S.get("confirm_terminate") == run_id:
            if st.button("Terminate", key="terminate"):
                S["confirm_terminate"] = run_id
                st.rerun()
        else:
            st.warning("Stop its apps and processes, release its capacity, delete its scratch folder? Mounts are kept.")
            if st.button("Confirm terminate", key="terminate_confirm", type="primary"):
                try:
                    with _client() as c:
                        status = O.terminate(c, run_id, ME)
                    _flash("manage:success", f"Terminating {detail.get('name')}: {status}")
                except Exception as exc:
                    _flash("manage:error", _failure(exc))
                S.pop("confirm_terminate", None)
                _refresh()
                st.rerun()
            if st.button("Keep it running", key="terminate_cancel"):
                S.pop("confirm_terminate", None)
                st.rerun()


def panel_detail(rows: list, can_write: bool) -> None:
    with st.container(key="panel-detail", border=True):
        st.subheader("Session detail")
        if not rows:
            st.caption("No session to show.")
            return
        by_id = {r.id: r for r in rows}
        if S.get("sel_session") not in by_id:  # nothing picked yet, or it left the list
            S["sel_session"] = rows[0].id
        pick = S["sel_session"]
        try:
            with _client() as c:
                detail = O.detail(c, pick, ME)
        except Exception as exc:
            st.error(f"Cannot read the session: {F.plain(exc)}")
            return
        mine = ME is not None and detail.get("owner") == ME
        with st.container(key="detail-head"):
            st.markdown(f"**{F.plain(F.shown_name(detail.get('name')))}** · {F.plain(detail.get('status'))} · "
                        f"{F.plain(detail.get('type') or '-')} · {F.plain(pick)}")
        left, right = st.columns([3, 2])
        with left:
            st.dataframe(F.detail_frame(detail), hide_index=True, width="stretch", key="detail_table")
        with right:
            st.markdown("**Apps**")
            with st.container(key="detail-apps"):
                links = F.app_links(detail, mine)
                if links and mine:
                    for ln in links:
                        st.link_button(f"Open {ln['app']} (port {ln['port']})", ln["url"])
                        st.code(ln["url"], language=None)
                elif detail.get("type") == "interactive" and not mine:
                    st.caption("App links (with their token) are shown to the session's owner only.")
                elif detail.get("type") == "interactive" and F.is_live(detail.get("status")):
                    st.caption("The app's link appears once it answers.")
                else:
                    st.caption("No apps: " + ("batch sessions run a command." if detail.get("type") == "batch"
                                              else "the session has ended."))
            st.markdown("**Idle checks**")
            with st.container(key="detail-idle"):
                idle = F.idle_rows(detail)
                if len(idle):
                    st.table(idle, hide_index=True)
                    if F.idle_note(detail):
                        st.caption(F.plain(F.idle_note(detail)))
                else:
                    st.caption("No idle checks for this session (its queue declares none, or it is not running).")
        with st.container(key="detail-history"):
            _history_section(pick)
        if can_write and mine:
            with st.container(key="detail-actions"):
                _actions(detail, pick)
        elif not mine:
            st.caption("Rename and terminate are for the session's owner.")


def main() -> None:
    global _RUN_CLIENT
    with O.client(SIGNED) as c:  # signed in to the monitor as one of the gateway's users: as that user
        _RUN_CLIENT = c
        try:
            _page()
        finally:
            _RUN_CLIENT = None


def _page() -> None:
    st.title("Sessions")
    sb = st.sidebar
    sb.header("Sessions")
    sb.caption(f"Launching as {F.plain(ME)}" if ME else "Sign in (below) to launch and manage your sessions")
    all_owners = sb.checkbox("Every owner's sessions", key="sessions_all")
    include_ended = sb.checkbox("Include ended sessions", value=True, key="sessions_ended")
    if sb.button("Refresh", key="sessions_refresh"):
        _refresh()
    can_write = _unlocked()
    left, right = st.columns([3, 2])
    with left:
        panel_launcher(can_write)
    with right:
        panel_recent(can_write)
    rows = panel_sessions(all_owners, include_ended)
    panel_detail(rows, can_write)


main()
