"""The running dashboard in a real browser: headless Chromium (Debian package) via Playwright.

Starts `streamlit run dashboard/app.py` on a free loopback port against the test's Prefect
server with seeded runs and metrics, checks that every panel rendered with data, and saves
a full-page screenshot to test-output/dashboard.png.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from fixtures_dashboard import seed_runs

from prefect_launch.local_server import CHROMIUM, CHROMIUM_MISSING, background_process, free_port, wait_healthy
from prefect_launch.local_server import CHROMIUM_ARGS as ARGS

ROOT = Path(__file__).resolve().parents[1]
CHART_PANELS = ["panel-status", "panel-queued", "panel-runs", "panel-gpu_util_pct", "panel-cpu_pct",
                "panel-gpu_mem_gib", "panel-rss_gib"]
TABLE_PANELS = ["panel-summary", "panel-runs", "panel-waste", "panel-errors"]
# the panels below job status and queued time are drawn one section at a time (job runs first)
SECTION_OF = {"panel-runs": "Job runs", "panel-gpu_util_pct": "Resource use", "panel-cpu_pct": "Resource use",
              "panel-gpu_mem_gib": "Resource use", "panel-rss_gib": "Resource use", "panel-waste": "Resource use",
              "panel-cost": "Cost and waste", "panel-errors": "Errors"}
TIME_CHART = ".lt-chart[data-drawn] canvas"  # the first page's time charts (dashboard/timeline.py), once drawn
TABLES = '[data-testid="stDataFrame"]'  # every table: Streamlit's grid (dashboard/widgets.py)
IDLE_JS = "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"


CHOICE = '.st-key-%s [data-testid="stButtonGroup"]'  # a choice drawn as pills or a segmented control (dashboard/widgets.py)
PRESSED = '[aria-checked="true"], [aria-pressed="true"]'  # a chosen segment (a radio) or pill (a toggle button)


def choice(page, key: str):
    """The buttons of the choice ``key`` (pills or a segmented control)."""
    return page.locator(CHOICE % key)


def option(page, key: str, name: str):
    """The option ``name`` of the choice ``key``: a radio of a segmented control, or a pill."""
    group = choice(page, key)
    return group.get_by_role("radio", name=name, exact=True).or_(group.get_by_role("button", name=name, exact=True))


def choose_queue(page, queue: str) -> None:
    """Choose ``queue`` alone in the sidebar: a button while the server holds few queues, else typed into the
    multiselect (dashboard/widgets.pick); the shared server holds as many as the tests made."""
    box = page.locator(".st-key-queues")
    page.locator(f'{CHOICE % "queues"}, .st-key-queues [data-testid="stMultiSelect"]').first.wait_for(timeout=60_000)
    if choice(page, "queues").count():
        option(page, "queues", queue).click()
        return
    box.click()
    page.keyboard.type(queue)
    page.keyboard.press("Enter")
    page.keyboard.press("Escape")


def _show_section(page, key: str) -> None:
    """Choose the section that holds panel ``key`` (if it is in one) and wait until it is drawn."""
    if key not in SECTION_OF or page.locator(f".st-key-{key}").count():
        return
    option(page, "section", SECTION_OF[key]).click()
    page.locator(f".st-key-{key}").wait_for(timeout=60_000)
    page.wait_for_function(IDLE_JS, timeout=60_000)
    page.wait_for_function("""() => [...document.querySelectorAll('.vega-embed')].every(e => e.querySelector('canvas, svg'))""",
                           timeout=60_000)

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=CHROMIUM_MISSING)


@pytest.fixture(scope="module")
def dashboard(prefect_server, tmp_path_factory):
    seeded = seed_runs(uuid.uuid4().hex[:6])
    from prefect_launch.blocks.queue_links import QueueLinks

    blk = QueueLinks(queue=seeded.pool)
    blk.upsert("Grafana GPU board", "https://grafana.example.com/d/gpu")
    blk.store()
    # the run index built beforehand (in the store the page will use), so the page serves its
    # run panels from it at once rather than from the API while it builds in the background
    from prefect_launch.dashboard import index_sync as X
    from prefect_launch.dashboard.api import get_api
    from prefect_launch.dashboard.metrics_source import metrics_store

    X.build(X.RunIndex(metrics_store()), get_api(), days=8)  # the page shows the last 7 days
    port = free_port()
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    # as `make dashboard` starts it: the default view read before it takes visits, kept ready after
    args = [sys.executable, "-m", "prefect_launch.dashboard.serve", "--server.port", str(port),
            "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none"]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    with background_process(args, log, env=env, cwd=ROOT) as proc:
        wait_healthy(url, proc, timeout=90, log=log, health_path="/_stcore/health", what="streamlit")
        yield url, seeded


def test_every_panel_renders_with_data(dashboard):
    from playwright.sync_api import sync_playwright

    url, seeded = dashboard
    out = ROOT / "test-output"
    out.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            # tall enough that every panel is laid out (Streamlit scrolls its main block itself)
            page = browser.new_page(viewport={"width": 1600, "height": 7000})
            fetched: list[str] = []
            page.on("request", lambda r: fetched.append(r.url))
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector(".st-key-panel-links", timeout=120_000)
            # wait until the script finished (no "running" indicator) and charts drew
            try:
                page.wait_for_function(f"document.querySelectorAll('{TIME_CHART}').length >= 4", timeout=120_000)
            except Exception:
                page.screenshot(path=str(out / "dashboard-failed.png"), full_page=True)
                n = page.evaluate("document.querySelectorAll('.lt-chart').length")
                raise AssertionError(f"charts did not draw ({n} time charts); see test-output/dashboard-failed.png")
            errors = page.locator('[data-testid="stException"]')
            assert errors.count() == 0, errors.first.inner_text()
            assert page.locator(f".st-key-panel-summary {TIME_CHART}").count() == 1  # the load chart
            # the hour x weekday heatmap: an Altair chart (its figures: test_dashboard_app's heatmap test)
            page.locator(".st-key-panel-summary .vega-embed canvas, .st-key-panel-summary .vega-embed svg").first.wait_for(
                timeout=60_000)
            # the bars, steps and lanes are painted (one filled path per colour): each chart holds coloured
            # pixels (its axes, grid and labels are grey)
            painted = page.evaluate("""() => [...document.querySelectorAll('.lt-chart[data-drawn] canvas')].map((cv) => {
                const px = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
                let n = 0;
                for (let i = 0; i < px.length; i += 4)
                    if (Math.max(px[i], px[i + 1], px[i + 2]) - Math.min(px[i], px[i + 1], px[i + 2]) > 60) n++;
                return n; })""")
            assert len(painted) >= 4 and all(n >= 20 for n in painted), painted
            # what a visit need not fetch: Streamlit's emoji plugin (the caption's times looked like shortcodes;
            # dashboard/caption_text.plain escapes them)
            assert any("/static/js/" in u for u in fetched)
            assert not [u for u in fetched if "remark-emoji" in u]
            link = page.locator('.st-key-panel-links a[href="https://grafana.example.com/d/gpu"]')
            link.first.wait_for(timeout=60_000)  # drawn after the section above it: it streams in last
            assert link.count() == 1 and link.inner_text() == "Grafana GPU board"
            # the panel streams in element by element: its links can be on screen before the expander below them
            page.locator(".st-key-panel-links").get_by_text("Manage Links").first.wait_for(timeout=30_000)
            summary = page.locator(".st-key-panel-summary").inner_text()
            assert "Runs in range" in summary
            assert page.get_by_text("from the run index").count() >= 1
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            for key in CHART_PANELS:
                _show_section(page, key)
                panel = page.locator(f".st-key-{key}")
                assert panel.count() == 1, key
                try:  # a section's charts are embedded one after another once its script run ended
                    panel.locator(f".vega-embed canvas, .vega-embed svg, {TIME_CHART}").first.wait_for(timeout=30_000)
                except Exception:
                    raise AssertionError(f"{key}: no chart drawn within 30 s") from None
                assert panel.locator('[data-testid="stAlert"]').count() == 0 or key == "panel-runs", f"{key}: shows a no-data note"
            for key in TABLE_PANELS:
                _show_section(page, key)
                panel = page.locator(f".st-key-{key}")
                shown = panel.locator(TABLES)
                shown.first.wait_for(timeout=30_000)
                assert shown.count() >= 1, f"{key}: no table"
            _show_section(page, "panel-cost")
            assert page.locator(".st-key-panel-cost").count() == 1
            assert page.locator('[data-testid="stException"]').count() == 0
            page.screenshot(path=str(out / "dashboard-sections.png"), full_page=True)
        finally:
            browser.close()
    assert (out / "dashboard.png").stat().st_size > 10_000


def _link(row: dict) -> str:
    """A CSV row's run link (the column is headed by its label, or its name)."""
    return row.get("Prefect UI") or row["link"]


def _check_rows(rows: list[dict], runs: dict) -> int:
    """The runs table's CSV (what Streamlit's grid exports, as shown) for each row of a finished run: its start
    to the second (UTC), its duration (end - start) and queued seconds (start - expected start, never below
    0) to the second, from the run's own record in Prefect. Returns how many rows were checked."""
    import pandas as pd

    def num(row: dict, label: str, name: str) -> float:
        return float(str(row.get(label) or row[name]).replace(",", ""))

    checked = 0
    for row in rows:
        run = runs[_link(row).rsplit("/", 1)[-1]]
        if run.end_time is None or run.start_time is None:
            continue  # still going: its duration counts to the page's now
        start = pd.Timestamp(row["start"])
        start = start.tz_localize("UTC") if start.tzinfo is None else start.tz_convert("UTC")
        assert abs((start - pd.Timestamp(run.start_time)).total_seconds()) < 1, row
        assert abs(num(row, "duration s", "duration_s") - (run.end_time - run.start_time).total_seconds()) <= 0.5 + 1e-6, row
        queued = max(0.0, (run.start_time - run.expected_start_time).total_seconds())
        assert abs(num(row, "queued s", "queued_s") - queued) <= 0.5 + 1e-6, (row, queued)
        checked += 1
    assert rows
    return checked


def _flow_runs_started() -> list:
    """Every run on the server that started (what the page's Gantt can draw), from Prefect itself."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    out, offset = [], 0
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False)),
                                         limit=200, offset=offset)
            out += page
            if len(page) < 200:
                return out
            offset += 200


def test_gantt_brush_fills_the_details_table(dashboard):
    """Drag across the runs Gantt in the browser: the details table holds exactly the runs under the brush."""
    import csv
    import datetime as dt
    import io
    import re
    import time

    from playwright.sync_api import sync_playwright

    url, seeded = dashboard
    out = ROOT / "test-output"
    out.mkdir(exist_ok=True)
    caption_re = re.compile(r"Selected (\S+ \S+) – (\S+ \S+) UTC: (\d+) ")
    utc = dt.timezone.utc
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 7000}, accept_downloads=True)
            page.add_init_script("delete window.showSaveFilePicker")  # CSV download as a plain download
            page.goto(url, wait_until="domcontentloaded")
            panel = page.locator(".st-key-panel-runs")
            panel.locator(TIME_CHART).first.wait_for(timeout=120_000)
            box = panel.locator(TIME_CHART).first.bounding_box()
            y = box["y"] + box["height"] * 0.45
            proper, last_caption, texts = 0, None, 0
            # the axis ends at now: while a seeded run is still going, the finished ones crowd into its left
            # edge the longer the module has run (11 finished runs in its first 6% after ~30 s), so the last
            # brush spans nearly all of it and takes some of them in
            for a, b in ((0.55, 0.8), (0.25, 0.6), (0.4, 0.97), (0.005, 0.95)):
                page.mouse.click(box["x"] + box["width"] * 0.99, y)  # outside the brush: clears it
                page.mouse.move(box["x"] + box["width"] * a, y)
                page.mouse.down()
                page.mouse.move(box["x"] + box["width"] * b, y, steps=10)
                page.mouse.up()
                cap = panel.get_by_text(caption_re)
                # Streamlit keeps the last rerun's elements on screen while it reruns: read the caption and
                # the table only once both come from this brush's rerun (a new caption, no rerun going,
                # the same caption after the download)
                deadline = time.monotonic() + 60
                while True:
                    cap.wait_for(timeout=60_000)
                    page.wait_for_function(
                        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
                    before = cap.inner_text()
                    table = panel.locator('[data-testid="stElementContainer"]:has([data-testid="stDataFrame"])').first
                    table.hover()  # the grid's toolbar shows on hover
                    with page.expect_download(timeout=30_000) as dl:
                        table.get_by_role("button", name=re.compile("Download as CSV")).first.click()
                    rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text(encoding="utf-8-sig"))))
                    settled = before != last_caption and cap.inner_text() == before
                    if (settled and len(rows) == int(caption_re.search(before).group(3))) or time.monotonic() > deadline:
                        break
                    page.wait_for_timeout(500)
                last_caption = before
                lo_s, hi_s, n = caption_re.search(before).groups()
                lo = dt.datetime.fromisoformat(lo_s).replace(tzinfo=utc)
                hi = dt.datetime.fromisoformat(hi_s).replace(tzinfo=utc)
                shown = {_link(r).rsplit("/", 1)[-1] for r in rows}
                want = {str(r.id) for r in _flow_runs_started()
                        if r.start_time <= hi and (r.end_time is None or r.end_time >= lo)}
                assert len(rows) == int(n) and shown == want, (lo, hi, sorted(shown ^ want))
                proper += 0 < len(want) < len(_flow_runs_started())
                if int(n):  # a brush over no run (the runs crowd to the left edge as the module runs on) draws no row
                    texts += _check_rows(rows, {str(r.id): r for r in _flow_runs_started()})
            page.screenshot(path=str(out / "dashboard-brush.png"), full_page=True)
            assert proper >= 1, "no brush selected a part of the runs"
            assert texts >= 1, "no finished run's row was drawn to check its text"
            # at a laptop's width no headline figure is cut off ("1 / 3 que…"): the summary's and the cost panel's
            _show_section(page, "panel-cost")
            page.set_viewport_size({"width": 1280, "height": 7000})
            page.wait_for_timeout(1500)
            # (nor broken over two lines: a value wraps rather than being cut, which reads as badly)
            cut = page.evaluate("""() => [...document.querySelectorAll('[data-testid="stMetricValue"]')]
                .filter(m => [m, ...m.querySelectorAll('*')].some(e => e.scrollWidth > e.clientWidth + 1)
                             || m.getBoundingClientRect().height > 1.5 * parseFloat(getComputedStyle(m).lineHeight))
                .map(m => m.innerText)""")
            page.screenshot(path=str(out / "dashboard-laptop.png"), full_page=True)
            assert page.locator('[data-testid="stMetricValue"]').count() >= 8  # the summary's and the cost panel's
            assert cut == [], f"figures cut off or wrapped at 1280 px: {cut}"
            # no Deploy button / developer menu for the page's readers
            assert page.get_by_role("button", name="Deploy").count() == 0
        finally:
            browser.close()


def _read_at(caption: str):
    """When the page's figures were read (UTC), from the caption under its title (to the second)."""
    import datetime as dt
    import re

    hms = re.search(r"read at (\d\d):(\d\d):(\d\d) UTC", caption)
    assert hms, caption
    read = dt.datetime.now(dt.timezone.utc).replace(hour=int(hms[1]), minute=int(hms[2]), second=int(hms[3]), microsecond=0)
    return read - dt.timedelta(days=1) if read > dt.datetime.now(dt.timezone.utc) else read


SWEEP_JS = """(cv, dy, dx) => {
    const r = cv.getBoundingClientRect(), tip = cv.parentElement.querySelector('.lt-tip'), out = [];
    for (let y = dy / 2; y < r.height; y += dy) for (let x = 0; x < r.width; x += dx) {
        const at = {clientX: r.left + x, clientY: r.top + y, bubbles: true};
        cv.dispatchEvent(new PointerEvent('pointermove', at));
        if (tip.style.display === 'block') out.push([x, y, tip.innerText]);
    }
    cv.dispatchEvent(new PointerEvent('pointerleave'));
    return out;
}"""  # pointer moves dispatched in the page over a time chart, every dx pixels across and dy down: [x, y, tooltip text] where one shows


def _tips(found: list) -> list[dict[str, str]]:
    return [dict(line.split(": ", 1) for line in text.splitlines()) for _, _, text in found]


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def test_time_chart_tooltips_match_occupancy(dashboard):
    """Hovering the first page's time charts in the browser: every tooltip of the job-status, queued-time
    and load charts gives the occupancy module's figures for its interval (that module is checked against
    the runs' own state histories in test_dashboard_occupancy.py), and each chart shows several marks."""
    import datetime as dt
    import re

    from playwright.sync_api import sync_playwright

    from prefect_launch.dashboard import chart_data as CD
    from prefect_launch.dashboard import spec as S
    from prefect_launch.dashboard import view as V

    url, seeded = dashboard
    # (where, pixels down and across between pointer moves): bars are hit anywhere inside; a step line within
    # 12 px of it, so the load chart is swept densely enough to reach each line wherever it lies
    charts = {"panel-status": (".st-key-panel-status", 40, 1), "panel-queued": (".st-key-panel-queued", 40, 1),
              "load": (".st-key-panel-summary", 8, 2)}
    found: dict[str, list] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 7000})
            # the seeded queue only (other tests' runs come and go on the shared server), read at least 15 s
            # after the seeding: Prefect persists the seeded runs' state events every few seconds, and the
            # page is compared with a read made after it
            settled = seeded.since + dt.timedelta(minutes=30, seconds=15)
            time.sleep(max(0.0, (settled - dt.datetime.now(dt.timezone.utc)).total_seconds()))
            page.goto(url, wait_until="domcontentloaded")
            page.locator(f".st-key-panel-status {TIME_CHART}").wait_for(timeout=120_000)
            choose_queue(page, seeded.pool)
            # the last hour in 1-minute intervals: the seeded runs span several (on the 7-day default they
            # fall in its newest hour, a pixel or two wide)
            option(page, "range", "Last 1 hour").click()
            # the caption names the filter once the filtered page is drawn (the unfiltered one's caption,
            # shown until then, does not: a sweep before this read the all-queues chart, CI stop 25)
            filtered = page.get_by_text(re.compile(rf"interval 1 min · grouping job · queues {re.escape(seeded.pool)} · read at "))
            filtered.first.wait_for(timeout=60_000)
            page.wait_for_function(IDLE_JS, timeout=60_000)
            # the caption and the charts' tooltips read in one step in the page: the keeper redraws the page
            # at each step of its clock, and a read across a redraw would mix two reads
            caption, *swept = page.evaluate("""(sels) => {
                const cap = [...document.querySelectorAll('p')].map((p) => p.innerText).find((t) => / · read at /.test(t));
                const sweep = %s;
                return [cap, ...sels.map(([s, dy, dx]) => sweep(document.querySelector(s + ' .lt-chart[data-drawn] canvas'), dy, dx))];
            }""" % SWEEP_JS, list(charts.values()))
            found = dict(zip(charts, swept))
            assert found["panel-status"], "no tooltip shown over the job status chart"
            x, y, _ = found["panel-status"][len(found["panel-status"]) // 2]
            box = page.locator(f".st-key-panel-status {TIME_CHART}").bounding_box()
            page.mouse.move(box["x"] + x, box["y"] + y)
            tip = page.locator(".st-key-panel-status .lt-tip")
            tip.wait_for(state="visible", timeout=5_000)
            # a real pointer shows a tooltip too (its figures may be a newer read's: only its form is checked)
            assert tip.inner_text().startswith("from: ") and "runs (at any moment / finished): " in tip.inner_text()
            # a second click on the range already chosen keeps it (a single choice is never emptied, which
            # would read as the default range): still pressed, still the 1-hour page, after any rerun
            pressed = option(page, "range", "Last 1 hour")
            pressed.click()
            page.wait_for_timeout(1_000)
            page.wait_for_function(IDLE_JS, timeout=60_000)
            assert choice(page, "range").locator(PRESSED).count() == 1
            assert choice(page, "range").locator(PRESSED).inner_text() == "Last 1 hour"
            assert page.get_by_text(re.compile(r"interval 1 min · grouping job · ")).count() >= 1
        finally:
            browser.close()
    assert seeded.pool in caption, caption
    read = _read_at(caption)
    assert read >= settled, caption
    # the page's range ends at its clock's step, the one of its read or (read ahead by the keeper) the next;
    # an interval's figures do not depend on where the range starts or ends, so a range spanning both has them
    step = S.page_now(read)
    spec = S.ViewSpec(since=step - S.RANGES["Last 1 hour"], until=step + dt.timedelta(seconds=S.PAGE_STEP_S),
                      grouping="job", queues=(seeded.pool,), interval_s=60)
    # the caption gives the read time to the second: the figures are those of a moment in [read, read + 1 s)
    # (a run still waiting adds a second to the current interval's queued time each second)
    occ, occ_hi = (V.load_view(spec, now=read + dt.timedelta(seconds=s), source="index").occupancy for s in (0, 1))
    at = lambda t: f"{t:%Y-%m-%d %H:%M:%S} UTC"  # noqa: E731  (a tooltip's "from")

    status, status_hi = ({(at(r.bucket), r.status): int(r.count) for r in o.status.itertuples()} for o in (occ, occ_hi))
    seen = {(f["from"], f["status"]): int(_num(f["runs (at any moment / finished)"])) for f in _tips(found["panel-status"])}
    for key, n in seen.items():
        # a moment of that second: at its start or its end (a run's phase can begin within it, CI stop 33)
        assert n in (status.get(key), status_hi.get(key)), (key, n, status.get(key), status_hi.get(key))
    assert len({s for _, s in seen}) >= 2 and len(seen) >= 3, sorted(seen)  # several bars, not one

    queued, queued_hi = ({(at(r.bucket), str(r.group)): r for r in o.queued.itertuples()} for o in (occ, occ_hi))
    tips = _tips(found["panel-queued"])
    assert tips, "no tooltip shown over the queued time chart"
    for f in tips:
        lo, hi = queued.get((f["from"], f["job"])), queued_hi.get((f["from"], f["job"]))
        assert lo is not None and hi is not None, f
        assert int(_num(f["runs waiting"])) == int(lo.runs) == int(hi.runs), (f, lo)
        # shown rounded: seconds to 0 decimals, the mean to 1
        assert lo.queued_s - 0.5 <= _num(f["seconds queued"]) <= hi.queued_s + 0.5, (f, lo, hi)
        assert lo.mean_s - 0.051 <= _num(f["mean wait (s)"]) <= hi.mean_s + 0.051, (f, lo, hi)

    load, load_hi = ({at(r.bucket): r for r in o.load.itertuples()} for o in (occ, occ_hi))
    names = dict((name, col) for col, name in CD.LOAD_SERIES)
    tips = _tips(found["load"])
    assert "runs holding a slot" in {f["series"] for f in tips}, tips
    # not only the empty intervals: the seeded runs' too
    assert any(_num(f["runs holding a slot at any moment"]) > 0 for f in tips), sorted({f["from"] for f in tips})[-3:]
    for f in tips:
        r, hi = load[f["from"]], load_hi[f["from"]]
        col = names[f["series"]]
        # 2 decimals shown (a value at a rounding edge seen off by 0.00025: 15 ms of a run in the interval)
        assert getattr(r, col) - 0.006 <= _num(f["value"]) <= getattr(hi, col) + 0.006, (f, r, hi)
        assert (int(_num(f["runs holding a slot at any moment"])), int(_num(f["runs waiting"]))) == (int(r.held), int(r.waiting)), (f, r)


def test_a_slow_view_shows_older_figures_with_their_age_then_updates_itself(dashboard, prefect_server, tmp_path):
    """Where reading a view takes longer than a step of the page's clock (about 1M runs; forced here with
    LAUNCH_MONITOR_SLOW_READ_SECONDS=0 and no keeper), a visit in a new step shows the newest figures of its
    sidebar state at once, says when they were read, and redraws itself with the newer ones."""
    import re

    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PREFECT_API_URL=prefect_server, LAUNCH_MONITOR_SLOW_READ_SECONDS="0")
    args = [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"), "--server.port", str(port),
            "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none"]
    read_re = re.compile(r"read at (\d\d:\d\d:\d\d) UTC")
    caption_re = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d – .* read at ")  # the caption under the title
    with background_process(args, tmp_path / "streamlit.log", env=env, cwd=ROOT) as proc:
        wait_healthy(url, proc, timeout=90, log=tmp_path / "streamlit.log", health_path="/_stcore/health", what="streamlit")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 7000})
                page.goto(url, wait_until="domcontentloaded")
                page.locator(".st-key-panel-links").wait_for(timeout=120_000)
                page.wait_for_function(IDLE_JS, timeout=60_000)
                first = read_re.search(page.get_by_text(caption_re).first.inner_text())[1]
                page.wait_for_timeout(11_000)  # the page's clock moves on (10-s steps): a new view to read
                # the note and the caption as they stand together, taken as the page draws them: the newer read may
                # finish within a second, and a browser slowed by a busy box can draw the note and its removal in
                # one frame (seen with three test workers), so a poll of the page could miss it
                page.add_init_script("""(() => {
                    const take = () => {
                        if (window.__olderShown) return;
                        const ps = [...document.querySelectorAll('p')].map((p) => p.textContent);
                        const note = ps.find((t) => t.startsWith('Showing the figures read at '));
                        const cap = ps.find((t) => /^\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d – .* read at /.test(t));
                        if (note && cap) window.__olderShown = [note, cap];
                    };
                    new MutationObserver(take).observe(document, {childList: true, subtree: true, characterData: true});
                })()""")
                page.reload(wait_until="domcontentloaded")
                try:
                    shown = page.wait_for_function("() => window.__olderShown || null", timeout=60_000).json_value()
                except Exception:
                    page.screenshot(path=str(ROOT / "test-output" / "monitor-slow-view.png"), full_page=True)
                    texts = page.evaluate("() => [...document.querySelectorAll('p')].map((p) => p.innerText)")
                    raise AssertionError(f"no note of older figures after the reload (first read at {first}); "
                                         f"the page shows: {texts[:8]}")
                note_text, caption_text = shown
                assert f"read at {first} UTC (" in note_text and "the page updates itself" in note_text, note_text
                assert read_re.search(caption_text)[1] == first, caption_text  # the figures it names
                page.get_by_text(re.compile(r"^Showing the figures read at ")).wait_for(state="detached", timeout=60_000)  # redrawn, unasked
                page.wait_for_function(IDLE_JS, timeout=60_000)
                assert read_re.search(page.get_by_text(caption_re).first.inner_text())[1] > first
            finally:
                browser.close()


def test_the_open_page_comes_back_after_the_monitor_is_killed_and_restarted(dashboard, prefect_server, tmp_path):
    """Kill -9 the monitor (served as `make dashboard` does, with slow reads forced so that it shows older
    figures in a new step) under an open page, start it again on the same port: the open page (no
    reload) keeps its figures and their read time meanwhile, and at the person's next choice in the
    sidebar shows figures the new process read after its start, no error, and no figures of the dead
    process shown as older ones (the new process has none)."""
    import datetime as dt
    import re
    import signal

    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PREFECT_API_URL=prefect_server, LAUNCH_MONITOR_SLOW_READ_SECONDS="0")
    args = [sys.executable, "-m", "prefect_launch.dashboard.serve", "--server.port", str(port),
            "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none"]
    caption_re = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d – .* read at ")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 7000})
            with background_process(args, tmp_path / "monitor-1.log", env=env, cwd=ROOT) as first:
                wait_healthy(url, first, timeout=90, log=tmp_path / "monitor-1.log", health_path="/_stcore/health",
                             what="streamlit")
                page.goto(url, wait_until="domcontentloaded")
                page.locator(".st-key-panel-links").wait_for(timeout=120_000)
                page.wait_for_function(IDLE_JS, timeout=60_000)
                before = _read_at(page.get_by_text(caption_re).first.inner_text())
                os.killpg(first.pid, signal.SIGKILL)  # no clean shutdown
                first.wait(30)
            page.wait_for_timeout(2_000)  # the page sees its server gone
            restarted = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
            with background_process(args, tmp_path / "monitor-2.log", env=env, cwd=ROOT) as second:
                wait_healthy(url, second, timeout=90, log=tmp_path / "monitor-2.log", health_path="/_stcore/health",
                             what="streamlit")
                # no reload: the open page reconnects; the next choice is served by the new process
                page.wait_for_function(IDLE_JS, timeout=60_000)
                option(page, "range", "Last 24 hours").click()
                try:
                    caption = _new_caption(page, before)
                except Exception:
                    page.screenshot(path=str(ROOT / "test-output" / "monitor-restart.png"), full_page=True)
                    raise
                page.wait_for_function(IDLE_JS, timeout=60_000)
                assert _read_at(caption) >= restarted > before
                assert page.locator('[data-testid="stException"]').count() == 0
                assert page.get_by_text(re.compile(r"^(Cannot read|Showing the figures read at)")).count() == 0
                assert page.locator(".st-key-panel-summary").count() == 1
                assert page.locator(TIME_CHART).count() >= 3  # load, job status and queued time drawn again
                # a new visitor of the new process: its scripts and styles (the asset cache starts empty with the
                # process) come whole from Streamlit, then from memory, and none fails
                for _ in range(2):
                    statics, failed = [], []
                    fresh = browser.new_page(viewport={"width": 1600, "height": 7000})
                    fresh.on("response", lambda r: statics.append(r) if "/static/" in r.url else None)
                    fresh.on("requestfailed", lambda r: failed.append(r.url))
                    fresh.goto(url, wait_until="domcontentloaded")
                    fresh.locator(".st-key-panel-links").wait_for(timeout=120_000)  # drawn: its scripts all came
                    assert len(statics) > 20 and not failed
                    assert all(r.status == 200 and len(r.body()) == int(r.headers["content-length"]) for r in statics)
                    fresh.close()
        finally:
            browser.close()


def _new_caption(page, before) -> str:
    """The caption under the title once it names a read time other than ``before``'s."""
    return page.wait_for_function("""(shown) => {
        const cap = [...document.querySelectorAll('p')].map((p) => p.innerText)
            .find((t) => /^\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d – .* read at /.test(t));
        const m = cap && cap.match(/read at (\\d\\d:\\d\\d:\\d\\d) UTC/);
        return m && m[1] !== shown ? cap : null;
    }""", arg=f"{before:%H:%M:%S}", timeout=120_000).json_value()
