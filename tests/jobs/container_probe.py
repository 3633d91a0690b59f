"""A job that records, from inside its container, the limits it runs under.

Writes ``<record_dir>/<flow run id>.json``: ``nproc`` (the cores it may use),
the cgroup's CPU quota and memory limit, the size of ``/dev/shm``, the GPU
environment and the run's own labels as seen through its environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run


def _read(*paths: str):
    for p in paths:
        try:
            return Path(p).read_text().strip()
        except OSError:
            continue
    return None


def _wait(seconds: float, release_file: str) -> None:
    """``seconds``; with ``release_file`` (in a mounted folder), until that file exists, ``seconds`` at most: a test
    that needs the run alive through a fault creates the file once it has checked what needed it."""
    if not release_file:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while not os.path.exists(release_file) and time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


@flow(name="container-probe")
def container_probe(record_dir: str, seconds: float = 0.0, alloc_mb: int = 0, exit_code: int = 0,
                    release_file: str = "") -> dict:
    start = time.time()
    shm = os.statvfs("/dev/shm")
    record = {
        "run_id": str(flow_run.id),
        "start": start,
        "nproc": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()),
        "affinity": sorted(os.sched_getaffinity(0)),
        "memory_limit": _read("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max"),
        "cpu_quota": _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max"),
        "cpu_period": _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
        "shm_bytes": shm.f_blocks * shm.f_frsize,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "launch_agent": os.environ.get("LAUNCH_AGENT"),
        "hostname": os.uname().nodename,
    }
    Path(record_dir).mkdir(parents=True, exist_ok=True)
    Path(record_dir, f"{flow_run.id}.json").write_text(json.dumps(record))
    hog = bytearray(alloc_mb * 1024 * 1024) if alloc_mb else b""
    for i in range(0, len(hog), 4096):  # touch every page so it is resident
        hog[i] = 1
    _wait(seconds, release_file)
    if exit_code:
        os._exit(exit_code)  # the container's main process ends with this code, no final state reported
    return record
