"""Where the monitor's first page spends the browser's time: the page as served, the same page with its
charts or its tables (or both) drawn as empty placeholders, its headings and captions drawn as Streamlit's
markdown elements, and Streamlit's floor.

    .venv/bin/python bench/page_parts.py --home DIR [--visits 6] [--variants page,markdown-text] [--profiles new]

DIR is a PREFECT_HOME kept by ``bench/dashboard.py --keep`` (its runs, metrics and run index; at 100k
runs: ``bench/dashboard.py --runs 100000 --keep``). One monitor is started as ``make dashboard`` starts it
(``prefect_launch.dashboard.serve``: the default view read before it takes visits), on a wrapper script that
runs ``dashboard/app.py`` unchanged, except that for ``?v=no-charts`` every chart (``timeline.chart``,
``st.altair_chart``) and for
``?v=no-tables`` every ``st.dataframe`` draws an empty placeholder (``neither``: both; the first page's tables
are its own component now, so ``no-tables`` is the page); for ``?v=markdown-text`` every text block
(``dashboard/text_block.py``: a heading and captions as plain text in one element) is drawn as the page drew
it before, a ``st.title``/``st.header``/``st.subheader`` and a ``st.caption`` per line; ``floor`` is the
title and one empty panel (bench/dashboard.py's floor). The data the page reads, its layout and every
other element are the same in all of them, so a difference is what the browser spends on those elements.

Visits alternate between the variants in a shuffled order, the first round left out, in two kinds of
profile: ``new`` (a new browser profile per visit: Streamlit's scripts fetched and compiled again, as
bench/dashboard.py's page_warm_s) and ``same`` (one profile: a returning visitor, as page_return_s). Per
visit: wall seconds from navigation until the page is drawn (bench/dashboard.py's check; without charts,
no chart is waited for), and the CPU seconds of the renderer's main thread from a Chromium trace (see
bench/heatmap_draw.py), which a busy machine inflates far less than wall time. Prints medians and what the
charts and the tables cost (the page less the page without them) and, per variant, its own cost: the median
over rounds of (the variant less the page in the same round and profile), so a round the box ran slow cancels.
The last line is one JSON object: <profile>_<variant>_wall_s and <profile>_<variant>_cpu_s for each,
<profile>_<variant>_own_wall_s and <profile>_<variant>_own_cpu_s (paired with the page), <profile>_charts_cpu_s and
<profile>_tables_cpu_s (when those variants ran), visits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dashboard as B  # bench/dashboard.py: the drawn check, the floor page, the viewport
from heatmap_draw import traced_visit

from prefect_launch.local_server import (CHROMIUM, CHROMIUM_ARGS, CHROMIUM_MISSING, background_process, free_port,
                                         local_prefect_server, wait_healthy)

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = '''import runpy
import streamlit as st

v = st.query_params.get("v", "page")
if v == "floor":
    exec({floor!r})
    st.stop()
from prefect_launch.dashboard import text_block, timeline
from prefect_launch.dashboard.caption_text import as_written


def as_markdown(key, heading=None, lines=(), level=3, where=None):
    """A text block drawn as the page drew it before dashboard/text_block.py: Streamlit's markdown elements."""
    w = where if where is not None else st
    if heading:
        (w.title if level == 1 else w.header if level == 2 else w.subheader)(heading)
    for line in lines:
        w.caption(as_written(line))


saved = st.altair_chart, st.dataframe, timeline.chart, text_block.text
try:
    if v == "markdown-text":
        text_block.text = as_markdown
    if v in ("no-charts", "neither"):
        st.altair_chart = lambda *a, **k: (st.empty(), None)[1]
        timeline.chart = lambda *a, **k: (st.empty(), None)[1]  # the Gantt's brush: none
    if v in ("no-tables", "neither"):
        st.dataframe = lambda *a, **k: st.empty()
    runpy.run_path({app!r}, run_name="__main__")
finally:
    st.altair_chart, st.dataframe, timeline.chart, text_block.text = saved
'''
NO_CHARTS_JS = B.DRAWN_JS.replace(f">= {B.FIRST_PAGE_CHARTS}", ">= 0")
DRAWN = {"page": B.DRAWN_JS, "no-charts": NO_CHARTS_JS, "no-tables": B.DRAWN_JS, "neither": NO_CHARTS_JS,
         "floor": B.FLOOR_JS, "markdown-text": B.DRAWN_JS}
VISIT_TIMEOUT_S = 120
SERVE = ("import sys; from pathlib import Path; import prefect_launch.dashboard.serve as S; "
         "S.APP = Path(sys.argv[1]); sys.exit(S.main(sys.argv[2:]))")


def visit(browser, target, url: str, drawn_js: str) -> tuple[float, float]:
    """(wall s, renderer main-thread CPU s) of one visit of ``url`` in a new tab of ``target``."""
    page = target.new_page(viewport=B.VIEWPORT) if target is browser else target.new_page()
    try:
        try:
            return traced_visit(browser, page, url, drawn_js, VISIT_TIMEOUT_S)
        except Exception:
            shot = Path(tempfile.gettempdir()) / "page_parts_not_drawn.png"
            page.screenshot(path=str(shot), full_page=True)
            raise RuntimeError(f"{url} not drawn within {VISIT_TIMEOUT_S} s; see {shot}") from None
    finally:
        page.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", required=True, help="a PREFECT_HOME kept by bench/dashboard.py --keep")
    ap.add_argument("--visits", type=int, default=6, help="visits of each variant and profile counted (after one left out)")
    ap.add_argument("--variants", default=",".join(DRAWN), help=f"which of {', '.join(DRAWN)} (page always)")
    ap.add_argument("--profiles", default="new,same", help="new (a new profile per visit), same (a returning visitor)")
    args = ap.parse_args()
    variants = ["page", *(v for v in args.variants.split(",") if v != "page")]
    profiles = args.profiles.split(",")
    if not set(variants) <= set(DRAWN) or not set(profiles) <= {"new", "same"}:
        sys.exit(f"variants are among {', '.join(DRAWN)}; profiles among new, same")
    if not Path(CHROMIUM).exists():
        sys.exit(CHROMIUM_MISSING)
    from playwright.sync_api import sync_playwright

    home = Path(args.home)
    if not (home / "bench-now.txt").exists():
        sys.exit(f"{home} is not a home kept by bench/dashboard.py --keep")
    print(f"bench/page_parts.py: {home}, load average {B.loadavg()} ({os.cpu_count()} CPUs)", flush=True)
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-page-parts-") as tmp, local_prefect_server(home) as api_url:
        # the run index built first, as bench/dashboard.py does: every variant is drawn from it
        from prefect_launch.dashboard import data, index_sync

        t = time.perf_counter()
        built = index_sync.build(index_sync.RunIndex(data.metrics_store()), data.get_api(api_url), days=8)
        print(f"run index built in {time.perf_counter() - t:.1f} s ({built.runs_read} runs read)", flush=True)
        wrapper = Path(tmp) / "page_parts_app.py"
        wrapper.write_text(WRAPPER.format(floor=B.FLOOR_APP, app=str(ROOT / "dashboard" / "app.py")))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-c", SERVE, str(wrapper), "--server.port", str(port), "--server.address", "127.0.0.1",
               "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]
        log = Path(tmp) / "streamlit.log"
        with background_process(cmd, log, cwd=ROOT) as proc:
            wait_healthy(url, proc, timeout=600, log=log, health_path="/_stcore/health", what="streamlit")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                try:
                    same = browser.new_context(viewport=B.VIEWPORT)
                    for r in range(args.visits + 1):
                        order = [(p, v) for p in profiles for v in variants]
                        random.shuffle(order)
                        for profile, v in order:
                            took, spent = visit(browser, browser if profile == "new" else same, f"{url}/?v={v}", DRAWN[v])
                            if r:  # the first round fills the caches (and the monitor's)
                                wall.setdefault(f"{profile}_{v}", []).append(took)
                                cpu.setdefault(f"{profile}_{v}", []).append(spent)
                        print(f"round {r}/{args.visits}", end="\r", file=sys.stderr, flush=True)
                finally:
                    browser.close()
    out: dict = {}
    for profile in profiles:
        print(f"{'a new profile per visit' if profile == 'new' else 'one profile (a returning visitor)'}:")
        base = f"{profile}_page"
        for v in variants:
            k = f"{profile}_{v}"
            name = k.replace("-", "_")
            w, c = statistics.median(wall[k]), statistics.median(cpu[k])
            out[f"{name}_wall_s"], out[f"{name}_cpu_s"] = round(w, 3), round(c, 3)
            own = ""
            if v != "page":  # paired by round: each visit less the page's visit of the same round
                ow = statistics.median(a - b for a, b in zip(wall[k], wall[base]))
                oc = statistics.median(a - b for a, b in zip(cpu[k], cpu[base]))
                out[f"{name}_own_wall_s"], out[f"{name}_own_cpu_s"] = round(ow, 3), round(oc, 3)
                own = f"   less the page, paired: wall {ow:+.3f} s, CPU {oc:+.3f} s"
            print(f"  {v:13s} drawn in median {w:.3f} s   renderer CPU median {c:.3f} s   ({len(wall[k])} visits){own}")
        if not {"no-charts", "no-tables", "neither", "floor"} <= set(variants):
            continue
        charts = out[f"{profile}_page_cpu_s"] - out[f"{profile}_no_charts_cpu_s"]
        tables = out[f"{profile}_page_cpu_s"] - out[f"{profile}_no_tables_cpu_s"]
        out[f"{profile}_charts_cpu_s"], out[f"{profile}_tables_cpu_s"] = round(charts, 3), round(tables, 3)
        print(f"  the charts' renderer CPU {charts:.3f} s, the tables' {tables:.3f} s, the rest of the page "
              f"{out[f'{profile}_neither_cpu_s'] - out[f'{profile}_floor_cpu_s']:.3f} s above the floor's "
              f"{out[f'{profile}_floor_cpu_s']:.3f} s")
    out["visits"] = args.visits
    print(json.dumps(out))


if __name__ == "__main__":
    main()
