"""Which waiting reasons an agent writes on its queue's runs (the ``launch.waiting`` label): only a change,
without fighting the queue's other agents, and, where several agents serve the queue, each run's reason by
one of them.

Pure (no server): the agent's intake (`workers/agent/intake.py`) asks `WaitNotes.changed` before each write.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from prefect_launch.settings import env_int, env_seconds
from prefect_launch.workers.agent.tags import WAIT_LABEL
from prefect_launch.workers.scheduling.rendezvous import rendezvous

# How long a waiting label another agent wrote stands before this agent writes its own, different words
# over it. Agents of one queue each explain a run from their own capacity ("agent w1 has 1 free", "queued
# behind <its own head>"); writing whenever the words differ made them overwrite each other every cycle:
# bench/scale.py (b), 3 agents, 60 runs: 20 label writes per run on the server, ~18 of them such rewrites.
# LAUNCH_WAIT_LABEL_HOLD_SECONDS, default 10 (read by WaitNotes)
# Waiting-label writes per dispatch cycle (in queue order, so the runs nearest the front first); the rest
# are written in the next cycles. A cycle awaits its label writes while it holds the plan lock: 50 fresh
# runs used to cost 50 writes before the agent could plan again.
# LAUNCH_WAIT_LABEL_BUDGET, default 10 (read by WaitNotes)


def reason_kind(reason: str) -> str:
    """What a waiting reason says, without the details that move every cycle: behind a FIFO head (which head),
    short of capacity (how much this agent has free); any other reason is its own kind."""
    for kind in ("waiting: queued behind ", "waiting: needs "):
        if reason.startswith(kind):
            return kind
    return reason


class WaitNotes:
    """Which waiting reasons to write on runs: only a change, and without fighting the queue's other agents.

    A reason is written when the run's label does not say it already and
    - the label is empty, or carries this agent's own last words and says another kind of thing (see
      ``reason_kind``) or has stood for ``hold_s`` (a new FIFO head or a new free amount is written at most
      once per ``hold_s``; its queue position and ETA are in `queue ls` / `runs ls`), or
    - another agent's words have stood for ``hold_s`` (they are a true reason too, from that agent's side:
      the label changes at most once per ``hold_s`` while several agents disagree, not every cycle);
    a read that predates this agent's write of the same reason does not repeat it;
    and, after ``new_cycle()``, at most ``budget`` writes are made per cycle.
    Where several agents serve the queue, the caller says whether this agent is the run's writer
    (`reason_writer`); an agent that is not writes nothing but over a label left empty for ``orphan_s``
    (3 x ``hold_s``: its writer gone, or not yet known to be)."""

    def __init__(self, hold_s: Optional[float] = None, budget: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = env_seconds("LAUNCH_WAIT_LABEL_HOLD_SECONDS", 10) if hold_s is None else hold_s
        self.budget = env_int("LAUNCH_WAIT_LABEL_BUDGET", 10) if budget is None else budget
        self.orphan_s = 3 * self.hold_s
        self._clock = clock
        self._written: dict[Any, tuple[str, str]] = {}  # per run: what this agent last wrote, over what
        self._seen: dict[Any, tuple[str, float]] = {}  # the label as last read per run, and since when
        self._left: Optional[int] = None  # writes left in this cycle (None: no cycle budget)

    def new_cycle(self, run_ids: Optional[Any] = None) -> None:
        """A dispatch cycle begins: its write budget is full again; with ``run_ids`` (the runs it plans),
        what is kept about other runs (placed, gone, out of the window) is dropped."""
        self._left = self.budget
        if run_ids is not None:
            keep = set(run_ids)
            self._written = {k: v for k, v in self._written.items() if k in keep}
            self._seen = {k: v for k, v in self._seen.items() if k in keep}

    def changed(self, flow_run: Any, reason: str, writer: bool = True) -> bool:
        """True when the label must be written now (the caller writes it); ``writer``: this agent writes this
        run's reasons (False: another agent of the queue does, see `reason_writer`)."""
        rid = flow_run.id
        current = (getattr(flow_run, "labels", None) or {}).get(WAIT_LABEL) or ""
        now = self._clock()
        seen = self._seen.get(rid)
        if seen is None or seen[0] != current:
            seen = self._seen[rid] = (current, now)
        if reason == current:
            return False
        if not writer and (current or now - seen[1] < self.orphan_s):
            return False  # the run's writer says why; this agent only fills a label it left empty
        mine, replaced = self._written.get(rid, (None, None))
        stale = current == replaced and reason == mine  # a read from before this agent's write
        held = current and now - seen[1] < self.hold_s
        if current and current != mine and not stale:  # another agent's words (or an earlier run of this agent's)
            if held:
                return False
        elif reason == mine:  # said already
            return False
        elif held and reason_kind(current) == reason_kind(reason):  # its own words, only the details moved
            return False
        if self._left is not None:
            if self._left <= 0:
                return False
            self._left -= 1
        self._written[rid] = (reason, current)
        self._seen[rid] = (reason, now)
        return True

    def forget(self, run_id: Any) -> None:
        self._written.pop(run_id, None)
        self._seen.pop(run_id, None)


def reason_writer(run_id: Any, agents: Iterable[str]) -> Optional[str]:
    """The one agent of ``agents`` (a queue's online agents) that writes ``run_id``'s waiting reason (`rendezvous`).

    Several agents each writing every waiting run's reason from their own side was most of the label writes a
    burst cost its server (bench/hosts.py, 4 agents, 48 runs: 236 waiting-label writes, ~5 per run; 93 with one
    writer per run)."""
    return rendezvous(run_id, agents)
