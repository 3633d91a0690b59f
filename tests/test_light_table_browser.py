"""The first page's light table (dashboard/light_table.py) in a real browser: a Streamlit app that
draws 5,000 rows, read in headless Chromium. Rows are built as they scroll into view, a heading sorts,
the CSV holds every row in the order shown, a name is shown as text (never run as HTML) and a link
is drawn only for an http(s) URL."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest

from prefect_launch.local_server import CHROMIUM, CHROMIUM_MISSING, background_process, free_port, wait_healthy
from prefect_launch.local_server import CHROMIUM_ARGS as ARGS

ROOT = Path(__file__).resolve().parents[1]
N = 5000
EVIL = "<img src=x onerror=window.__pwned=1>"
APP = f"""
import pandas as pd
import streamlit as st
from prefect_launch.dashboard import light_table as LT

n = {N} + (1 if st.button("one more run") else 0)  # the page's next read: newer rows for the same table
df = pd.DataFrame({{"name": [f"run-{{i:05d}}" for i in range(n)], "queued_s": [(i * 7919) % n for i in range(n)],
                   "start": pd.date_range("2026-12-01", periods=n, freq="min", tz="UTC"),
                   "link": [f"https://ui.example/runs/flow-run/{{i}}" for i in range(n)],
                   "energy_wh": [None if i % 2 else i / 4 for i in range(n)]}})
df.loc[3, "name"] = {EVIL!r}
df.loc[4, "link"] = "javascript:window.__pwned=2"
st.title("tables")
LT.table(df, "big", "Big table", labels={{"queued_s": "queued s", "link": "Prefect UI"}}, links={{"link": "open run"}},
         empty={{"energy_wh": "unavailable"}})
"""

pytestmark = [pytest.mark.server,  # a served Streamlit app and Chromium
              pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=CHROMIUM_MISSING)]


@pytest.fixture(scope="module")
def table_app(tmp_path_factory):
    home = tmp_path_factory.mktemp("light-table")
    app = home / "app.py"
    app.write_text(APP)
    port = free_port()
    args = [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(port), "--server.address",
            "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none"]
    url = f"http://127.0.0.1:{port}"
    log = home / "streamlit.log"
    with background_process(args, log, cwd=ROOT) as proc:
        wait_healthy(url, proc, timeout=90, log=log, health_path="/_stcore/health", what="streamlit")
        yield url


def _cells(page, col: int) -> list[str]:
    """The text of column ``col`` in the rows built now, top to bottom."""
    return page.evaluate("""(col) => [...document.querySelectorAll('.lt-rows > .lt-tr')]
        .sort((a, b) => +a.getAttribute('aria-rowindex') - +b.getAttribute('aria-rowindex'))
        .map(r => r.children[col].textContent)""", col)


def test_light_table_sorts_scrolls_downloads_and_escapes(table_app):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
            page.add_init_script("delete window.showSaveFilePicker")
            page.goto(table_app, wait_until="domcontentloaded")
            table = page.locator(".lt-table[data-drawn]")
            table.wait_for(timeout=60_000)
            assert table.get_attribute("data-rows") == str(N)
            assert table.get_by_text(f"{N:,} rows").count() == 1
            built = page.locator(".lt-rows > .lt-tr").count()
            assert 10 <= built <= 40, built  # only the rows in view (and a few around them) are built

            # a name is text, a script link is no link
            assert _cells(page, 0)[3] == EVIL
            assert page.locator(".lt-table img").count() == 0
            assert page.evaluate("window.__pwned === undefined")
            links = page.locator(".lt-rows a")
            assert page.locator('.lt-rows a[href^="javascript"]').count() == 0
            first = page.locator('.lt-rows > .lt-tr[aria-rowindex="2"] a')
            assert first.get_attribute("href") == "https://ui.example/runs/flow-run/0"
            assert first.get_attribute("target") == "_blank" and "noopener" in first.get_attribute("rel")
            assert first.inner_text() == "open run"
            assert links.count() == built - 1  # every built row but the one with the script link
            assert page.locator('.lt-rows > .lt-tr[aria-rowindex="6"] .lt-td').nth(3).inner_text() == ""
            assert _cells(page, 4)[:3] == ["0.00", "unavailable", "0.50"]  # not measured: said, not left blank

            # a heading sorts: ascending, then descending
            head = page.get_by_role("columnheader", name="queued s")
            head.click()
            assert head.get_attribute("aria-sort") == "ascending"
            assert _cells(page, 1)[:3] == ["0", "1", "2"]
            head.click()
            assert head.get_attribute("aria-sort") == "descending"
            assert _cells(page, 1)[:3] == ["4,999", "4,998", "4,997"]

            # scrolled to the end: the last rows are built, the first ones are not kept
            page.locator(".lt-table-scroll").evaluate("e => { e.scrollTop = e.scrollHeight; }")
            page.wait_for_function(f"""() => !!document.querySelector('.lt-rows > .lt-tr[aria-rowindex="{N + 1}"]')""",
                                   timeout=10_000)
            assert page.locator('.lt-rows > .lt-tr[aria-rowindex="2"]').count() == 0
            assert _cells(page, 1)[-1] == "0"

            # the CSV: every row, in the order shown, raw values (times ISO, the dropped link empty)
            with page.expect_download(timeout=30_000) as dl:
                page.get_by_role("button", name="Download CSV").click()
            assert dl.value.suggested_filename == "big-table.csv"
            rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text(encoding="utf-8-sig"))))
            assert len(rows) == N and list(rows[0]) == ["name", "queued_s", "start", "link", "energy_wh"]
            assert [int(r["queued_s"]) for r in rows] == sorted(range(N), reverse=True)
            by_name = {r["name"]: r for r in rows}
            assert by_name["run-00000"]["start"] == "2026-12-01T00:00:00.000Z"
            assert by_name["run-00000"]["link"] == "https://ui.example/runs/flow-run/0"
            assert by_name[EVIL]["link"] == "https://ui.example/runs/flow-run/3"
            assert by_name["run-00004"]["link"] == ""
            assert by_name["run-00001"]["energy_wh"] == "" and by_name["run-00002"]["energy_wh"] == "0.5"

            # newer rows for the same table (a rerun with new data) keep the reader's sort and scroll
            page.get_by_role("button", name="one more run").click()
            page.wait_for_function(f"() => document.querySelector('.lt-table[data-drawn]')?.dataset.rows === '{N + 1}'",
                                   timeout=30_000)
            assert page.get_by_role("columnheader", name="queued s").get_attribute("aria-sort") == "descending"
            assert page.locator(".lt-table-scroll").evaluate("e => e.scrollTop") > 0
            page.locator(".lt-table-scroll").evaluate("e => { e.scrollTop = 0; }")
            page.wait_for_function('() => !!document.querySelector(\'.lt-rows > .lt-tr[aria-rowindex="2"]\')', timeout=10_000)
            assert _cells(page, 1)[:2] == ["5,000", "4,999"]  # the new run (queued 5000 s) first, as sorted
        finally:
            browser.close()
