"""The GPU job as a launch job: runs bench/gpu_job.py on the GPUs the agent pinned.

Its record (``gpu_job-<tag>.json`` under ``record_dir``) says what the job saw: the pinning variables, its
exit code and output. ``dry_run``: no GPU work, the job only waits ``seconds`` (``gpu_check.py
--fake-nvml``, a rehearsal of the check's plumbing on a machine without a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from prefect import flow


@flow(name="gpu-matmul")
def gpu_matmul(seconds: float = 15.0, mem_mib: int = 1024, record_dir: str = "", tag: str = "run",
               dry_run: bool = False) -> dict:
    if dry_run:
        time.sleep(seconds)
        rc, output = 0, "dry run: no GPU work"
    else:
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_job.py")), str(seconds), str(mem_mib)],
                              capture_output=True, text=True)
        rc, output = proc.returncode, (proc.stdout + proc.stderr).strip()
    record = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"), "rc": rc, "output": output}
    if record_dir:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        Path(record_dir, f"gpu_job-{tag}.json").write_text(json.dumps(record))
    if rc != 0:
        raise RuntimeError(f"GPU job failed: {output}")
    return record
