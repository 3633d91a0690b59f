"""Fair share and quotas between owners: who goes first inside a priority level, who must wait.

Pure. Fair share is Backend.AI's ``drf`` sequencer in small: within one priority
level the owner holding the smallest dominant share of the queue's capacity goes
first (FIFO within an owner), and each pick adds to its owner's share, so one
owner's 100-trial sweep interleaves with everyone else instead of going first in
full. Quotas cap what one owner (or project) holds at once; a run over its quota
waits with that reason, it is never rejected.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Optional, TypeVar

from pydantic import BaseModel

from prefect_launch.workers.scheduling.resources import Resources, format_size

T = TypeVar("T")


class Quota(BaseModel):
    """Most one owner (or project) may hold at once; None = no cap on that resource."""

    cpu: Optional[float] = None
    memory: Optional[int] = None
    gpu: Optional[int] = None


def _add(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=round(a.cpu + b.cpu, 6), memory=a.memory + b.memory, gpu=a.gpu + b.gpu)


def held_by_owner(items) -> dict[str, Resources]:
    """Sum ``(owner, resources)`` pairs per owner (no owner: ``""``): the one tally that quotas, fair
    share and `queue ls` all count with."""
    held: dict[str, Resources] = {}
    for owner, r in items:
        o = owner or ""
        held[o] = _add(held.get(o, Resources()), r)
    return held


def dominant_share(held: Resources, capacity: Resources) -> float:
    """The largest fraction of any one resource of ``capacity`` that ``held`` takes."""
    shares = [held.cpu / capacity.cpu if capacity.cpu else 0.0,
              held.memory / capacity.memory if capacity.memory else 0.0,
              held.gpu / capacity.gpu if capacity.gpu else 0.0]
    return max(shares)


def drf_order(items: list[T], owner_of, request_of, held: dict[str, Resources], capacity: Resources) -> list[T]:
    """``items`` (already in FIFO order, one priority level) reordered by dominant resource share.

    ``owner_of(item)`` and ``request_of(item)`` read an item; ``held`` is what each owner
    holds now. Each pick charges its request to its owner before the next pick, so the
    order is what a fair scheduler starting them one by one would produce.
    """
    queues: dict[str, list[T]] = defaultdict(list)
    first_seen: dict[str, int] = {}
    for i, it in enumerate(items):
        o = owner_of(it) or ""
        queues[o].append(it)
        first_seen.setdefault(o, i)
    share_held = {o: held.get(o, Resources()) for o in queues}
    out: list[T] = []
    while queues:
        o = min(queues, key=lambda k: (dominant_share(share_held[k], capacity), first_seen[k]))
        it = queues[o].pop(0)
        out.append(it)
        req = request_of(it)
        if req is not None:
            share_held[o] = _add(share_held[o], req)
        if not queues[o]:
            del queues[o]
    return out


def over_quota(held: Resources, request: Resources, quota: Optional[Quota], who: str) -> Optional[str]:
    """Why ``request`` would put ``who`` over its quota (a waiting reason), or None."""
    if quota is None:
        return None
    parts = []
    if quota.gpu is not None and held.gpu + request.gpu > quota.gpu:
        parts.append(f"gpu {held.gpu}+{request.gpu} > {quota.gpu}")
    if quota.cpu is not None and held.cpu + request.cpu > quota.cpu + 1e-9:
        parts.append(f"cpu {held.cpu:g}+{request.cpu:g} > {quota.cpu:g}")
    if quota.memory is not None and held.memory + request.memory > quota.memory:
        parts.append(f"memory {format_size(held.memory)}+{format_size(request.memory)} > {format_size(quota.memory)}")
    if not parts:
        return None
    return f"waiting: {who} is at its quota ({'; '.join(parts)})"


def fifo_key(submitted: Optional[datetime]) -> datetime:
    return (submitted or datetime.max).replace(tzinfo=None)


class OwnerUsage(BaseModel):
    """What one owner holds of a queue now, against its quota and the queue's capacity."""

    owner: str
    runs: int
    held: Resources
    dominant_share: float  # of the queue's online capacity, 0-1
    quota: Optional[str] = None  # the cap, as declared
    at_quota: bool = False  # one more run of the smallest preset would wait for the quota


def owner_usage(held_runs: list[tuple[Optional[str], Resources]], capacity: Resources,
                quota_of, smallest: Optional[Resources] = None) -> list[OwnerUsage]:
    """Per owner: runs and resources held now (``held_runs``: (owner, resources) of each live run),
    their dominant share of ``capacity``, and whether ``quota_of(owner)`` -> (Quota, text) is reached.
    Largest share first."""
    held = held_by_owner(held_runs)
    count: dict[str, int] = defaultdict(int)
    for owner, _ in held_runs:
        count[owner or ""] += 1
    out = []
    for o, h in held.items():
        q, text = quota_of(o) or (None, None)
        if q is None:
            at = False
        elif smallest is not None:  # the smallest run the queue takes would have to wait
            at = over_quota(h, smallest, q, o) is not None
        else:  # some capped resource is used up
            at = ((q.gpu is not None and h.gpu >= q.gpu) or (q.cpu is not None and h.cpu >= q.cpu - 1e-9)
                  or (q.memory is not None and h.memory >= q.memory))
        out.append(OwnerUsage(owner=o or "(none)", runs=count[o], held=h,
                              dominant_share=round(dominant_share(h, capacity), 4), quota=text, at_quota=at))
    return sorted(out, key=lambda u: (-u.dominant_share, u.owner))
