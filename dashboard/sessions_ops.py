"""What the Sessions page reads and does through Prefect, with the session back end's own functions.

Launch: :func:`prefect_launch.deployments.sessions.start_session` (validation included). Lists:
:func:`prefect_launch.deployments.session_view.list_sessions`. App URLs: ``session_view.app_urls``,
as `session show` (read for the owner only). Rename and terminate follow `session rename` /
`session terminate` (same rules and messages: names by ``NAME_RE``, only while running, unique
among the owner's live sessions; a waiting session is cancelled at once, a running one is asked
to stop). No Streamlit here; shaping for display is in :mod:`.sessions_frames`.
"""

from __future__ import annotations

import contextlib
import getpass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterator, Optional

from prefect_launch.dashboard import sessions_frames as F

if TYPE_CHECKING:
    from prefect_launch.dashboard.monitor_login import SignedIn


def viewer() -> str:
    """Whose sessions the page manages: the user the monitor runs as (what the CLI defaults to)."""
    return getpass.getuser()


@contextlib.contextmanager
def client(signed: Optional["SignedIn"] = None) -> Iterator[Any]:
    """Prefect's client, as ``signed`` (a user signed in to the monitor) when given: that user's key then
    authenticates everything made inside, block reads included (:func:`.monitor_login.acting_as`)."""
    from prefect import get_client

    from prefect_launch.dashboard.monitor_login import acting_as

    with acting_as(signed), get_client(sync_client=True) as c:
        yield c


def launch_queues(c: Any) -> list[dict[str, Any]]:
    """Launch queues (work pools with a prefect-launch declaration): name, presets, default preset."""
    from prefect_launch.workers.scheduling.queue_spec import queue_spec_of

    out, offset = [], 0
    while True:
        pools = c.read_work_pools(limit=200, offset=offset)
        for p in pools:
            try:
                spec = queue_spec_of(p)
            except Exception:
                spec = None
            if spec is not None:
                out.append({"name": p.name, "presets": sorted(spec.presets), "default_preset": spec.default_preset})
        if len(pools) < 200:
            return sorted(out, key=lambda q: q["name"])
        offset += 200


def sessions(c: Any, owner: Optional[str], include_ended: bool) -> list[Any]:
    from prefect_launch.deployments.session_view import list_sessions

    return list_sessions(c, owner=owner, include_ended=include_ended)


def start(c: Any, req: Any, dry_run: bool) -> Any:
    """``start_session``; raises ``LaunchValidationError`` (``.problems`` when it is a session's)."""
    from prefect_launch.deployments.sessions import start_session

    return start_session(c, req, dry_run=dry_run)


def _usage(run_id: str) -> Optional[dict]:
    try:
        from prefect_launch.dashboard.metrics_source import metrics_store

        store = metrics_store()
        summary = store.get_summary(run_id) if store is not None else None
        return summary.model_dump(mode="json") if summary else None
    except Exception:
        return None


def detail(c: Any, run_id: str, who: str) -> dict[str, Any]:
    """`session show --json` of one run; app URLs (with their token) only when ``who`` owns it."""
    from prefect_launch.deployments.session_view import app_urls, idle_checks_of, row_of

    fr = c.read_flow_run(run_id)
    now = datetime.now(timezone.utc)
    row = row_of(fr, now)
    urls = app_urls(c, fr) if who and row.owner == who else []
    return F.session_detail(fr, row, urls, _usage(run_id), idle_checks_of(fr, now))


def rename(c: Any, run_id: str, new_name: str, owner: str) -> str:
    """`session rename`: only a running session of ``owner``, to a valid name no live session of theirs has."""
    from prefect_launch.deployments.session_view import row_of
    from prefect_launch.deployments.sessions import NAME_RE, live_sessions

    new_name = (new_name or "").strip()
    if not NAME_RE.match(new_name):
        raise ValueError(f"name {new_name!r}: use 4-64 letters, digits, '_', '.' or '-', starting and ending with "
                         "a letter or digit")
    fr = c.read_flow_run(run_id)
    if row_of(fr, datetime.now(timezone.utc)).owner != owner:
        raise ValueError(f"session {fr.name} is not yours ({owner}); only its owner renames it")
    if not fr.state or fr.state.type.value != "RUNNING":
        raise ValueError(f"session {fr.name} is {fr.state_name}; only a running session can be renamed")
    if any(r.name == new_name for r in live_sessions(c, owner)):
        raise ValueError(f"name {new_name!r} is taken by another live session")
    c.update_flow_run(fr.id, name=new_name)
    return fr.name


def terminate(c: Any, run_id: str, owner: str) -> str:
    """`session terminate --no-wait`: a waiting session is cancelled at once, a running one asked to stop
    (its agent stops the apps and processes, releases the capacity, deletes the scratch folder)."""
    from prefect.states import Cancelled, Cancelling

    from prefect_launch.deployments.session_view import row_of

    fr = c.read_flow_run(run_id)
    if row_of(fr, datetime.now(timezone.utc)).owner != owner:
        raise ValueError(f"session {fr.name} is not yours ({owner}); only its owner terminates it")
    if fr.state and fr.state.is_final():
        raise ValueError(f"session {fr.name} already ended ({fr.state_name})")
    message = f"terminated by {owner}"
    if fr.state and fr.state.type.value in ("SCHEDULED", "PAUSED"):
        c.set_flow_run_state(fr.id, Cancelled(message=message), force=True)
    else:
        c.set_flow_run_state(fr.id, Cancelling(message=message), force=True)
    return c.read_flow_run(fr.id).state_name


def history(run_id: str) -> tuple[bool, list[Any], Optional[str]]:
    """(available, records, error): the run's scheduling history from the metrics store, all phases
    (the page filters), when ``prefect_launch.blocks.scheduling_history`` is installed."""
    try:
        from prefect_launch.blocks.scheduling_history import read_history
    except ImportError:
        return False, [], None
    try:
        from prefect_launch.dashboard.metrics_source import metrics_store

        store = metrics_store()
        if store is None:
            return True, [], "no metrics store"
        return True, list(read_history(store, run_id)), None
    except Exception as exc:  # the store is down: say so, keep the rest of the panel
        return True, [], f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def recent(c: Any, owner: str) -> list[Any]:
    from prefect_launch.deployments.session_recent import load

    return load(c, owner).entries


def pin(c: Any, owner: str, entry_id: str, pinned: bool) -> Any:
    from prefect_launch.deployments.session_recent import update

    return update(c, owner, entry_id, pinned=pinned)


def relaunch(c: Any, owner: str, entry_id: str, name: Optional[str] = None) -> Any:
    """`session relaunch ID [--name]`."""
    from prefect_launch.deployments.session_recent import find, load

    entry = find(load(c, owner), entry_id)
    return start(c, F.relaunch_request(entry, owner, name), dry_run=False)
