"""The monitor's sidebar as it is against the sidebar of an earlier commit, drawn alone, in a new browser profile
per visit: what a change of its controls costs or saves a new visitor, with the bare Streamlit page as the floor.

    .venv/bin/python bench/sidebar_ab.py --old-rev e9e738f [--rounds 10]

Three Streamlit apps run side by side: ``bare`` (a title and one empty panel, as ``bench/dashboard.py``'s floor),
``old`` (the sidebar of ``--old-rev``, read with ``git show`` into a folder of its own) and ``new`` (this
tree's ``dashboard/sidebar.py``), each with the section switch and links toggle and the same choices (3 queues,
6 jobs, 7 owners, 4 presets: bench/dashboard.py's seed). Each round visits each app in a shuffled order, once in
a new profile and once in a profile kept per app (a returning visitor); the first round is left out. A visit ends
when the panel, the section switch and every sidebar choice are drawn and Streamlit says it is done. The last
line is one JSON object: ``<app>_s`` and ``<app>_return_s`` (medians), ``saved_s`` (old less new, new profiles,
median of the rounds' differences) and rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from prefect_launch.local_server import CHROMIUM, CHROMIUM_ARGS, CHROMIUM_MISSING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stack import ROOT, streamlit_app, visit  # noqa: E402

CHOICES = {"queues": ["cpu-batch", "gpu-a100", "k8s-gpu"],
           "jobs": ["evaluate", "notebook", "preprocess", "sweep-hparams", "train-llm", "train-vision"],
           "owners": ["alice", "bob", "carol", "dave", "erin", "frank", "grace"], "presets": ["gpu-1", "gpu-2", "medium", "small"]}
APP = '''import sys
import streamlit as st
sys.path.insert(0, {folder!r})
from sidebar import sidebar
st.set_page_config(page_title="sidebar", layout="wide")
st.set_option("client.toolbarMode", "minimal")
st.title("Queue monitor")
sidebar({choices!r}, lambda: None)
st.segmented_control("Section", ["Job runs", "Resource use", "Cost and waste", "Errors"], default="Job runs",
                     required=True, key="section", label_visibility="collapsed")
with st.container(key="panel-links", border=True):
    st.subheader("External Links")
    st.toggle("Manage Links", key="links_open")
'''
BARE = '''import streamlit as st
st.set_page_config(page_title="sidebar", layout="wide")
st.title("Queue monitor")
with st.container(key="panel-links", border=True):
    st.subheader("External Links")
'''
BASE = "!!document.querySelector('.st-key-panel-links') && !document.querySelector('[data-testid=\"stStatusWidget\"]')"
# every choice drawn, whatever its kind (a Streamlit control, or buttons of dashboard/choices.py; the last, Refresh
# now, sits in an older sidebar's collapsed expander)
KEYS = ["queues", "range", "grouping", "f_jobs", "f_owners", "f_statuses", "f_presets", "detail_limit"]
SIDEBAR = (" && !!document.querySelector('.st-key-section [data-testid=\"stButtonGroup\"]') && " + " && ".join(
    f"!!document.querySelector('[data-testid=\"stSidebarContent\"] .st-key-{k} [data-testid], "
    f"[data-testid=\"stSidebarContent\"] .ch-box[data-drawn] .ch-group[data-key=\"{k}\"]')" for k in KEYS)
    + " && !!document.querySelector('[data-testid=\"stSidebarContent\"] .st-key-refresh button')")
VIEWPORT = {"width": 1600, "height": 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-rev", required=True, help="the commit whose dashboard/sidebar.py is the old sidebar")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        sys.exit(CHROMIUM_MISSING)
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="sidebar-ab-"))
    old = work / "old"
    old.mkdir()
    (old / "sidebar.py").write_text(subprocess.run(["git", "show", f"{args.old_rev}:dashboard/sidebar.py"], cwd=ROOT,
                                                   check=True, capture_output=True, text=True).stdout)
    new = ROOT / "dashboard"
    apps = {"bare": BARE, "old": APP.format(folder=str(old), choices=CHOICES),
            "new": APP.format(folder=str(new), choices=CHOICES)}
    drawn = {k: "() => " + BASE + ("" if k == "bare" else SIDEBAR) for k in apps}
    fresh: dict[str, list[float]] = {k: [] for k in apps}
    back: dict[str, list[float]] = {k: [] for k in apps}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, text in apps.items():
            (work / f"{name}_app.py").write_text(text)
            urls[name] = stack.enter_context(streamlit_app(["streamlit", "run", str(work / f"{name}_app.py")],
                                                           work / f"{name}.log"))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            kept = {k: browser.new_context(viewport=VIEWPORT) for k in apps}
            for r in range(args.rounds + 1):
                order = list(apps)
                random.shuffle(order)
                got = {k: (visit(browser, urls[k], drawn[k], VIEWPORT, 120), visit(kept[k], urls[k], drawn[k], VIEWPORT, 120))
                       for k in order}
                if r:  # the first round fills the kept profiles' caches and warms the servers
                    for k, (a, b) in got.items():
                        fresh[k].append(a)
                        back[k].append(b)
                    print(f"round {r}: " + ", ".join(f"{k} {got[k][0]:.2f}/{got[k][1]:.2f}" for k in apps), flush=True)
            browser.close()
    med = {k: round(statistics.median(v), 3) for k, v in fresh.items()}
    med_back = {k: round(statistics.median(v), 3) for k, v in back.items()}
    saved = round(statistics.median(a - b for a, b in zip(fresh["old"], fresh["new"])), 3)
    for k in apps:
        print(f"{k:5s} new profile median {med[k]:.3f} s, returning visit median {med_back[k]:.3f} s")
    print(f"old sidebar ({args.old_rev}) less new, paired by round: {saved:+.3f} s")
    print(json.dumps({**{f"{k}_s": v for k, v in med.items()}, **{f"{k}_return_s": v for k, v in med_back.items()},
                      "saved_s": saved, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
