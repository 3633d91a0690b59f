"""The Sessions page's logic with Streamlit's AppTest against a real Prefect server (no agent,
no browser): errors filed under their fields on each step and from the review's dry run, a
launch, the recent launch loaded back into the launcher, terminate of a waiting session.
test_sessions_page_browser.py covers the page end to end in Chromium with an agent."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from launch_helpers import apply_queue, read_runs, wait_final

PAGE = Path(__file__).resolve().parents[1] / "dashboard" / "pages" / "1_Sessions.py"
PRESETS = {"small": {"cpu": 1, "memory": "1Gi"}, "big": {"cpu": 2, "memory": "1Gi"}}


@pytest.fixture(scope="module")
def queue(prefect_server, tmp_path_factory):
    return apply_queue(tmp_path_factory.mktemp("sessions-app"),
                       {"name": f"sa-{uuid.uuid4().hex[:6]}", "presets": PRESETS, "default_preset": "small"})


def _page() -> AppTest:
    import streamlit as st

    st.cache_data.clear()  # a page another test opened within the TTL would hide this test's queue
    at = AppTest.from_file(str(PAGE), default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _next(at: AppTest) -> AppTest:
    at.button(key="launch_next").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _shown(at: AppTest) -> str:
    return "\n".join(e.value for e in at.error)


def test_launcher_files_errors_under_fields_then_launches(queue, tmp_path):
    name = f"app-{uuid.uuid4().hex[:6]}"
    at = _page()
    S = at.session_state
    # step 1: interactive hides the batch-only fields; batch with a bad name and no command stays here
    at.radio(key="lf_type_0").set_value("interactive").run()
    assert "lf_startup_command_0" not in [t.key for t in at.text_input]
    at.radio(key="lf_type_0").set_value("batch").run()
    at.text_input(key="lf_name_0").input("x!")
    _next(at)
    assert S["sl_step"] == 0 and set(S["sl_errors"]) == {"name", "startup_command"}
    assert "name 'x\\!'" in _shown(at) and "needs \\-\\-startup\\-command" in _shown(at)  # escaped Markdown
    at.text_input(key="lf_name_0").input(name)
    at.text_input(key="lf_startup_command_0").input("true")
    _next(at)
    # step 2: this queue, preset big, an impossible CPU count (only the queue's resolution refuses it)
    assert S["sl_step"] == 1 and S["sl_errors"] == {}
    at.selectbox(key="lf_queue_0").set_value(queue).run()
    at.selectbox(key="lf_preset_0").set_value("big")
    at.text_input(key="lf_cpu_0").input("-1")
    _next(at)
    # step 3: a relative host folder is refused under Mounts
    at.text_area(key="lf_mounts_0").input("relative:/data")
    _next(at)
    assert S["sl_step"] == 2 and list(S["sl_errors"]) == ["mounts"] and "absolute path" in S["sl_errors"]["mounts"][0]
    at.text_area(key="lf_mounts_0").input(f"{tmp_path}:/data")
    _next(at)
    # step 4: a port out of range is refused under Ports
    at.text_input(key="lf_ports_0").input("80")
    _next(at)
    assert S["sl_step"] == 3 and "port 80 is outside 1024-65535" in S["sl_errors"]["ports"][0]
    at.text_input(key="lf_ports_0").input("")
    _next(at)
    # review: the dry run's refusal lands on the CPU field, Launch is off, Edit goes back to its step
    assert S["sl_step"] == 4 and list(S["sl_errors"]) == ["cpu"], S["sl_errors"]
    assert at.button(key="launch_go").disabled
    at.button(key="goto_1").click().run()
    assert S["sl_step"] == 1 and at.text_input(key="lf_cpu_0").value == "-1"
    at.text_input(key="lf_cpu_0").input("")
    for _ in range(3):
        _next(at)
    assert S["sl_step"] == 4 and S["sl_errors"] == {} and S["sl_planned"].preset == "big"
    review = dict(next(d.value for d in at.dataframe if list(d.value.columns) == ["item", "value"])
                  .itertuples(index=False))
    assert review["names"] == name and review["resources"].startswith("cpu=2") and review["mounts"] == f"{tmp_path}:/data"
    at.button(key="launch_go").click().run()
    assert not at.exception and S["sl_step"] == 0
    assert any(f"{name} (" in s.value.replace("\\", "") for s in at.success), [s.value for s in at.success]
    run = read_runs([S["sel_session"]])[0]
    assert run.name == name and run.work_pool_name == queue and run.parameters["mounts"] == [f"{tmp_path}:/data"]

    # the launch is the newest recent configuration; Edit loads it into the launcher
    assert name in at.selectbox(key="recent_pick").format_func(at.selectbox(key="recent_pick").value)
    at.button(key="recent_edit").click().run()
    gen = S["sl_gen"]
    assert at.text_input(key=f"lf_name_{gen}").value == name
    assert at.text_input(key=f"lf_startup_command_{gen}").value == "true"

    # terminate the session (waiting: no agent serves this queue): cancelled at once
    at.button(key="terminate").click().run()
    at.button(key="terminate_confirm").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert wait_final([str(run.id)], timeout=30)[0].state.is_cancelled()


def test_login_gate_locks_launch_and_changes(queue, monkeypatch):
    """With the monitor's login configured, the page reads but neither launches nor changes a session."""
    monkeypatch.setenv("LAUNCH_DASHBOARD_PASSWORD", "s3cret-page")
    at = _page()
    assert "launch_next" not in [b.key for b in at.button] and "recent_relaunch" not in [b.key for b in at.button]
    assert any("Sign in" in i.value for i in at.info)
    assert not [b for b in at.button if b.key in ("rename_go", "terminate")]
    def sign_in(password: str) -> None:
        at.sidebar.text_input(key="sessions_password").input(password)
        next(b for b in at.sidebar.button if b.label == "Sign in").click().run()
        assert not at.exception, [e.value for e in at.exception]

    sign_in("wrong")
    assert "launch_next" not in [b.key for b in at.button] and any("Wrong password" in e.value for e in at.error)
    sign_in("s3cret-page")
    assert "launch_next" in [b.key for b in at.button] and at.session_state["links_authed"]


def test_every_control_of_the_list_and_the_launcher(queue):
    """The sidebar's switches and Refresh, a click on a row of the session list (its selection, as the
    browser sends it), the launcher's Back and the recent launches' Pin, each driven through AppTest with
    what it changes."""
    from prefect.states import Cancelled

    from prefect_launch.dashboard import sessions_ops as O
    from prefect_launch.deployments.sessions import SessionRequest, start_session

    tag = uuid.uuid4().hex[:6]
    with O.client() as c:
        ids = [str(start_session(c, SessionRequest(type="batch", queue=queue, name=f"ls-{tag}-{i}",
                                                   startup_command="true")).run_ids[0]) for i in range(2)]
        c.set_flow_run_state(ids[0], Cancelled(), force=True)
    at = _page()
    S = at.session_state

    def listed() -> list[str]:
        return list(next(d.value for d in at.dataframe if "id" in d.value.columns and "status" in d.value.columns)["id"])

    assert set(ids) <= set(listed())  # ended sessions included by default
    at.sidebar.checkbox(key="sessions_ended").uncheck().run()
    assert not at.exception and ids[1] in listed() and ids[0] not in listed()  # live ones only
    at.sidebar.checkbox(key="sessions_ended").check().run()
    assert ids[0] in listed()
    at.sidebar.checkbox(key="sessions_all").check().run()
    assert not at.exception and any(c.value.startswith("Every owner's sessions") for c in at.caption)
    at.sidebar.checkbox(key="sessions_all").uncheck().run()
    at.sidebar.button(key="sessions_refresh").click().run()
    assert not at.exception and set(ids) <= set(listed())
    # a click on a row opens that session in the detail panel
    for i in ids:
        S["sessions_table"] = {"selection": {"rows": [listed().index(i)], "columns": [], "cells": []}}
        at.run()
        assert not at.exception and S["sel_session"] == i
        assert i in next(m.value for m in at.markdown if m.value.startswith("**")).replace("\\", "")
    # the launcher's Back returns to the step before
    at.text_input(key="lf_name_0").input(f"back-{tag}")
    at.text_input(key="lf_startup_command_0").input("true")
    _next(at)
    assert S["sl_step"] == 1
    at.button(key="launch_back").click().run()
    assert S["sl_step"] == 0 and at.text_input(key="lf_name_0").value == f"back-{tag}"
    # the recent launches: Pin, then Unpin
    pin = at.button(key="recent_pin")
    label = pin.label
    pin.click().run()
    assert not at.exception and at.button(key="recent_pin").label != label
    at.button(key="recent_pin").click().run()
    assert at.button(key="recent_pin").label == label


def test_an_unknown_login_mode_locks_every_write(queue, monkeypatch):
    """LAUNCH_DASHBOARD_LOGIN must name a mode (dashboard/monitor_login.py); anything else says so and nothing
    writes (the modes themselves: test_monitor_login.py, and through the gateway: test_gateway_e2e.py)."""
    monkeypatch.setenv("LAUNCH_DASHBOARD_LOGIN", "sso")
    at = _page()
    assert any("Sign-in unavailable: LAUNCH_DASHBOARD_LOGIN='sso' is not a login mode" in e.value
               for e in at.sidebar.error), [e.value for e in at.error]
    assert not {"launch_next", "recent_relaunch", "rename_go", "terminate"} & {b.key for b in at.button}
