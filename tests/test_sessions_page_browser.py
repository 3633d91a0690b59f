"""The Sessions page in a real browser (headless Chromium via Playwright) against a real Prefect
server and a real agent: navigation from the monitor, the launcher's steps with a field error
shown and fixed, the launched batch session in the list and the detail panel, its scheduling
history (filtered, sub-steps expanded), rename while it runs and terminate.

Truth comes from Prefect (the run's name and state), not from what the page says of itself.
One test, one module-scoped streamlit server: kept short for the suite's time budget.
"""

from __future__ import annotations

import csv
import io
import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest

from launch_helpers import agent, apply_queue, read_runs, wait_final
from prefect_launch.local_server import CHROMIUM, CHROMIUM_MISSING, background_process, free_port, wait_healthy
from prefect_launch.local_server import CHROMIUM_ARGS as ARGS

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"small": {"cpu": 1, "memory": "1Gi"}, "big": {"cpu": 2, "memory": "1Gi"}}

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=CHROMIUM_MISSING)


@pytest.fixture(scope="module")
def sessions_page(prefect_server, tmp_path_factory):
    """Streamlit (the monitor, pages/ included), a launch queue and an agent for it, started side by side:
    the agent comes online while the browser steps through the launcher."""
    tmp = tmp_path_factory.mktemp("sessions-page")
    uniq = uuid.uuid4().hex[:6]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"), "--server.port", str(port),
            "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none"]
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    env.pop("LAUNCH_METRICS_URL", None)  # the page reads the agent's store (its block, else the local default)
    log = tmp / "streamlit.log"
    with background_process(args, log, env=env, cwd=ROOT) as proc:
        # a queue listed first, with another default preset: the launcher must not carry its preset over
        apply_queue(tmp, {"name": f"aaa-{uniq}", "presets": {"s": {"cpu": 1, "memory": "1Gi"}}, "default_preset": "s"})
        queue = apply_queue(tmp, {"name": f"sp-{uniq}", "presets": PRESETS, "default_preset": "small",
                                  "idle": {"max_lifetime": "1h"}})  # an idle check the detail panel shows
        with agent([queue], f"sp-{uniq}", "cpu=2,memory=4Gi", tmp, wait_online=False):
            wait_healthy(url, proc, timeout=90, log=log, health_path="/_stcore/health", what="streamlit")
            yield {"url": url, "queue": queue, "uniq": uniq, "agent_log": tmp / f"agent-sp-{uniq}.log"}


def _agent_store():
    """The metrics store the agent writes to (workers/run_metrics.load_store) and the page reads."""
    from prefect_launch.blocks.metrics_store import RunMetricsStore

    try:
        return RunMetricsStore.load(os.environ.get("LAUNCH_METRICS_BLOCK", "default"), _sync=True)
    except Exception:
        return RunMetricsStore()


def _seed_waiting_record(run_id: str) -> bool:
    """A 'still waiting' decision with a sub-step beside the agent's own records, when the scheduling
    history module is installed (the page then shows both)."""
    try:
        from prefect_launch.blocks.scheduling_history import SchedulingRecord, SubStep, record
    except ImportError:
        return False
    record(_agent_store(), SchedulingRecord(
        run_id=run_id, phase="schedule", result="NEED_RETRY", error_code="page-test-wait",
        message="needs cpu=1, 0 free (seeded by the page test)", attempts=3,
        sub_steps=[SubStep(step="capacity_check", result="FAILURE", message="capacity check seeded by the page test")]))
    return True


def test_launch_list_detail_rename_terminate_in_the_browser(sessions_page):
    from playwright.sync_api import expect, sync_playwright

    url, queue, uniq = sessions_page["url"], sessions_page["queue"], sessions_page["uniq"]
    name, new_name = f"page-{uniq}", f"page-{uniq}-renamed"
    out = ROOT / "test-output"
    out.mkdir(exist_ok=True)

    def settled(page) -> None:  # the rerun a click started has finished drawing
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)

    def refresh(page) -> None:  # the sidebar's Refresh; give the rerun time to start before waiting on it
        page.locator(".st-key-sessions_refresh button").click()
        page.wait_for_timeout(1000)
        settled(page)

    def next_step(page, step: int) -> None:
        page.locator(".st-key-launch_next button").click()
        page.locator(f".st-key-launch-step-{step}").wait_for(timeout=60_000)
        settled(page)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1500, "height": 2600}, accept_downloads=True)
        page.add_init_script("delete window.showSaveFilePicker")  # the table's CSV as a plain download
        try:
            # the page is in the monitor's sidebar navigation (a pages/ folder beside app.py)
            page.goto(url + "/Sessions", wait_until="domcontentloaded")
            page.locator(".st-key-launch_next button").wait_for(timeout=120_000)
            settled(page)
            nav = page.locator('[data-testid="stSidebarNav"] a')
            assert nav.filter(has_text="Sessions").get_attribute("href").endswith("/Sessions")
            assert nav.count() == 2  # the queue monitor and this page

            # step 1, type and name: a bad name is refused under its field, then fixed
            page.locator(".st-key-lf_type_0").get_by_text("batch", exact=True).click()
            page.locator(".st-key-lf_name_0 input").fill("ab")
            page.locator(".st-key-lf_startup_command_0 input").fill("sleep 300")
            page.locator(".st-key-launch_next button").click()
            err = page.locator(".st-key-err-name")
            err.wait_for(timeout=60_000)
            settled(page)  # the error can be drawn before the rest of that rerun (CI once saw no step container yet)
            assert "name 'ab': use 4-64 letters" in err.inner_text()
            assert page.locator(".st-key-launch-step-0").count() == 1, "a field error keeps the launcher on its step"
            page.locator(".st-key-lf_name_0 input").fill(name)
            next_step(page, 1)
            assert page.locator(".st-key-err-name").count() == 0
            # step 2, environment and resources: this test's queue, its default preset
            # typed, not scrolled to: the list is virtualised, and the session server holds every test's queues
            box = page.locator(".st-key-lf_queue_0 input[role=combobox]")
            box.click()
            box.press_sequentially(queue)
            page.get_by_role("option", name=queue, exact=True).click()
            settled(page)
            next_step(page, 2)  # data and storage: no mount
            next_step(page, 3)  # network
            next_step(page, 4)  # review: the dry run's resolution and warning
            review = page.locator(".st-key-launch-step-4")
            assert "no --mount" in review.inner_text()
            assert page.locator(".st-key-launch_go button").is_enabled(), review.inner_text()
            page.locator(".st-key-launch_go button").click()
            ok = page.locator(".st-key-panel-launcher [data-testid='stAlertContentSuccess']")
            ok.wait_for(timeout=60_000)
            assert f"on {queue}: {name} (" in ok.inner_text()
            settled(page)
            from prefect import get_client
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            assert len(runs) == 1 and "launch-session" in runs[0].tags and "session-type:batch" in runs[0].tags
            rid = str(runs[0].id)
            assert runs[0].work_pool_name == queue

            # the list shows it; a click on its row opens it in the detail panel
            table = page.locator(".st-key-panel-sessions [data-testid='stDataFrame']")
            table.hover()
            with page.expect_download(timeout=30_000) as dl:
                table.get_by_role("button", name="Download as CSV").click()
            listed = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text(encoding="utf-8-sig"))))
            row = next(i for i, r in enumerate(listed) if r["id"] == rid)
            assert listed[row]["name"] == name and listed[row]["type"] == "batch" and listed[row]["queue"] == queue
            assert listed[row]["resources"].startswith("cpu=1") and row < 8  # newest first: in view
            box = table.bounding_box()
            page.mouse.click(box["x"] + 12, box["y"] + 35 * (row + 1) + 17)  # its selection marker (rows are 35 px)
            page.wait_for_timeout(1000)
            settled(page)
            head = page.locator(".st-key-detail-head")
            expect(head).to_contain_text(f"{name} · ", timeout=30_000)
            assert rid in head.inner_text().replace("\\", "")
            deadline = time.time() + 120
            while " · Running · " not in head.inner_text():  # refreshed until the agent runs it
                assert time.time() < deadline, (f"never Running: {head.inner_text()} / "
                                                f"{read_runs([rid])[0].state_name}; agent log {sessions_page['agent_log']}")
                refresh(page)
            detail = page.locator(".st-key-panel-detail")
            assert f"{name} · Running · batch · {rid}" in head.inner_text().replace("\\", "")
            assert "No apps: batch sessions run a command." in detail.inner_text()
            idle = page.locator(".st-key-detail-idle")
            deadline = time.time() + 60
            while "session_lifetime" not in idle.inner_text():  # the agent publishes its judgement on start
                assert time.time() < deadline, idle.inner_text()
                refresh(page)
            assert re.search(r"session_lifetime\s+\d+m\d*s?\s+limit 1h", idle.inner_text()), idle.inner_text()

            # scheduling history: the agent's own records and a seeded one; filtered by result, sub-steps expanded
            hist = page.locator(".st-key-detail-history")
            if _seed_waiting_record(rid):
                deadline = time.time() + 60
                while not ("start · SUCCESS" in hist.inner_text() and "page-test-wait" in hist.inner_text()):
                    assert time.time() < deadline, hist.inner_text()  # the agent writes its records in batches
                    refresh(page)
                hist.locator(".st-key-hist_result input[role=combobox]").click()
                page.get_by_role("option", name="NEED_RETRY", exact=True).click()
                page.keyboard.press("Escape")
                expect(hist).to_contain_text(re.compile(r"1 of ([2-9]|\d\d+) records"), timeout=60_000)
                settled(page)
                exp = hist.locator('[data-testid="stExpander"]')
                expect(exp).to_have_count(1, timeout=30_000)  # the filtered-out records' expanders are gone
                assert "schedule · NEED_RETRY · page-test-wait · x3" in exp.inner_text()
                exp.locator("summary").click()
                exp.get_by_text("needs cpu=1, 0 free (seeded by the page test)").wait_for(timeout=30_000)
                assert exp.locator('[data-testid="stDataFrame"]').count() == 1  # the sub-steps table
            else:
                assert "history not available" in hist.inner_text()

            # rename while it runs (the server holds the new name), then terminate
            rename = page.locator(f".st-key-rename_{rid} input")
            rename.fill(new_name)
            rename.press("Enter")  # the value is committed (a rerun) before the button is clicked
            page.wait_for_timeout(500)
            settled(page)
            page.locator(".st-key-rename_go button").click()
            done = page.locator(".st-key-detail-actions [data-testid='stAlertContentSuccess']")
            done.filter(has_text="Renamed").wait_for(timeout=60_000)
            settled(page)
            assert read_runs([rid])[0].name == new_name
            expect(head).to_contain_text(f"{new_name} · Running", timeout=30_000)
            page.locator(".st-key-terminate button").click()
            page.locator(".st-key-terminate_confirm button").wait_for(timeout=60_000)
            page.locator(".st-key-terminate_confirm button").click()
            done.filter(has_text="Terminating").wait_for(timeout=60_000)
            settled(page)
            page.screenshot(path=str(out / "sessions-page.png"), full_page=True)
            assert page.locator('[data-testid="stException"]').count() == 0
        except Exception:
            page.screenshot(path=str(out / "sessions-page-failed.png"), full_page=True)
            raise
        finally:
            browser.close()
    final = wait_final([rid], timeout=90)[0]
    assert final.state.is_cancelled(), final.state  # stopped by the terminate, not ended by its 300 s command
