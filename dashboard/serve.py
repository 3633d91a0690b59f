"""Serve the queue monitor ready for its first visit.

    python -m prefect_launch.dashboard.serve [streamlit options, e.g. --server.port 8501]

Before the server takes visits this process imports what the page needs (Prefect, pandas,
Altair) and reads the default view (:func:`.page_data.prepare`); while it serves, the views
visited in the last minutes are read ahead of the page's clock (:func:`.page_data.keep_warm`).
``streamlit run dashboard/app.py`` still works: each visit then reads what it shows itself.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

APP = Path(__file__).resolve().parent / "app.py"
DEFAULTS = ["--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"]


def _warm_imports() -> None:
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


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=")[0] for a in args if a.startswith("--")}
    for k in range(0, len(DEFAULTS), 2):  # loopback and no telemetry unless asked otherwise
        if DEFAULTS[k] not in given:
            args += DEFAULTS[k:k + 2]
    t = time.perf_counter()
    print("queue monitor: preparing the default view (Prefect's API, the run index)…", flush=True)
    from prefect_launch.dashboard import page_data as P

    _warm_imports()
    try:
        P.prepare()
        print(f"queue monitor: ready in {time.perf_counter() - t:.1f} s", flush=True)
    except Exception as exc:  # the page itself says what is wrong on each visit
        print(f"queue monitor: could not read the default view ({type(exc).__name__}: {exc}); "
              "the page will try again on each visit", flush=True)
    P.keep_warm()
    from streamlit.web import cli as stcli

    sys.argv = ["streamlit", "run", str(APP), *args]
    return stcli.main()


if __name__ == "__main__":
    sys.exit(main())
