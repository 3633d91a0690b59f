"""The queue monitor while Prefect's server is down, and after it is back.

Uses its own server (a fixed port and database, stopped and started again), like
test_agent_outages.py; the page runs under Streamlit's AppTest in this process.
"""

from __future__ import annotations

import uuid

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from fixtures_dashboard import choose, fresh_app, tables
from launch_helpers import restored_prefect_env
from prefect_launch.local_server import free_port, local_prefect_server

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")

pytestmark = pytest.mark.server  # its own server, stopped and started again


def _queues_shown(at: AppTest) -> set[str]:
    for d in tables(at):
        if {"queue", "agents_online"} <= set(d.columns):  # the queue summary
            return set(d["queue"])
    return set()


def _said(at: AppTest, kind: str) -> str:
    return "\n".join(e.value for e in getattr(at, kind))


def test_monitor_says_the_server_is_down_shows_its_last_figures_and_recovers(tmp_path_factory):
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from prefect_launch.dashboard import page_data as P

    home, port = tmp_path_factory.mktemp("monitor-outage"), free_port()
    pool = f"mon-out-{uuid.uuid4().hex[:6]}"
    with restored_prefect_env():
        with local_prefect_server(home, port=port):
            with get_client(sync_client=True) as client:
                client.create_work_pool(WorkPoolCreate(name=pool, type="launch-process", concurrency_limit=2))
            at = fresh_app().run()
            assert not at.exception, [e.value for e in at.exception]
            assert pool in _queues_shown(at), "the queue created before the outage is on the page"
            assert "Cannot read" not in _said(at, "warning") + _said(at, "error")

        # the server is stopped. A visit after Refresh now (or in a later step of the page's clock) reads
        # again: the pages read are forgotten, what the page last read well is not
        P.refresh()
        down = AppTest.from_file(APP, default_timeout=120).run()
        assert not down.exception, [e.value for e in down.exception]
        warning = _said(down, "warning")
        assert "Cannot read the queues from Prefect's API" in warning, warning
        assert "Showing the figures read at" in warning and "PREFECT_API_URL" in warning
        assert pool in _queues_shown(down), "the last good figures stay on the page, with their age"

        # a sidebar state never read before has no last figures: the error alone, no traceback
        choose(down, "grouping", ["owner"]).run()
        assert not down.exception, [e.value for e in down.exception]
        assert "Cannot read the queues from Prefect's API" in _said(down, "error")
        assert not _queues_shown(down)

        with local_prefect_server(home, port=port):  # back on the same port and database
            P.refresh()
            back = AppTest.from_file(APP, default_timeout=120).run()
            assert not back.exception, [e.value for e in back.exception]
            assert "Cannot read" not in _said(back, "warning") + _said(back, "error")
            assert pool in _queues_shown(back)
    P.clear()
