"""What the gateway allows a verified user to do to runs (issue 40 section 2): pure decisions on plain data.

:func:`classify` names the requests that need a rule (creating a run, changing one); the others pass.
:func:`launch_tags` decides a new run's tags from the verified user: a user's run is theirs
(``owner:<user>``, whatever the body said) and carries one of their projects (``project:``); an admin or
an agent may launch on behalf of someone, recorded as ``launched_by:<admin>``. :func:`may_change_run`
says whether the user may cancel, rename, relabel or delete a run with these tags: its owner, an admin,
an agent. :func:`queue_refusal` says why a queue is not open to a user. Each refusal is a :class:`Refusal`:
an HTTP status and a message that names what is missing.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Optional

from prefect_launch.blocks.identity_records import QueueAccess, User
from prefect_launch.workers.agent.tags import OWNER, tag, tag_value

__all__ = ["PROJECT", "LAUNCHED_BY", "Refusal", "Route", "classify", "launch_tags", "may_change_run",
           "queue_refusal", "safe_path"]

PROJECT = "project"
LAUNCHED_BY = "launched_by"

CREATE_FROM_DEPLOYMENT = "create_from_deployment"
CREATE_RUN = "create_run"
CHANGE_RUN = "change_run"

_UUID = r"[0-9a-fA-F-]{32,36}"
_ROUTES = [
    ("POST", re.compile(rf"^/api/deployments/(?P<id>{_UUID})/create_flow_run/?$"), CREATE_FROM_DEPLOYMENT),
    ("POST", re.compile(r"^/api/flow_runs/?$"), CREATE_RUN),
    ("POST", re.compile(rf"^/api/flow_runs/(?P<id>{_UUID})/(set_state|resume)/?$"), CHANGE_RUN),
    ("PATCH", re.compile(rf"^/api/flow_runs/(?P<id>{_UUID})(/labels)?/?$"), CHANGE_RUN),
    ("DELETE", re.compile(rf"^/api/flow_runs/(?P<id>{_UUID})/?$"), CHANGE_RUN),
]


class Refusal(NamedTuple):
    status: int
    message: str


class Route(NamedTuple):
    kind: str
    id: Optional[str]


def classify(method: str, path: str) -> Optional[Route]:
    """The rule a request falls under, with the id in its path; None for requests without a rule."""
    for m, pattern, kind in _ROUTES:
        if method.upper() == m:
            match = pattern.match(path)
            if match:
                return Route(kind, match.groupdict().get("id"))
    return None


def safe_path(path: str) -> bool:
    """No ``..`` or ``.`` segment, no backslash, no NUL: a path that cannot step out of where it points."""
    if "\\" in path or "\0" in path:
        return False
    return not any(seg in (".", "..") for seg in path.split("/"))


def _values(tags: Iterable[str], key: str) -> list[str]:
    prefix = key + ":"
    return [t[len(prefix):] for t in tags if t.startswith(prefix)]


def launch_tags(user: User, tags: Optional[Iterable[str]]) -> tuple[list[str], Optional[Refusal]]:
    """A new run's tags as the verified ``user`` may create it, or a refusal.

    - a user: every ``owner:`` tag is replaced by ``owner:<user>``; a ``project:`` tag must name one of
      their projects (none given: their first project, if any); ``launched_by:`` tags are dropped.
    - an admin or an agent: one ``owner:`` tag is kept (none: ``owner:<self>``); a run for someone else
      gets ``launched_by:<self>``.
    """
    tags = [t for t in (tags or []) if isinstance(t, str)]
    owners = list(dict.fromkeys(_values(tags, OWNER)))
    projects = list(dict.fromkeys(_values(tags, PROJECT)))
    rest = [t for t in tags if not t.startswith((OWNER + ":", LAUNCHED_BY + ":", PROJECT + ":"))]
    if user.is_admin or user.is_agent:
        if len(owners) > 1:
            return tags, Refusal(422, f"a run has one owner; the tags name {len(owners)}: {', '.join(owners)}")
        owner = owners[0] if owners else user.name
        out = rest + [tag(OWNER, owner)] + [tag(PROJECT, p) for p in projects]
        if owner != user.name:
            out.append(tag(LAUNCHED_BY, user.name))
        return out, None
    bad = [p for p in projects if p not in user.projects]
    if bad:
        mine = ", ".join(user.projects) or "none"
        return tags, Refusal(403, f"user {user.name!r} is not a member of project {bad[0]!r} (their projects: {mine})")
    if not projects and user.projects:
        projects = [user.projects[0]]
    return rest + [tag(OWNER, user.name)] + [tag(PROJECT, p) for p in projects], None


def may_change_run(user: User, run_tags: Optional[Iterable[str]], what: str = "change") -> Optional[Refusal]:
    """None if ``user`` may ``what`` (cancel, rename, delete...) the run with these tags, else the refusal."""
    if user.is_admin or user.is_agent:
        return None
    owner = tag_value(run_tags, OWNER)
    if owner == user.name:
        return None
    whose = f"{owner!r}'s run" if owner else "a run without an owner"
    return Refusal(403, f"user {user.name!r} may not {what} {whose}: only its owner, an admin or an agent may")


def queue_refusal(user: User, access: QueueAccess) -> Optional[Refusal]:
    """None if the queue is open to ``user`` (by name, one of their projects, or as an admin), else why not."""
    if access.allows(user):
        return None
    who = [f"users {', '.join(access.users)}"] if access.users else []
    who += [f"projects {', '.join(access.projects)}"] if access.projects else []
    return Refusal(403, f"queue {access.queue!r} is not open to user {user.name!r}: it is open to "
                        f"{' and '.join(who)} (an admin can change it: `prefect-launch access set {access.queue} ...`)")
