"""A job for the cost tests: keep one core busy (or sleep) for a while, holding some memory."""

from __future__ import annotations

import time

from prefect import flow


@flow(name="cost-job")
def cost_job(seconds: float = 2.0, burn: bool = True, mib: int = 32) -> int:
    hold = bytearray(mib << 20)  # touched: resident
    for i in range(0, len(hold), 4096):
        hold[i] = 1
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        if burn:
            n += sum(range(2000))
        else:
            time.sleep(0.05)
    return len(hold) + n % 2
