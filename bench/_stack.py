"""A throw-away Prefect server for benchmarks (same set-up as the tests' fixture)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


def prefect_server():
    """A throw-away server for one benchmark run (see prefect_launch.local_server)."""
    from prefect_launch.local_server import local_prefect_server

    return local_prefect_server()


@contextlib.contextmanager
def background(args: list[str], log_path: Path, env: dict | None = None) -> Iterator[subprocess.Popen]:
    import signal

    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                            start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
