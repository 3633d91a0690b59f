"""A code job that needs a package the agent's Python lacks (``launchtiny``, from the job's environment)."""

import json
import os
import sys
from pathlib import Path

from prefect import flow, get_run_logger


@flow
def env_job(record_dir: str, tag: str, seconds: float = 0.0, meet: str = "") -> str:
    """``meet``: another run's tag; this one ends only once that one has started (up to 300 s), so two runs
    are side by side however late one of them starts."""
    import time

    import launchtiny  # only the job's environment has it

    start = time.time()
    out = Path(record_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.started").touch()
    deadline = start + 300
    while meet and not (out / f"{meet}.started").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(seconds)
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID", tag)
    (out / f"{run_id}.json").write_text(json.dumps({
        "tag": tag, "launchtiny": launchtiny.VERSION, "launchtiny_file": launchtiny.__file__, "prefix": sys.prefix,
        "executable": sys.executable,
        "pid": os.getpid(), "start": start, "end": time.time()}))
    get_run_logger().info("launchtiny %s from %s", launchtiny.VERSION, launchtiny.__file__)
    return launchtiny.VERSION
