"""The running dashboard in a real browser: headless Chromium (Debian package) via Playwright.

Starts `streamlit run dashboard/app.py` on a free loopback port against the test's Prefect
server with seeded runs and metrics, checks that every panel rendered with data, and saves
a full-page screenshot to test-output/dashboard.png.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from fixtures_dashboard import seed_runs

from prefect_launch.local_server import background_process, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHART_PANELS = ["panel-status", "panel-queued", "panel-runs", "panel-gpu_util_pct", "panel-cpu_pct",
                "panel-gpu_mem_gib", "panel-rss_gib"]
TABLE_PANELS = ["panel-summary", "panel-runs", "panel-waste", "panel-errors"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: install Debian's chromium (make system-deps)")


@pytest.fixture(scope="module")
def dashboard(prefect_server, tmp_path_factory):
    seeded = seed_runs(uuid.uuid4().hex[:6])
    from prefect_launch.blocks.queue_links import QueueLinks

    blk = QueueLinks(queue=seeded.pool)
    blk.upsert("Grafana GPU board", "https://grafana.example.com/d/gpu")
    blk.store()
    # the run index built beforehand (in the store the page will use), so the page serves its
    # run panels from it at once rather than from the API while it builds in the background
    from prefect_launch.dashboard import data as D
    from prefect_launch.dashboard import index_sync as X

    X.build(X.RunIndex(D.metrics_store()), D.get_api(), days=8)  # the page shows the last 7 days
    port = free_port()
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    args = [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"), "--server.port", str(port),
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
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector(".st-key-panel-links", timeout=120_000)
            # wait until the script finished (no "running" indicator) and charts drew
            try:
                page.wait_for_function("document.querySelectorAll('.vega-embed canvas, .vega-embed svg').length >= 9",
                                       timeout=120_000)
            except Exception:
                page.screenshot(path=str(out / "dashboard-failed.png"), full_page=True)
                n = page.evaluate("document.querySelectorAll('.vega-embed').length")
                raise AssertionError(f"charts did not draw ({n} vega-embed elements); see test-output/dashboard-failed.png")
            errors = page.locator('[data-testid="stException"]')
            assert errors.count() == 0, errors.first.inner_text()
            for key in CHART_PANELS:
                panel = page.locator(f".st-key-{key}")
                assert panel.count() == 1, key
                assert panel.locator(".vega-embed canvas, .vega-embed svg").count() >= 1, f"{key}: no chart"
                assert panel.locator('[data-testid="stAlert"]').count() == 0 or key == "panel-runs", f"{key}: shows a no-data note"
            for key in TABLE_PANELS:
                panel = page.locator(f".st-key-{key}")
                assert panel.locator('[data-testid="stDataFrame"]').count() >= 1, f"{key}: no table"
            heat = page.locator(".st-key-panel-summary .vega-embed")
            assert heat.count() >= 2  # load chart and hour x weekday heatmap
            link = page.locator('.st-key-panel-links a[href="https://grafana.example.com/d/gpu"]')
            assert link.count() == 1 and link.inner_text() == "Grafana GPU board"
            assert page.locator(".st-key-panel-links").get_by_text("Manage Links").count() >= 1
            summary = page.locator(".st-key-panel-summary").inner_text()
            assert "Runs in range" in summary
            assert page.get_by_text("from the run index").count() >= 1
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert (out / "dashboard.png").stat().st_size > 10_000
