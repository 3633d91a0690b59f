"""The functions of Streamlit's own server the monitor wraps (`dashboard/asset_cache.py`, `dashboard/serve.py`).

Streamlit has no public hook for either: the Starlette app it makes (wrapped to replay its immutable
assets from memory) and the socket it binds (wrapped to set TCP_NODELAY). `dashboard/streamlit_hook.wrap`
leaves a Streamlit without them as it is; `missing()` says so in the tests.
"""

from __future__ import annotations

import importlib

SERVER_MODULE = "streamlit.web.server.starlette.starlette_server"
CREATE_APP = "create_starlette_app"
BIND_SOCKET = "_bind_socket"


def missing() -> list[str]:
    try:
        module = importlib.import_module(SERVER_MODULE)
    except ImportError:
        return [SERVER_MODULE]
    return [f"{SERVER_MODULE}.{n}" for n in (CREATE_APP, BIND_SOCKET) if not hasattr(module, n)]
