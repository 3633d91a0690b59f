"""What the benchmarks share: a throw-away Prefect server (same set-up as the tests' fixture), background
processes, a Streamlit app on a free loopback port, a timed browser visit, and a percentile."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


def prefect_server():
    """A throw-away server for one benchmark run (see prefect_launch.local_server)."""
    from prefect_launch.local_server import local_prefect_server

    return local_prefect_server()


def background(args: list[str], log_path: Path, env: dict | None = None):
    """A benchmark's worker or agent process (see prefect_launch.local_server.background_process)."""
    from prefect_launch.local_server import background_process

    return background_process(args, log_path, env)


@contextlib.contextmanager
def streamlit_app(launcher: list[str], log: Path, timeout: float = 120) -> Iterator[str]:
    """``python -m <launcher>`` (``["streamlit", "run", app]``, or a module that starts Streamlit itself, as
    ``prefect_launch.dashboard.serve``) headless on a free loopback port, no file watcher, no usage stats;
    yields its URL once its health check answers, and stops it on exit."""
    from prefect_launch.local_server import background_process, free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", *launcher, "--server.port", str(port), "--server.address", "127.0.0.1",
           "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]
    with background_process(cmd, log, cwd=ROOT) as proc:
        wait_healthy(url, proc, timeout=timeout, log=log, health_path="/_stcore/health", what="streamlit")
        yield url


def visit(target, url: str, drawn_js: str, viewport: dict, timeout_s: float) -> float:
    """Seconds from navigating a new page to ``url`` until ``drawn_js`` (a JS function) holds, polled every
    50 ms. ``target``: a browser (the page gets a new profile: nothing cached, as Playwright's new_page) or
    one of its contexts (a new tab of that profile: its HTTP and code caches, as a returning visitor; the
    context's own viewport)."""
    page = target.new_page(viewport=viewport) if hasattr(target, "new_context") else target.new_page()
    try:
        t = time.perf_counter()
        page.goto(url, wait_until="commit")
        page.wait_for_function(drawn_js, timeout=timeout_s * 1000, polling=50)
        return time.perf_counter() - t
    finally:
        page.close()


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


STOCK_POOL = "bench-stock"  # a stock Prefect `process` work pool
LAUNCH_QUEUE = "bench-launch"  # a launch queue with one tiny preset


def stock_and_launch_pools(work_dir: Path) -> None:
    """On the current server: the stock `process` pool and the launch queue the benches compare
    (the queue applied from a queues.yaml written under ``work_dir``, as a user applies one)."""
    import subprocess
    import sys

    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=STOCK_POOL, type="process"))
    queues = work_dir / "queues.yaml"
    queues.write_text(f"queues:\n  - name: {LAUNCH_QUEUE}\n    presets: {{tiny: {{cpu: 0.1, memory: 512Mi}}}}\n"
                      "    default_preset: tiny\n")
    subprocess.run([sys.executable, "-m", "prefect_launch.cli", "queue", "apply", str(queues)], check=True,
                   capture_output=True)


def stock_worker(work_dir: Path):
    """A stock `prefect worker start --type process` on :data:`STOCK_POOL` (a context manager, its log under ``work_dir``)."""
    import sys

    return background([sys.executable, "-m", "prefect", "worker", "start", "--pool", STOCK_POOL, "--type", "process"],
                      work_dir / "stock-worker.log")


def launch_agent(work_dir: Path):
    """A launch agent named ``bench`` on :data:`LAUNCH_QUEUE` (a context manager, its log under ``work_dir``)."""
    import sys

    return background([sys.executable, "-m", "prefect_launch.cli", "agent", "--queue", LAUNCH_QUEUE, "--name", "bench",
                       "--capacity", "cpu=2,memory=8Gi"], work_dir / "launch-agent.log")


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every ``with`` of a benchmark stops what it started
    (killed by a bare SIGTERM, a benchmark left its Prefect server running)."""
    def handler(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
