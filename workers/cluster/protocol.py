"""How the agents of a multi-node cluster run agree on it, through the run's labels on the server (pure).

The agent that places the run (its Prefect claim makes it the only one) is the leader: it books its
own members (main1 and any others it hosts), then writes the plan - which agent hosts which member,
each agent's published address (main1's is ``MASTER_ADDR``) and the rendezvous port - as the run's
``launch.cluster.plan`` label. Each other agent named there books its members in its own ledger and
answers ``ok`` (members started) or ``no: why`` in ``launch.cluster.ack.<agent>``. The leader starts
main1 only when every agent said ok; a ``no`` or no answer in time puts the run back in its queue (its
submit time kept) and every agent gives back what it booked, so nothing is held while a cluster run
waits. While the run runs, each other agent raises its ``launch.cluster.beat.<agent>`` label; one the
leader has not heard from for ``LAUNCH_CLUSTER_LOST_SECONDS`` (its host cut off or down) fails the run
naming its members (`BeatWatch`). No service of our own: Prefect is the medium.
Once the plan is written the leader also emits a ``launch.cluster.planned`` event related to the run's work
pool: the other agents read their pool's Pending runs when it arrives (their event subscription), and only
every ``LAUNCH_CLUSTER_POLL_SECONDS`` besides (events can lag or drop), not on a tight poll.
"""

from __future__ import annotations

import json
from typing import Literal, Optional

from pydantic import BaseModel

from prefect_launch.workers.agent.tags import CLUSTER_ACK_LABEL, CLUSTER_BEAT_LABEL, CLUSTER_PLAN_LABEL


class ClusterPlan(BaseModel):
    leader: str
    port: int
    size: int
    members: dict[str, str]  # member name -> agent
    addrs: dict[str, str] = {}  # agent -> the address its members are reached at (its published address)

    def addr_of(self, member: str) -> str:
        """The host address of ``member`` (loopback for an agent that published none: same machine)."""
        from prefect_launch.workers.cluster.env import LOOPBACK

        return self.addrs.get(self.members.get(member, ""), LOOPBACK)

    def member_addrs(self) -> dict[str, str]:
        return {m: self.addr_of(m) for m in self.members}

    def label(self) -> dict[str, str]:
        return {CLUSTER_PLAN_LABEL: self.model_dump_json()}

    def ranks_on(self, agent: str) -> list[int]:
        from prefect_launch.workers.cluster.fit import member_names

        names = member_names(self.size)
        return [names.index(m) for m, a in self.members.items() if a == agent]

    def followers(self) -> list[str]:
        return sorted({a for a in self.members.values() if a != self.leader})


PLANNED_EVENT = "launch.cluster.planned"


def planned_event(flow_run_id: object, pool_id: object, plan: ClusterPlan) -> dict:
    """The keyword arguments of Prefect's ``emit_event`` for a written plan: the run is the resource and its work
    pool a related one (the followers' subscription filters on it); the payload names the followers."""
    return {
        "event": PLANNED_EVENT,
        "resource": {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"},
        "related": [{"prefect.resource.id": f"prefect.work-pool.{pool_id}", "prefect.resource.role": "work-pool"}],
        "payload": {"leader": plan.leader, "followers": plan.followers()},
    }


def plan_of(labels: Optional[dict]) -> Optional[ClusterPlan]:
    raw = (labels or {}).get(CLUSTER_PLAN_LABEL)
    if not raw:
        return None
    try:
        return ClusterPlan.model_validate(json.loads(raw))
    except (ValueError, TypeError):
        return None


def ack_key(agent: str) -> str:
    return CLUSTER_ACK_LABEL + agent


def beat_key(agent: str) -> str:
    return CLUSTER_BEAT_LABEL + agent


class BeatWatch:
    """The leader's view of the other agents' beats (pure; ``now`` is the leader's monotonic clock).

    A follower raises its ``launch.cluster.beat.<agent>`` label every `cluster_beat_s` while it follows the
    run; the leader notes when it last saw each value change. An agent whose beat has not changed for
    ``lost_s`` while the leader itself reached the server is lost (its host cut off or down). A leader that
    could not read the run (its own link or the server down) starts every agent's clock again once it can,
    so its own outage never blames the others; after an outage of ``for_s`` (the server restarting) they get
    that long again on top (at most `MAX_OUTAGE_GRACE_S`): their own writes were retrying across the same
    outage, and Prefect's client waits 2, 4 ... 32 s between tries, so a beat can come that much later."""

    MAX_OUTAGE_GRACE_S = 60.0

    def __init__(self, agents: list[str], lost_s: float, now: float) -> None:
        self.lost_s = lost_s
        self.seen: dict[str, tuple[Optional[str], float]] = {a: (None, now) for a in agents}
        self._grace = 0.0

    def blind(self, for_s: float = 0.0) -> None:
        self._blind = True
        self._grace = max(self._grace, min(for_s, self.MAX_OUTAGE_GRACE_S))

    def lost(self, labels: Optional[dict], now: float) -> list[str]:
        """Agents not heard from for ``lost_s``, given the run's labels read at ``now``."""
        if getattr(self, "_blind", False):
            self._blind, grace, self._grace = False, self._grace, 0.0
            self.seen = {a: ((labels or {}).get(beat_key(a)), now + grace) for a in self.seen}
            return []
        out = []
        for a, (value, since) in self.seen.items():
            current = (labels or {}).get(beat_key(a))
            if current != value:
                self.seen[a] = (current, now)
            elif now - since >= self.lost_s:
                out.append(a)
        return out


def answers(labels: Optional[dict], plan: ClusterPlan) -> tuple[list[str], dict[str, str]]:
    """(agents that said ok, agent -> why for those that said no)."""
    ok, no = [], {}
    for a in plan.followers():
        v = str((labels or {}).get(ack_key(a)) or "")
        if v == "ok":
            ok.append(a)
        elif v.startswith("no"):
            no[a] = v[3:].strip() or "refused"
    return ok, no


BOOKING_SUFFIX = ":members"


def booking_key(run_id: str) -> str:
    """The ledger and journal key of a follower's members: apart from the run id, so the follower's own
    dispatch (which may still see the run as Scheduled for a moment and try to lead it) never takes or frees
    this booking, and its restart recovery tells them from the runs it leads."""
    return f"{run_id}{BOOKING_SUFFIX}"


def run_of_booking(key: str) -> Optional[str]:
    """The run id of a follower booking key; None for any other key."""
    return key[: -len(BOOKING_SUFFIX)] if key.endswith(BOOKING_SUFFIX) else None


def decide_followed(state: Optional[str], plan: Optional[ClusterPlan], agent: str, ack: Optional[str],
                    alive: list[str]) -> tuple[Literal["adopt", "stop"], str]:
    """A follower restarted: what to do with the members it had booked for a run (pure).

    ``state``: the run's state type (None when the server no longer has it); ``alive``: its members on this
    agent that still run. Adopt (book again, follow to the end) only a live run whose plan still names this
    agent and which this agent had answered ``ok``; otherwise stop what is left and give the booking back."""
    if state is None:
        return "stop", "the run is gone from the server"
    if state not in ("PENDING", "RUNNING", "CANCELLING"):
        return "stop", f"the run is {state.lower()}"
    if plan is None or agent not in plan.followers():
        return "stop", "the run's cluster plan no longer names this agent (its leader gave up placing it)"
    if ack != "ok":
        return "stop", "this agent had not answered the leader yet; it will answer again"
    if not alive:
        return "adopt", "no member is left running; their exit status decides"
    return "adopt", f"member(s) {', '.join(alive)} still running"
