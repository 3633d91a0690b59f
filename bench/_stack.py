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
