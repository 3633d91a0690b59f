"""The monitor's login gate: with a password configured, Manage Links writes nothing before sign-in.

Streamlit's AppTest runs the real page against the session's Prefect server; the
password comes from a Prefect Secret block (or LAUNCH_DASHBOARD_PASSWORD).
"""

from __future__ import annotations

import uuid

import pytest
from streamlit.testing.v1 import AppTest

from fixtures_dashboard import captions, fresh_app, headings



@pytest.fixture(scope="module")
def site(prefect_server):
    import prefect.context
    from prefect import get_client
    from prefect.blocks.system import Secret
    from prefect.client.schemas.actions import WorkPoolCreate

    prefect.context.refresh_global_settings_context()
    u = uuid.uuid4().hex[:6]
    pool = f"gate-{u}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="launch-process"))
    password = f"pw-{uuid.uuid4().hex}"
    block = f"dash-pw-{u}"
    Secret(value=password).save(block)
    return {"pool": pool, "password": password, "block": block}


def _links(pool: str):
    from prefect_launch.blocks.queue_links import QueueLinks

    return [(x.label, x.url) for x in QueueLinks.for_queue(pool).links]


def _open(at: AppTest) -> AppTest:
    at.session_state["links_open"] = True  # the Manage Links toggle on
    return at.run()


def _keys(at: AppTest) -> set[str]:
    return {w.key for w in at.text_input}


def _sign_in(at: AppTest, password: str) -> AppTest:
    at.text_input(key="links_password").input(password)
    at.button[[b.label for b in at.button].index("Sign in")].click()
    return at.run()


def _save_link(at: AppTest, pool: str, label: str, url: str) -> AppTest:
    at.selectbox(key="links_queue").set_value(pool)
    at.run()
    at.text_input(key="link_label").input(label)
    at.text_input(key="link_url").input(url)
    at.button[[b.label for b in at.button].index("Save link")].click()
    return at.run()


def test_links_form_needs_the_password_from_a_secret_block(site, monkeypatch):
    monkeypatch.setenv("LAUNCH_DASHBOARD_PASSWORD_BLOCK", site["block"])
    monkeypatch.delenv("LAUNCH_DASHBOARD_PASSWORD", raising=False)
    at = _open(fresh_app())
    assert not at.exception, [e.value for e in at.exception]
    # locked: a sign-in form, and no link form at all
    assert "links_password" in _keys(at)
    assert not {"link_label", "link_url"} & _keys(at)
    assert "Save link" not in [b.label for b in at.button]

    at = _sign_in(at, "wrong-" + site["password"])
    assert any("Wrong password" in e.value for e in at.error)
    assert not {"link_label", "link_url"} & _keys(at)
    assert _links(site["pool"]) == []

    at = _sign_in(at, site["password"])
    assert not at.exception, [e.value for e in at.exception]
    assert {"link_label", "link_url"} <= _keys(at) and "links_password" not in _keys(at)
    at = _save_link(at, site["pool"], "Grafana", "https://grafana.example.com/d/x")
    assert at.success, [e.value for e in at.error]
    assert _links(site["pool"]) == [("Grafana", "https://grafana.example.com/d/x")]
    # the page never shows the password
    page = "\n".join([str(e.value) for e in [*at.markdown, *at.error, *at.success, *at.info]] + headings(at) + [captions(at)])
    assert site["password"] not in page

    # a new session (another browser) is locked again
    at2 = _open(fresh_app())
    assert "links_password" in _keys(at2) and "link_url" not in _keys(at2)


def test_links_form_password_from_environment(site, monkeypatch):
    monkeypatch.delenv("LAUNCH_DASHBOARD_PASSWORD_BLOCK", raising=False)
    monkeypatch.setenv("LAUNCH_DASHBOARD_PASSWORD", "env-pass-123")
    at = _open(fresh_app())
    assert "links_password" in _keys(at)
    at = _sign_in(at, "env-pass-12")
    assert any("Wrong password" in e.value for e in at.error)
    at = _sign_in(at, "env-pass-123")
    assert "link_url" in _keys(at)


def test_unreadable_password_block_keeps_the_form_locked(site, monkeypatch):
    monkeypatch.setenv("LAUNCH_DASHBOARD_PASSWORD_BLOCK", f"missing-{uuid.uuid4().hex[:6]}")
    monkeypatch.setenv("LAUNCH_DASHBOARD_PASSWORD", "env-pass-123")  # the block wins: no fallback
    at = _open(fresh_app())
    at = _sign_in(at, "env-pass-123")
    assert any("Sign-in unavailable" in e.value for e in at.error), [e.value for e in at.error]
    assert "link_url" not in _keys(at)


def test_without_a_configured_password_the_form_is_open(site, monkeypatch):
    monkeypatch.delenv("LAUNCH_DASHBOARD_PASSWORD_BLOCK", raising=False)
    monkeypatch.delenv("LAUNCH_DASHBOARD_PASSWORD", raising=False)
    at = _open(fresh_app())
    assert "link_url" in _keys(at) and "links_password" not in _keys(at)
