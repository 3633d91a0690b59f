"""What the monitor's hour x weekday heatmap costs the browser: our table (its own component) against Streamlit's stock
way (an Altair/Vega chart, SVG, as the page drew it before), and a page without it.

    .venv/bin/python bench/heatmap_draw.py [--visits 12]

One Streamlit app draws a title, the heatmap of a synthetic full week (168 cells) one of three ways
(``?v=table|vega|none``) and a closing marker. Visits alternate between the three in a shuffled order,
each in a new tab of one headless Chromium profile (a returning visitor: Streamlit's scripts cached), the
first round left out. Per visit: wall seconds from navigation until every cell is drawn, and the CPU
time of the renderer's main thread (the trace's thread durations of its top-level tasks), which a busy
machine inflates far less than wall time. Prints medians and ratios; the last line is one JSON object:
table_cpu_s, vega_cpu_s, none_cpu_s, table_wall_s, vega_wall_s, none_wall_s, table_own_cpu_s and vega_own_cpu_s
(each visit less the page without a heatmap in its round, median), noise_cpu_s (the spread of that page's CPU),
cpu_ratio (vega's own / table's own, the table's taken as at least the noise; cpu_ratio_is_lower_bound then true),
visits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prefect_launch.local_server import CHROMIUM, CHROMIUM_ARGS, CHROMIUM_MISSING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stack import streamlit_app  # noqa: E402
APP = '''
import altair as alt
import numpy as np
import pandas as pd
import streamlit as st

from prefect_launch.dashboard import heatmap_table as HT

st.set_page_config(page_title="heatmap", layout="wide")
st.title("heatmap")
rng = np.random.default_rng(1)
hm = pd.DataFrame([dict(weekday=d, hour=h, busy=float(rng.uniform(0, 40)), gpus=float(rng.uniform(0, 16)), hours=1)
                   for d in HT.DAYS for h in range(24)])
v = st.query_params.get("v", "table")
if v == "vega":  # the chart the page drew before (an SVG cell per hour, each with its description)
    st.altair_chart(alt.Chart(hm).mark_rect().encode(
        x=alt.X("hour:O", title="hour of day (UTC)"), y=alt.Y("weekday:O", sort=list(HT.DAYS), title=None),
        color=alt.Color("busy:Q", title="avg runs holding a slot", scale=alt.Scale(scheme="blues")),
        tooltip=["weekday:O", "hour:O", alt.Tooltip("busy:Q", title="avg runs holding a slot", format=".2f"),
                 alt.Tooltip("gpus:Q", title="avg GPUs held", format=".2f"), alt.Tooltip("hours:Q", title="hours averaged")])
        .properties(height=200, usermeta={"embedOptions": {"renderer": "svg"}}), width="stretch")
elif v == "table":
    HT.draw(HT.payload(hm), key="heatmap")
with st.container(key="done"):
    st.write("done")
'''
DRAWN = {"table": "() => document.querySelectorAll('td.lh-cell').length >= 168 && !!document.querySelector('.st-key-done')",
         "vega": "() => document.querySelectorAll('.vega-embed svg path[aria-label]').length >= 168 && !!document.querySelector('.st-key-done')",
         "none": "() => !!document.querySelector('.st-key-done')"}


def renderer_cpu_s(trace: bytes) -> float:
    """CPU seconds of the renderer main threads' top-level tasks in a Chromium trace."""
    events = json.loads(trace)["traceEvents"]
    mains = {(e["pid"], e["tid"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["args"].get("name") == "CrRendererMain"}
    return sum(e.get("tdur", 0) for e in events if e.get("ph") == "X" and e.get("name") == "ThreadControllerImpl::RunTask"
               and (e["pid"], e["tid"]) in mains) / 1e6


def traced_visit(browser, page, url: str, drawn_js: str, timeout_s: float = 60) -> tuple[float, float]:
    """(wall s, renderer main-thread CPU s) of navigating ``page`` to ``url`` until ``drawn_js`` holds."""
    browser.start_tracing(page=page, categories=["toplevel", "devtools.timeline"])
    t = time.perf_counter()
    page.goto(url, wait_until="commit")
    page.wait_for_function(drawn_js, timeout=timeout_s * 1000, polling=50)
    took = time.perf_counter() - t
    return took, renderer_cpu_s(browser.stop_tracing())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--visits", type=int, default=12, help="visits of each kind counted (after one left out)")
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        sys.exit(CHROMIUM_MISSING)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="bench-heatmap-") as tmp:
        app = Path(tmp) / "heatmap_app.py"
        app.write_text(APP)
        cpu: dict[str, list[float]] = {k: [] for k in DRAWN}
        wall: dict[str, list[float]] = {k: [] for k in DRAWN}
        with streamlit_app(["streamlit", "run", str(app)], Path(tmp) / "streamlit.log") as url:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                try:
                    ctx = browser.new_context(viewport={"width": 1600, "height": 1200})
                    for r in range(args.visits + 1):
                        order = list(DRAWN)
                        random.shuffle(order)
                        for v in order:
                            page = ctx.new_page()
                            took, spent = traced_visit(browser, page, f"{url}/?v={v}", DRAWN[v])
                            page.close()
                            if r:  # the first round fills the profile's caches
                                cpu[v].append(spent)
                                wall[v].append(took)
                        print(f"round {r}/{args.visits}", end="\r", file=sys.stderr, flush=True)
                finally:
                    browser.close()
    med = {k: statistics.median(v) for k, v in cpu.items()}
    medw = {k: statistics.median(v) for k, v in wall.items()}
    for k in DRAWN:
        print(f"{k:5s}  renderer CPU median {med[k]:.3f} s   drawn in median {medw[k]:.3f} s   ({len(cpu[k])} visits)")
    # each kind's own cost: the median of its visits' differences from the page without a heatmap in the same
    # round (paired, so a round the box ran slow cancels); the noise is how much the bare page's CPU spreads
    own = {k: statistics.median(a - b for a, b in zip(cpu[k], cpu["none"])) for k in ("table", "vega")}
    noise = statistics.median(abs(x - med["none"]) for x in cpu["none"])
    within = own["table"] <= noise
    ratio = own["vega"] / max(own["table"], noise) if noise > 0 or own["table"] > 0 else None
    print(f"the heatmap's own renderer CPU (paired with the bare page): table {own['table']:.3f} s, vega {own['vega']:.3f} s;"
          f" the bare page's CPU spreads by {noise:.3f} s (median absolute deviation)")
    if ratio:
        print(f"vega / table: {'at least ' if within else ''}{ratio:.1f}x"
              + (" (the table's own cost is within that spread, so the spread is its bound)" if within else ""))
    print(json.dumps(dict(table_cpu_s=round(med["table"], 3), vega_cpu_s=round(med["vega"], 3), none_cpu_s=round(med["none"], 3),
                          table_wall_s=round(medw["table"], 3), vega_wall_s=round(medw["vega"], 3),
                          none_wall_s=round(medw["none"], 3), table_own_cpu_s=round(own["table"], 3),
                          vega_own_cpu_s=round(own["vega"], 3), noise_cpu_s=round(noise, 3),
                          cpu_ratio=round(ratio, 1) if ratio else None, cpu_ratio_is_lower_bound=within,
                          visits=args.visits)))

if __name__ == "__main__":
    main()
