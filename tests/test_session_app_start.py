"""The session flow's app start, both ways: forked from an interpreter that has JupyterLab imported
(a warm engine) and cold (``python -m jupyterlab``). Either way: bound to 127.0.0.1, token required,
a terminal can be opened, and terminate stops it and closes the port."""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("jupyterlab")

pytestmark = pytest.mark.server  # a served JupyterLab

FLOW = Path(__file__).resolve().parents[1] / "flows" / "session.py"


def _session_module():
    spec = importlib.util.spec_from_file_location("launch_session_flow_under_test", FLOW)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _other_local_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the outgoing address
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


@pytest.mark.parametrize("warm", [True, False], ids=["forked", "cold"])
def test_app_serves_with_token_and_terminal_then_stops(tmp_path, monkeypatch, warm):
    mod = _session_module()
    if warm:
        import jupyterlab.labapp  # noqa: F401  (what a warm engine has imported)
    else:
        monkeypatch.delitem(sys.modules, "jupyterlab.labapp", raising=False)
    port, token = _free_port(), "t0ken-for-the-test"
    app = mod._jupyter(tmp_path, port, "127.0.0.1", token)
    try:
        assert isinstance(app, mod._ForkedApp) is warm
        mod._wait_port("127.0.0.1", port, app, timeout=180)
        auth = {"Authorization": f"token {token}"}
        deadline = time.time() + 60
        while True:
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/api/status", headers=auth, timeout=10)
                break
            except httpx.HTTPError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=10).status_code in (401, 403)
        term = httpx.post(f"http://127.0.0.1:{port}/api/terminals", headers=auth, timeout=30)
        assert term.status_code == 200, term.text
        other = _other_local_address()
        if other:  # bound to loopback only: not reachable on the machine's other address
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((other, port)) != 0
    finally:
        app.terminate()
        try:
            app.wait(30)
        except Exception:
            app.kill()
            app.wait(10)
    assert app.poll() is not None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=3)
