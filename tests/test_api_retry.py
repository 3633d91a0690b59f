"""Quick retries of a busy server's 503 (prefect_launch.api_retry), through Prefect's own HTTP clients
against a real loopback HTTP server that answers 503 a given number of times."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest

from prefect_launch import api_retry


class _Busy(http.server.BaseHTTPRequestHandler):
    """503 for the first ``busy`` requests (like a SQLite server whose write met a lock), then 200."""

    busy = 0
    seen: list[float] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        type(self).seen.append(time.monotonic())
        code = 503 if len(type(self).seen) <= type(self).busy else 200
        payload = b'{"exception_message": "Service Unavailable"}' if code == 503 else b'{"ok": true, "echo": %d}' % len(body)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def busy_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Busy.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Busy
    srv.shutdown()
    srv.server_close()


def test_a_few_503s_are_retried_within_a_second_not_after_prefects_back_off(busy_server, monkeypatch):
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    url, handler = busy_server
    assert api_retry.install()
    assert api_retry.install()  # once per process: a second call wraps nothing again
    assert PrefectHttpxSyncClient._send_with_retry.__wrapped__.__name__ == "_send_with_retry"
    assert not getattr(PrefectHttpxSyncClient._send_with_retry.__wrapped__, "_launch_quick_retry", False)

    handler.busy = 3
    with PrefectHttpxSyncClient(base_url=url) as client:
        r = client.post("/x", json={"a": 1})
    assert r.status_code == 200 and r.json()["echo"] > 0  # the body was sent again with each retry
    assert len(handler.seen) == 4
    # Prefect alone waits 2 s (+-20 % jitter: >= 1.6 s) before its first retry; three quick ones take < 0.6 s
    assert handler.seen[-1] - handler.seen[0] < 1.5, handler.seen

    handler.seen, handler.busy = [], 2

    async def go():
        async with PrefectHttpxAsyncClient(base_url=url) as client:
            return await client.get("/y")

    assert asyncio.run(go()).status_code == 200
    assert len(handler.seen) == 3 and handler.seen[-1] - handler.seen[0] < 1.5, handler.seen


def test_past_the_quick_retries_prefects_own_back_off_still_applies(busy_server, monkeypatch):
    from prefect.client.base import PrefectHttpxSyncClient

    url, handler = busy_server
    api_retry.install()
    monkeypatch.setenv("LAUNCH_API_QUICK_RETRIES", "1")
    handler.busy = 3  # one quick retry per Prefect attempt (2 sends), then Prefect waits ~2 s and tries again
    with PrefectHttpxSyncClient(base_url=url) as client:
        r = client.get("/z")
    assert r.status_code == 200 and len(handler.seen) == 4
    gaps = [b - a for a, b in zip(handler.seen, handler.seen[1:])]
    # quick (< 0.6 s), Prefect's back-off (2 s, jittered +-20 %), quick
    assert gaps[0] < 0.9 and gaps[1] >= 1.5 and gaps[2] < 0.9, gaps


def test_quick_delays_follow_the_setting(monkeypatch):
    monkeypatch.setenv("LAUNCH_API_QUICK_RETRIES", "0")
    assert api_retry.quick_delays() == ()
    monkeypatch.setenv("LAUNCH_API_QUICK_RETRIES", "6")
    assert api_retry.quick_delays() == (0.05, 0.1, 0.2, 0.4, 0.4, 0.4)


def test_single_try_sends_once_and_raises_server_busy(busy_server):
    """Writes the caller makes again anyway (waiting labels, the agent's published state) are sent once."""
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    url, handler = busy_server
    api_retry.install()
    handler.busy = 1
    with PrefectHttpxSyncClient(base_url=url) as client:
        with api_retry.single_try(), pytest.raises(api_retry.ServerBusy):
            client.post("/labels", json={"a": 1})
        assert len(handler.seen) == 1  # neither a quick retry nor Prefect's back-off
        assert client.get("/after").status_code == 200  # outside the block: as before

    handler.seen, handler.busy = [], 1

    async def go():
        async with PrefectHttpxAsyncClient(base_url=url) as client:
            with api_retry.single_try():
                with pytest.raises(api_retry.ServerBusy):
                    await client.get("/y")
                assert (await client.get("/y")).status_code == 200  # a 200 is returned as usual
            return len(handler.seen)

    t0 = time.monotonic()
    assert asyncio.run(go()) == 2 and time.monotonic() - t0 < 1.5
