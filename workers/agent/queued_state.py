"""The state a launch run waits in: Prefect's SCHEDULED type, named "Queued".

Why its own name: Prefect's late-runs service selects every run whose state is named
"Scheduled" and whose start time has passed, and marks it "Late", every few seconds. A run
in a launch queue waits for hardware by design (its ``launch.waiting`` label says why), so
"Late" says nothing true about it; and on a busy SQLite-backed server those marking writes
fail ("database is locked") and are tried again each pass for every waiting run (about 13,000
failed writes while 300 runs went through three agents in ``bench/scale.py``), taking the
server's time and write lock from the agents. Every state query of Prefect, the agents and the
monitor goes by the state's *type*, so the name changes only what people read: "Queued".
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

QUEUED = "Queued"
WAITING_NAMES = (QUEUED, "Scheduled", "Late", "AwaitingRetry")  # SCHEDULED-type names a launch run can wait under


def queued(scheduled_time: Optional[datetime] = None, message: Optional[str] = None) -> Any:
    """A Queued state (SCHEDULED type) starting at ``scheduled_time`` (now by default)."""
    from prefect.states import Scheduled

    return Scheduled(scheduled_time=scheduled_time or datetime.now(timezone.utc), name=QUEUED, message=message)
