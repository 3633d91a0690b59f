"""What each kind of Streamlit control costs a new visit of the monitor's page, on this machine: the floor
under the warm page figure of ``bench/dashboard.py`` (page_warm_s), measured one control at a time.

    .venv/bin/python bench/page_controls.py [--visits 10]

One Streamlit app draws a title, one empty panel (as ``bench/dashboard.py``'s floor) and, by ``?v=``, nothing
more (``bare``) or one kind of control: a multiselect, a selectbox, a radio, pills, a segmented control, an
expander (number input and button; the monitor's sidebar had one until it drew its single choices as
pills), the section switch and links toggle, the monitor's real sidebar
(``dashboard/sidebar.py``) with 8 synthetic choices per list (drawn as pills) or 20 (``sidebar_long``: as
multiselects), or all the page's controls (the 8-choice sidebar and the switches). Each visit is a new browser profile (nothing cached: as page_warm_s), the variants in a shuffled
order per round, the first round left out; a visit ends when the panel and every control the variant holds
are drawn and Streamlit says it is done. Stock Streamlit is the thing measured here, so there is no stock
path to compare with: the bare page is the baseline. Each control's own cost is the median over rounds of
its visit less the bare visit of the same round. The last line is one JSON object: ``<variant>_s`` (median
seconds), ``<variant>_own_s`` (median own cost), bare_spread_s (the bare page's interquartile range) and
visits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from prefect_launch.local_server import CHROMIUM, CHROMIUM_ARGS, CHROMIUM_MISSING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stack import percentile, streamlit_app, visit  # noqa: E402

APP = '''
import streamlit as st

from prefect_launch.dashboard.sidebar import sidebar

st.set_page_config(page_title="controls", layout="wide")
st.set_option("client.toolbarMode", "minimal")
st.title("Queue monitor")
v = st.query_params.get("v", "bare")
CHOICES = [f"choice-{i}" for i in range(8)]
if v == "multiselect":
    st.sidebar.multiselect("Queues", CHOICES, key="q", placeholder="all queues")
elif v == "selectbox":
    st.sidebar.selectbox("Grouping", CHOICES, key="g")
elif v == "radio":
    st.sidebar.radio("Time range", ["Last hour", "Last 24 hours", "Last 7 days", "Custom"], index=1, key="r")
elif v == "pills":
    st.sidebar.pills("Queues", CHOICES, selection_mode="multi", key="p")
elif v == "segmented":
    st.sidebar.segmented_control("Time range", ["Last hour", "Last 24 hours", "Last 7 days", "Custom"], default="Last 7 days",
                                 required=True, key="s")
elif v == "expander":
    with st.sidebar.expander("Advanced"):
        st.number_input("Runs shown per run panel (newest)", 100, 10000, 1000, step=100, key="n")
        st.button("Refresh now", key="b")
if v in ("sidebar", "all"):
    sidebar({k: CHOICES for k in ("queues", "jobs", "owners", "presets")}, lambda: None)
if v == "sidebar_long":  # more choices than pills are drawn for: multiselects (dashboard/choices.pick)
    sidebar({k: [f"choice-{i}" for i in range(20)] for k in ("queues", "jobs", "owners", "presets")}, lambda: None)
if v in ("switches", "all"):
    st.segmented_control("Section", ["Job runs", "Resource use", "Cost and waste", "Errors"], default="Job runs",
                         required=True, key="section", label_visibility="collapsed")
with st.container(key="panel-links", border=True):
    st.subheader("External Links")
    if v in ("switches", "all"):
        st.toggle("Manage Links", key="links_open")
'''
BASE = ("!!document.querySelector('.st-key-panel-links')"
        " && !document.querySelector('[data-testid=\"stStatusWidget\"]')")


def _has(testid: str, n: int = 1) -> str:
    return f" && document.querySelectorAll('[data-testid=\"{testid}\"]').length >= {n}"


SWITCHES = _has("stButtonGroup") + _has("stCheckbox")
CHOICES_DRAWN = " && document.querySelectorAll('.ch-box[data-drawn] .ch-group').length >= %d"  # dashboard/choices.py
SIDEBAR = CHOICES_DRAWN % 8 + _has("stButton")  # 8 choices each: five lists and three single choices as buttons
SIDEBAR_LONG = _has("stMultiSelect", 4) + CHOICES_DRAWN % 4 + _has("stButton")  # 20 each: four multiselects
DRAWN = {v: f"() => {BASE}{extra}" for v, extra in (
    ("bare", ""), ("multiselect", _has("stMultiSelect")), ("selectbox", _has("stSelectbox")), ("radio", _has("stRadio")),
    ("pills", _has("stButtonGroup")), ("segmented", _has("stButtonGroup")), ("expander", _has("stExpander")),
    ("switches", SWITCHES), ("sidebar", SIDEBAR), ("sidebar_long", SIDEBAR_LONG), ("all", SIDEBAR + SWITCHES))}
VIEWPORT = {"width": 1600, "height": 1200}


def iqr(xs: list[float]) -> float:
    return percentile(xs, 0.75) - percentile(xs, 0.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--visits", type=int, default=10, help="rounds timed per variant (after one left out)")
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        sys.exit(CHROMIUM_MISSING)
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="page-controls-"))
    app = work / "controls_app.py"
    app.write_text(APP)
    times: dict[str, list[float]] = {v: [] for v in DRAWN}
    rng = random.Random(3)
    with streamlit_app(["streamlit", "run", str(app)], work / "streamlit.log") as url:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                for r in range(args.visits + 1):
                    order = list(DRAWN)
                    rng.shuffle(order)
                    for v in order:
                        s = visit(browser, f"{url}/?v={v}", DRAWN[v], VIEWPORT, 120)
                        if r:
                            times[v].append(s)
                    print(f"round {r}{' (left out)' if not r else ''}: "
                          + ", ".join(f"{v} {times[v][-1]:.2f}" for v in DRAWN if r), flush=True)
            finally:
                browser.close()
    out: dict = {"visits": args.visits, "bare_spread_s": round(iqr(times["bare"]), 3)}
    print(f"\nnew-profile visits, median of {args.visits} (own: less the bare page of the same round)")
    for v, xs in times.items():
        med = statistics.median(xs)
        own = statistics.median(x - b for x, b in zip(xs, times["bare"]))
        out[f"{v}_s"] = round(med, 3)
        if v != "bare":
            out[f"{v}_own_s"] = round(own, 3)
        print(f"  {v:<12} {med:.3f} s" + (f"   own {own:+.3f} s" if v != "bare" else
                                           f"   (interquartile range {out['bare_spread_s']:.3f} s)"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
