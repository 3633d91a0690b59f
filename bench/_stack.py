"""A throw-away Prefect server for benchmarks (same set-up as the tests' fixture)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prefect_server():
    """A throw-away server for one benchmark run (see prefect_launch.local_server)."""
    from prefect_launch.local_server import local_prefect_server

    return local_prefect_server()


def background(args: list[str], log_path: Path, env: dict | None = None):
    """A benchmark's worker or agent process (see prefect_launch.local_server.background_process)."""
    from prefect_launch.local_server import background_process

    return background_process(args, log_path, env)


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
