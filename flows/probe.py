"""A job that records what it was given: env, CPU affinity, start and end times.

Used by the end-to-end tests (and handy for checking an agent by hand): each run
writes ``<record_dir>/<flow run id>.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run


def _wait(seconds: float, release_file: str) -> None:
    """``seconds``; with ``release_file``, until that file exists, ``seconds`` at most: a test that needs the run
    alive through a fault creates the file once it has checked what needed it, instead of guessing a length."""
    if not release_file:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while not os.path.exists(release_file) and time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _control_port():
    """The port of the runner's control channel this run's engine was given (None where not known)."""
    try:
        from prefect_launch.compat.prefect import engine_control_port
    except ImportError:  # an image without prefect-launch
        return None
    return engine_control_port()


def _write_record(path: Path, record: dict) -> None:
    """Whole or not at all (written aside, then renamed): a test polling for the file never reads half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


@flow(name="probe")
def probe(record_dir: str, seconds: float = 1.0, alloc_mb: int = 0, tag: str = "", release_file: str = "",
          linger: float = 0.0, env_file: str = "") -> dict:
    """``linger``: the run's process stays that many seconds after the run reported its end (an exit handler
    that sleeps, like a job's last upload or its workers' clean-up): a test of what happens meanwhile.
    ``env_file``: the job's environment (and its process's initial one) written there as it starts, before it
    waits: what a job's code can find in it (the gateway tests look for credentials)."""
    start = time.time()
    if env_file:
        _write_record(Path(env_file), {"environ": dict(os.environ),
                                       "proc_environ": Path("/proc/self/environ").read_bytes().decode(errors="replace")})
    if linger:
        atexit.register(time.sleep, linger)
    hog = bytearray(alloc_mb * 1024 * 1024) if alloc_mb else b""
    for i in range(0, len(hog), 4096):  # touch every page so it is resident
        hog[i] = 1
    _wait(seconds, release_file)
    record = {
        "run_id": str(flow_run.id),
        "tag": tag,
        "pid": os.getpid(),
        "start": start,
        "end": time.time(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "launch_cpu": os.environ.get("LAUNCH_CPU"),
        "launch_memory": os.environ.get("LAUNCH_MEMORY"),
        "launch_gpu": os.environ.get("LAUNCH_GPU"),
        "launch_agent": os.environ.get("LAUNCH_AGENT"),
        # the agent's Prefect control channel (a warm run: its worker's one FlowRunExecutorContext)
        "control_port": _control_port(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "env_extra": {k: v for k, v in os.environ.items() if k.startswith("JOB_")},
    }
    Path(record_dir).mkdir(parents=True, exist_ok=True)
    _write_record(Path(record_dir, f"{flow_run.id}.json"), record)
    return record
