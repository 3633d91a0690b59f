"""Recent launch history per owner: the last five session configurations, plus pinned ones.

Kept in one Prefect Variable per owner (``launch_recent_<owner>``), so every host that
launches sessions through the same server sees the same list.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timezone
from typing import Any, Optional

from pydantic import BaseModel, Field

KEEP = 5
TAG = "launch-recent"


class RecentEntry(BaseModel):
    id: str
    label: str
    request: dict[str, Any]
    created: datetime
    pinned: bool = False


class RecentList(BaseModel):
    entries: list[RecentEntry] = Field(default_factory=list)


def variable_name(owner: str) -> str:
    return "launch_recent_" + re.sub(r"[^a-z0-9_]+", "_", owner.lower())[:180]


def trim(entries: list[RecentEntry], keep: int = KEEP) -> list[RecentEntry]:
    """Newest first; pinned entries are kept whatever their age, the others up to ``keep`` (pure)."""
    entries = sorted(entries, key=lambda e: e.created, reverse=True)
    unpinned = [e for e in entries if not e.pinned][:keep]
    return [e for e in entries if e.pinned or e in unpinned]


def load(client: Any, owner: str) -> RecentList:
    var = client.read_variable_by_name(variable_name(owner))
    if var is None or not isinstance(var.value, dict):
        return RecentList()
    try:
        return RecentList.model_validate(var.value)
    except Exception:
        return RecentList()


def save(client: Any, owner: str, recent: RecentList) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name, value = variable_name(owner), recent.model_dump(mode="json")
    if client.read_variable_by_name(name) is None:
        client.create_variable(VariableCreate(name=name, value=value, tags=[TAG]))
    else:
        client.update_variable(VariableUpdate(name=name, value=value, tags=[TAG]))


def remember(client: Any, owner: str, req: Any) -> RecentEntry:
    data = req.model_dump(exclude_none=True, exclude_defaults=True)
    data.setdefault("queue", req.queue)
    data.setdefault("type", req.type)
    label = f"{req.type} {req.name or ''} on {req.queue}".replace("  ", " ")
    entry = RecentEntry(id=uuid.uuid4().hex[:8], label=label, request=data, created=datetime.now(timezone.utc))
    recent = load(client, owner)
    recent.entries = trim([entry] + recent.entries)
    save(client, owner, recent)
    return entry


def find(recent: RecentList, entry_id: str) -> RecentEntry:
    hits = [e for e in recent.entries if e.id.startswith(entry_id)]
    if len(hits) != 1:
        known = ", ".join(e.id for e in recent.entries) or "none"
        raise LookupError(f"no single recent launch {entry_id!r}; recent: {known}")
    return hits[0]


def update(client: Any, owner: str, entry_id: str, *, pinned: Optional[bool] = None,
           label: Optional[str] = None) -> RecentEntry:
    recent = load(client, owner)
    entry = find(recent, entry_id)
    if pinned is not None:
        entry.pinned = pinned
    if label is not None:
        if not label.strip() or len(label) > 100:
            raise ValueError("a recent launch's label must be 1-100 characters")
        entry.label = label.strip()
    recent.entries = trim(recent.entries)
    save(client, owner, recent)
    return entry
