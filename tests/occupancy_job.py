"""Jobs for the occupancy tests: sleep, then succeed, fail, or fail once and retry."""

from __future__ import annotations

import time

from prefect import flow
from prefect.runtime import flow_run


@flow(name="occ-job")
def occ_job(seconds: float = 1.0, fail: bool = False) -> float:
    time.sleep(seconds)
    if fail:
        raise RuntimeError("occupancy test: failed on purpose")
    return seconds


@flow(name="occ-retry", retries=1, retry_delay_seconds=0)
def occ_retry(seconds: float = 1.0) -> float:
    time.sleep(seconds)
    if flow_run.run_count <= 1:
        raise RuntimeError("occupancy test: the first attempt fails")
    return seconds
