"""How `make dashboard` starts Streamlit (dashboard/serve.py): the options it adds, and the connections it
accepts sending each write at once (TCP_NODELAY) - without it a kept-alive response's body waits for the
browser's delayed ACK (40 ms a request on Linux, ~150 scripts a new visit)."""

from __future__ import annotations

import asyncio
import socket

from prefect_launch.dashboard import serve, streamlit_hook


def test_defaults_fill_only_what_is_not_given():
    args = serve.streamlit_args(["--server.port", "8600", "--runner.postScriptGC=true"])
    assert args[:2] == ["--server.port", "8600"]
    assert "--runner.postScriptGC=true" in args and args.count("--runner.postScriptGC") == 0  # the caller's kept
    added = args[3:]
    pairs = dict(zip(added[::2], added[1::2]))
    assert pairs["--server.address"] == "127.0.0.1"  # loopback unless asked otherwise
    assert pairs["--runner.magicEnabled"] == "false"
    assert serve.streamlit_args(["--server.address", "0.0.0.0"]).count("--server.address") == 1


def _accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY of the connection an asyncio server (as uvicorn runs on Streamlit's socket) accepts."""
    async def run() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                got.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Proto, sock=listener)
        try:
            _r, w = await asyncio.open_connection(*listener.getsockname()[:2])
            value = await asyncio.wait_for(got, 10)
            w.close()
            return value
        finally:
            server.close()

    return asyncio.run(run())


def test_accepted_connections_send_at_once():
    from streamlit.web.server.starlette import starlette_server as ss

    assert serve._accept_with_nodelay() is True
    assert serve._accept_with_nodelay() is True  # wrapping twice is harmless: one wrapper
    assert "nodelay" in streamlit_hook.hooks_of(ss._bind_socket)
    assert "nodelay" not in streamlit_hook.hooks_of(ss._bind_socket.__closure__[0].cell_contents)
    listener = ss._bind_socket("127.0.0.1", 0, 16)  # what Streamlit's server binds
    try:
        assert listener.proto == socket.IPPROTO_TCP
        assert listener.getblocking() is False and listener.get_inheritable()  # as Streamlit made it
        assert _accepted_nodelay(listener) != 0
    finally:
        listener.close()


def test_a_socket_without_its_protocol_gets_no_nodelay():
    """Why the wrap exists: asyncio leaves Nagle on where the socket object's protocol reads 0, as
    Streamlit binds it (if a Python release changes this, the wrap is no longer needed)."""
    bare = socket.socket(family=socket.AF_INET)
    bare.bind(("127.0.0.1", 0))
    bare.listen(4)
    bare.setblocking(False)
    try:
        assert bare.proto == 0
        assert _accepted_nodelay(bare) == 0
    finally:
        bare.close()
