"""One record per run the agent holds: what it resolved, where the run lives, how it is watched and why it ended.

The agent core used to keep fourteen dicts and sets keyed by run id (handles, requests, limits,
samplers, idle checkers, kill reasons, end states, ...); each part of a run's life added its own.
`ActiveRun` gathers them, so a reader sees in one place what the agent knows about a run, and
`ActiveRuns` drops a record once nothing is left in it (the same lifetimes the dicts had: each
field is cleared by the step that used to pop it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional
from uuid import UUID


@dataclass
class RunHandle:
    """Where a started run lives: its host pid (the container's init for docker) and/or container id."""

    pid: Optional[int] = None
    pid_started: Optional[float] = None
    container: Optional[str] = None


@dataclass(eq=False)
class ActiveRun:
    """What the agent knows about one run, from its placement to the release of its capacity."""

    request: Any = None  # the ResolvedRequest, resolved once by dispatch, read when the run starts
    handle: Optional[RunHandle] = None  # set once its process or container came up
    ever_started: bool = False  # its process/container came up (start SUCCESS), until the submit returns
    limits: Any = None  # the run's memory group/limits watch, while it runs
    sampler: Any = None  # its metrics sampler, until the summary is written
    idle: Any = None  # its IdleChecker, where the queue reclaims idle hardware
    unlabelled: bool = False  # claimed without Prefect's worker labels yet (they ride with the placement labels)
    kill_reason: Optional[str] = None  # why the agent killed it (memory limit), for the crash message
    end_state: Any = None  # the State the agent decided for it (timeout, idle reclaim, cancel on exit)
    signalled_at: Optional[float] = None  # when the agent signalled it to stop
    stops: Optional[list] = None  # the stop's sub-steps, read by the terminate record once it is gone
    ended: bool = False  # the agent recorded its end state itself: no crash proposal over it
    freed: bool = False  # its capacity went back before Prefect's slot release
    ending: Any = None  # the shielded CancelScope while its end is recorded (`cut_ending` may cancel it)

    def blank(self) -> bool:
        return all(getattr(self, f.name) == f.default for f in fields(self))


_BLANK = ActiveRun()


class ActiveRuns:
    """The agent's runs by id. ``get`` reads (a blank record for an unknown run, not stored), ``of``
    creates, ``take`` clears one field and returns what it held, ``having`` lists the runs with a field set."""

    def __init__(self) -> None:
        self._runs: dict[UUID, ActiveRun] = {}

    def of(self, run_id: UUID) -> ActiveRun:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = ActiveRun()
        return run

    def get(self, run_id: UUID) -> ActiveRun:
        return self._runs.get(run_id, _BLANK)

    def take(self, run_id: UUID, field: str) -> Any:
        run = self._runs.get(run_id)
        if run is None:
            return getattr(_BLANK, field)
        value = getattr(run, field)
        setattr(run, field, getattr(_BLANK, field))
        if run.blank():
            del self._runs[run_id]
        return value

    def having(self, field: str) -> dict[UUID, Any]:
        blank = getattr(_BLANK, field)
        return {rid: getattr(r, field) for rid, r in list(self._runs.items()) if getattr(r, field) != blank}

    def __len__(self) -> int:
        return len(self._runs)
