"""A code job that needs a package the agent's Python lacks (``launchtiny``, from the job's environment)."""

import json
import os
import sys
from pathlib import Path

from prefect import flow, get_run_logger


@flow
def env_job(record_dir: str, tag: str, seconds: float = 0.0) -> str:
    import time

    import launchtiny  # only the job's environment has it

    time.sleep(seconds)
    out = Path(record_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID", tag)
    (out / f"{run_id}.json").write_text(json.dumps({
        "tag": tag, "launchtiny": launchtiny.VERSION, "launchtiny_file": launchtiny.__file__, "prefix": sys.prefix,
        "executable": sys.executable,
        "pid": os.getpid(), "start": time.time() - seconds, "end": time.time()}))
    get_run_logger().info("launchtiny %s from %s", launchtiny.VERSION, launchtiny.__file__)
    return launchtiny.VERSION
