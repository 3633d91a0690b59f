"""Serve the queue monitor ready for its first visit.

    python -m prefect_launch.dashboard.serve [streamlit options, e.g. --server.port 8501]

Before the server takes visits this process imports what the page needs (Prefect, pandas,
Altair) and reads the default view (:func:`.page_data.prepare`); while it serves, the views
visited in the last minutes are read ahead of the page's clock (:func:`.page_data.keep_ready`).
``streamlit run dashboard/app.py`` still works: each visit then reads what it shows itself.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from prefect_launch.compat.streamlit import BIND_SOCKET
from prefect_launch.dashboard import asset_cache, streamlit_hook

APP = Path(__file__).resolve().parent / "app.py"
DEFAULTS = ["--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
            # a full gc.collect() after every script run: ~0.15 s here with 100k runs' frames in memory, holding the
            # GIL just as the browser asks for the page's widget scripts (Python's own collector still runs)
            "--runner.postScriptGC", "false",
            # the page writes nothing by bare expression; with magic on, each visit that finds no other session
            # connected (Streamlit then drops its compiled script) rewrites app.py's syntax tree again (~30 ms)
            "--runner.magicEnabled", "false"]


def _preload_imports() -> None:
    """What the first visit would otherwise pay while the person waits (~4 s here): importing
    the page's modules, Altair and Vega-Lite's schema (for the sections drawn on demand), and
    ``inspect``'s module table, which Streamlit walks once (``inspect.stack()``) on the first
    element a script draws."""
    import inspect

    import altair as alt
    import pandas as pd

    from prefect_launch.dashboard import chart_data, charts, timeline  # noqa: F401  (the page's chart builders)

    alt.Chart(pd.DataFrame({"x": [1]})).mark_point().encode(x="x:Q").to_dict()
    inspect.stack()


def _accept_with_nodelay() -> bool:
    """Have the connections Streamlit accepts send each write at once (TCP_NODELAY), as Tornado's did.

    Streamlit's Starlette server binds its listening socket as ``socket.socket(family)``, so the socket
    object's protocol reads 0 and asyncio, which sets TCP_NODELAY only where it reads IPPROTO_TCP, leaves
    Nagle on for every accepted connection. On a kept-alive connection a response's body (a second write)
    then waits for the browser's delayed ACK of its headers: 40 ms per request on Linux, for each of the
    ~150 scripts a new visit fetches over six connections (about 0.6 s of its wait here). Re-wrapping the
    bound socket lets Python read its real protocol from the kernel; accepted sockets inherit it. Returns
    whether the bind was wrapped (False where this Streamlit binds some other way: nothing changes)."""

    def around(bind: Callable[..., socket.socket]) -> Callable[..., socket.socket]:
        def _bind_socket(*args, **kwargs) -> socket.socket:
            sock = bind(*args, **kwargs)
            if sock.type == socket.SOCK_STREAM and sock.proto != socket.IPPROTO_TCP:
                blocking = sock.getblocking()
                sock = socket.socket(fileno=sock.detach())  # family, type and protocol read from the kernel
                sock.setblocking(blocking)
            return sock

        return _bind_socket

    return streamlit_hook.wrap(asset_cache.SERVER, BIND_SOCKET, "nodelay", around)


def streamlit_args(argv: list[str]) -> list[str]:
    """``argv`` with each of :data:`DEFAULTS` the caller did not give (as ``--opt value`` or ``--opt=value``)."""
    args = list(argv)
    given = {a.split("=")[0] for a in args if a.startswith("--")}
    for k in range(0, len(DEFAULTS), 2):  # loopback and no telemetry unless asked otherwise
        if DEFAULTS[k] not in given:
            args += DEFAULTS[k:k + 2]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = streamlit_args(sys.argv[1:] if argv is None else argv)
    t = time.perf_counter()
    print("queue monitor: preparing the default view (Prefect's API, the run index)…", flush=True)
    from prefect_launch.dashboard import page_data as P

    _preload_imports()
    try:
        P.prepare()
        print(f"queue monitor: ready in {time.perf_counter() - t:.1f} s", flush=True)
    except Exception as exc:  # the page itself says what is wrong on each visit
        print(f"queue monitor: could not read the default view ({type(exc).__name__}: {exc}); "
              "the page will try again on each visit", flush=True)
    P.keep_ready()
    _accept_with_nodelay()
    asset_cache.install()  # Streamlit's hashed scripts from memory: ~0.3 s of this process's CPU a new visitor
    from streamlit.web import cli as stcli

    sys.argv = ["streamlit", "run", str(APP), *args]
    return stcli.main()


if __name__ == "__main__":
    sys.exit(main())
