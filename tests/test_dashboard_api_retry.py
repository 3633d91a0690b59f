"""The monitor's API client resends a read once when the server closes the connection without answering.

A real socket server stands in for a Prefect server whose kept-alive connection closed just as a request
went out (seen at 1M runs: ``RemoteProtocolError: Server disconnected without sending a response``): it
closes the first connection after reading a request, then answers.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from prefect_launch.dashboard.api import Api


def _server(drops: int):
    """(base URL, requests seen): drops the first ``drops`` requests unanswered, answers the rest ``[]``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    seen: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                seen.append(head.split(b"\r\n")[0].decode())
                if len(seen) <= drops:
                    continue  # closed without an answer
                out = json.dumps([]).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(out), out))

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}/api", seen, sock


def test_a_read_is_sent_again_once_and_a_write_is_not():
    url, seen, sock = _server(drops=1)
    try:
        api = Api(url)
        assert api.post("/flow_runs/filter", {"limit": 1}) == []  # dropped once, then answered
        assert seen == ["POST /api/flow_runs/filter HTTP/1.1"] * 2
        assert api.get("/work_pools/q1") == [] and len(seen) == 3
    finally:
        sock.close()
    url, seen, sock = _server(drops=1)
    try:
        with pytest.raises(httpx.RemoteProtocolError):  # a write may have been applied: not resent
            Api(url).post("/variables/", {"name": "x", "value": "y"})
        assert seen == ["POST /api/variables/ HTTP/1.1"]
    finally:
        sock.close()
    url, seen, sock = _server(drops=2)
    try:
        with pytest.raises(httpx.RemoteProtocolError):  # once only: a server that keeps failing is told
            Api(url).post("/flow_runs/count", {})
        assert len(seen) == 2
    finally:
        sock.close()
