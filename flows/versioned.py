"""Example launch job that reports which copy of its code ran.

Its result says the code version (the ``VERSION`` constant of the file that was
loaded), where that file was and the run's working directory. The code- and
git-based jobs in prefect.yaml run it, so a user (and the tests) can see that a
job ran from the pulled copy of its code at the pinned version, not from the
developer's tree. The result is persisted, so it can be read back from the API.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

VERSION = "tree"


def _write_record(path: Path, record: dict) -> None:
    """Whole or not at all (written aside, then renamed): a test polling for the file never reads half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


@flow(name="versioned", persist_result=True, log_prints=True)
def versioned(note: str = "", record_dir: str = "") -> dict:
    record = {
        "version": VERSION,
        "file": str(Path(__file__).resolve()),
        "cwd": os.getcwd(),
        "note": note,
        "run_id": str(flow_run.id),
    }
    print(f"versioned job: version {VERSION!r} from {record['file']}")
    if record_dir:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        _write_record(Path(record_dir, f"{flow_run.id}.json"), record)
    return record
