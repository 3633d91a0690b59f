"""The GPU job as a launch job: runs bench/gpu_job.py on the GPUs the agent pinned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prefect import flow


@flow(name="gpu-matmul")
def gpu_matmul(seconds: float = 15.0, mem_mib: int = 1024, record_dir: str = "") -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_job.py")), str(seconds), str(mem_mib)],
                          capture_output=True, text=True)
    record = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "rc": proc.returncode,
              "output": (proc.stdout + proc.stderr).strip()}
    if record_dir:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        Path(record_dir, "gpu_job.json").write_text(json.dumps(record))
    if proc.returncode != 0:
        raise RuntimeError(f"GPU job failed: {record['output']}")
    return record
