"""What the gateway allows a verified user to do to runs (issue 40 section 2): pure decisions on plain data.

:func:`classify` names the requests that need a rule (creating a run, changing one); the others pass.
:func:`launch_tags` decides a new run's tags from the verified user: a user's run is theirs
(``owner:<user>``, whatever the body said) and carries one of their projects (``project:``); an admin or
an agent may launch on behalf of someone, recorded as ``launched_by:<admin>``. :func:`may_change_run`
says whether the user may cancel, rename, relabel or delete a run with these tags: its owner, an admin,
an agent. :func:`queue_refusal` says why a queue is not open to a user. Each refusal is a :class:`Refusal`:
an HTTP status and a message that names what is missing.

:func:`write_refusal` denies plain users every write outside those rules (queues, deployments, blocks,
automations, variables other than their own recent-sessions list, logs, bulk run changes, the admin area):
those are for admins and agents. :func:`label_refusal` keeps the agents' labels (``launch.alloc`` and the
like, which owner quotas count) out of users' hands. :func:`secret_read` decides how a plain user's block
read is handled: Secret values come back masked, except a session token to its session's owner.

Run keys (a key an agent obtains for one run, which the run's process gets instead of the agent's key):
:func:`run_key_refusal` says who may obtain one (agents) and for which run (one not yet ended, with an owner);
a run key's user is its run's owner as a plain user, who may besides write what an engine writes
(:func:`engine_write`: logs, artifacts, concurrency slots); :func:`run_key_ended` says when it stops working.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Iterable, NamedTuple, Optional

from prefect_launch.blocks.identity_records import QueueAccess, User
from prefect_launch.workers.agent.tags import OWNER, tag, tag_value

__all__ = ["PROJECT", "LAUNCHED_BY", "Refusal", "Route", "classify", "engine_write", "label_refusal", "launch_tags",
           "may_change_run", "queue_refusal", "run_key_ended", "run_key_refusal", "safe_path", "secret_read",
           "token_write", "token_write_refusal", "write_refusal"]

PROJECT = "project"
LAUNCHED_BY = "launched_by"

CREATE_FROM_DEPLOYMENT = "create_from_deployment"
CREATE_RUN = "create_run"
CHANGE_RUN = "change_run"
OWN_VARIABLE = "own_variable"

_UUID = r"[0-9a-fA-F-]{32,36}"
_ROUTES = [
    ("POST", re.compile(rf"^/api/deployments/(?P<id>{_UUID})/create_flow_run/?$"), CREATE_FROM_DEPLOYMENT),
    ("POST", re.compile(r"^/api/flow_runs/?$"), CREATE_RUN),
    ("POST", re.compile(rf"^/api/flow_runs/(?P<id>{_UUID})/(set_state|resume)/?$"), CHANGE_RUN),
    ("PATCH", re.compile(rf"^/api/flow_runs/(?P<id>{_UUID})(/labels)?/?$"), CHANGE_RUN),
    ("DELETE", re.compile(rf"^/api/flow_runs/(?P<id>{_UUID})/?$"), CHANGE_RUN),
    ("POST", re.compile(r"^/api/variables/?$"), OWN_VARIABLE),
    ("PATCH", re.compile(r"^/api/variables/name/(?P<id>[^/]+)/?$"), OWN_VARIABLE),
    ("DELETE", re.compile(r"^/api/variables/name/(?P<id>[^/]+)/?$"), OWN_VARIABLE),
]

# Labels the agents write (placement, allocations that owner quotas count, idle marks, cluster plans) and
# Prefect's worker label: a user may not set them on a run, at creation or later.
AGENT_LABELS = ("launch.alloc", "launch.placement", "launch.waiting", "launch.idle", "launch.cluster.",
                "prefect.worker.")  # not "launch.cluster" itself: submit writes it on a cluster run

# POSTs that only read (filters, counts, pages, histories) and the UI's read-only helpers.
_READ_POST_LAST = {"filter", "count", "paginate", "history", "lateness"}

# What each API area holds, for refusal messages.
_AREAS = {"work_pools": "queues (work pools)", "work_queues": "work queues", "deployments": "deployments",
          "block_documents": "blocks", "block_types": "block types", "block_schemas": "block schemas",
          "automations": "automations", "variables": "variables", "concurrency_limits": "concurrency limits",
          "v2": "concurrency limits", "admin": "the server's administration", "flow_runs": "runs",
          "task_runs": "task runs", "logs": "logs", "artifacts": "artifacts", "events": "events",
          "flow_run_notification_policies": "notification policies", "saved_searches": "saved searches",
          "templates": "templates", "work_pool": "queues (work pools)"}


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


def _is_read_post(path: str) -> bool:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[1] == "ui":
        return True  # /api/ui/...: the UI's read-only summaries and schema validation
    if parts and parts[-1] in _READ_POST_LAST:
        return True
    return len(parts) >= 2 and parts[-2] == "count-by"  # /api/events/count-by/{countable}


def write_refusal(user: User, method: str, path: str) -> Optional[Refusal]:
    """None if ``user`` may send this request as far as the admin-only areas go, else the refusal.

    Deny by default for plain users: besides reads (GET, HEAD, OPTIONS, and POSTs that filter, count or
    page) a user may only do what :func:`classify` gives a rule (create and change runs, their own
    recent-sessions variable) and create a flow record (``POST /api/flows/``, harmless, needed to create a
    run). Everything else (queues, work queues, deployments, blocks, automations, variables, concurrency
    limits, logs, task runs, bulk run changes, the admin area) is for admins and agents. Reading the
    ``/api/admin`` area is for admins and agents too (the server's settings).
    """
    if user.is_admin or user.is_agent:
        return None
    parts = [p for p in path.split("/") if p]
    area = parts[1] if len(parts) >= 2 else ""
    if area == "admin" and not (len(parts) == 3 and parts[2] == "version" and method.upper() in ("GET", "HEAD")):
        return Refusal(403, f"user {user.name!r} may not use the server's administration (/api/admin): "
                            "only admins may")
    if method.upper() in ("GET", "HEAD", "OPTIONS"):
        return None
    if classify(method, path) is not None:
        return None  # a run or own-variable rule decides
    if method.upper() == "POST" and _is_read_post(path):
        return None
    if method.upper() == "POST" and parts in (["api", "flows"],):
        return None
    if user.is_run_key and (engine_write(method, path) or token_write(method, path)):
        return None  # token writes: the gateway then checks the block is the run's own session token
    what = _AREAS.get(area, area or "this")
    return Refusal(403, f"user {user.name!r} may not create, change or delete {what} ({method.upper()} {path}): "
                        "only admins (and agents) may")


def label_refusal(user: User, labels: object) -> Optional[Refusal]:
    """None if ``user`` may set these run labels; a plain user may not set the agents' labels."""
    if user.is_admin or user.is_agent or not isinstance(labels, dict):
        return None
    bad = sorted(k for k in labels if isinstance(k, str) and k.startswith(AGENT_LABELS))
    if bad:
        return Refusal(403, f"user {user.name!r} may not set the label {bad[0]!r}: labels starting with "
                            f"{', '.join(AGENT_LABELS)} are written by the agents")
    return None


MONITOR_SERVER_ID = "prefect_launch_server_id"  # dashboard.api.SERVER_ID_VARIABLE: made by the first monitor


def own_variable_refusal(user: User, name: object, creating: bool = False) -> Optional[Refusal]:
    """A plain user may write one variable: their recent-sessions list (``launch_recent_<user>``); and may
    create (not change) the monitor's server id, which the first monitor to ask makes (the server answers
    409 if it exists)."""
    if user.is_admin or user.is_agent:
        return None
    from prefect_launch.deployments.session_recent import variable_name

    mine = variable_name(user.name)
    if name == mine or (creating and name == MONITOR_SERVER_ID):
        return None
    return Refusal(403, f"user {user.name!r} may not create, change or delete variable {name!r}: a user may "
                        f"write only their own recent-sessions list ({mine!r}); other variables are for admins")


_SECRET_BY_NAME = re.compile(r"^/api/block_types/slug/(?P<slug>[^/]+)/block_documents/name/(?P<name>[^/]+)/?$")
_SESSION_TOKEN = re.compile(rf"^session-token-(?P<run>{_UUID})$")
_BLOCK_READS = re.compile(r"^/api/(block_documents(/.*)?|block_types/slug/[^/]+/block_documents(/.*)?)$")


class SecretRead(NamedTuple):
    """How a plain user's block read is handled: ``run_id`` (a session token: its run's owner may read it),
    ``refuse`` (a Secret by name: 403), or else ``include_secrets`` is forced off (values come back masked)."""
    block_read: bool
    name: Optional[str] = None
    run_id: Optional[str] = None
    refuse: bool = False


def secret_read(user: User, method: str, path: str, include_secrets: bool) -> SecretRead:
    """Whether this is a block read whose secret values ``user`` may not see, and what to do about it."""
    if user.is_admin or user.is_agent or not _BLOCK_READS.match(path):
        return SecretRead(False)
    m = _SECRET_BY_NAME.match(path)
    if m and method.upper() in ("GET", "HEAD") and include_secrets and m.group("slug") == "secret":
        token = _SESSION_TOKEN.match(m.group("name"))
        return SecretRead(True, name=m.group("name"), run_id=token.group("run") if token else None,
                          refuse=token is None)
    return SecretRead(True)


def secret_refusal(user: User, name: str, owner: Optional[str] = None) -> Refusal:
    whose = f" (the session of {owner!r})" if owner else ""
    return Refusal(403, f"user {user.name!r} may not read the value of Secret block {name!r}{whose}: only "
                        "admins, agents and (for a session's token) the session's owner may")


# What a run's engine writes besides its run's states (which the run rules decide): its log lines, artifacts,
# and global concurrency slots (``concurrency()`` in a task or flow).
_ENGINE_WRITES = [re.compile(p) for p in (r"^/api/logs/?$", r"^/api/artifacts/?$",
                                          r"^/api/v2/concurrency_limits/(increment|decrement)(-with-lease)?/?$",
                                          r"^/api/v2/concurrency_limits/leases/[^/]+/renew/?$",
                                          r"^/api/concurrency_limits/(increment|decrement)/?$")]


def engine_write(method: str, path: str) -> bool:
    """Whether this request is one a run's engine makes that a plain user's key may not (a run key may)."""
    return method.upper() == "POST" and any(p.match(path) for p in _ENGINE_WRITES)


_RUN_ID = re.compile(rf"^{_UUID}$")


def is_run_id(text: str) -> bool:
    return bool(_RUN_ID.match(text or ""))


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def run_key_refusal(user: User, run: Optional[dict]) -> Optional[Refusal]:
    """None if ``user`` may obtain a key for ``run`` (the flow run as the server has it; None: not found).

    Only agents may (they start runs); the run must exist, not have ended, and have an ``owner:`` tag (the
    gateway sets it on every run made through it), since the key acts as that owner."""
    if not user.is_agent:
        return Refusal(403, f"user {user.name!r} may not obtain run keys: only agents' keys may (they start runs)")
    if run is None:
        return Refusal(404, "no such flow run")
    state = (run.get("state") or {}).get("type") if isinstance(run.get("state"), dict) else None
    if state in FINAL_STATES:
        return Refusal(409, f"flow run {run.get('id')} has ended ({state}): it gets no key")
    if not tag_value(run.get("tags"), OWNER):
        return Refusal(409, f"flow run {run.get('id')} has no owner: tag, so its key could act for no one: launch "
                            "runs through the gateway (it sets the owner), and give a deployment with a schedule an "
                            "owner:<user> tag (its scheduled runs carry it)")
    return None


def run_key_ended(run: Optional[dict], now: float, grace_s: float) -> bool:
    """Whether a run key of ``run`` must stop working: the run is gone, or has been in a final state for more than
    ``grace_s`` seconds (its process flushes its last logs and events after its final state)."""
    if run is None:
        return True
    state = run.get("state") if isinstance(run.get("state"), dict) else {}
    if state.get("type") not in FINAL_STATES:
        return False
    try:
        when = datetime.fromisoformat(str(state.get("timestamp")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return True
    return now - when > grace_s


# A session's job stores its token as the Secret block session-token-<its run id> (flows/session.py) and drops it.
_TOKEN_WRITES = [("POST", re.compile(r"^/api/block_documents/?$")),
                 ("PATCH", re.compile(rf"^/api/block_documents/{_UUID}/?$")),
                 ("DELETE", re.compile(rf"^/api/block_documents/{_UUID}/?$"))]


def token_write(method: str, path: str) -> bool:
    """Whether this request writes a block document (what a run key may do for its own session token only)."""
    return any(method.upper() == m and p.match(path) for m, p in _TOKEN_WRITES)


def token_write_refusal(user: User, name: object) -> Optional[Refusal]:
    """None if ``user`` (a run key) may write the block named ``name``: its own run's session token only."""
    if user.is_run_key and name == f"session-token-{user.run_id}":
        return None
    return Refusal(403, f"user {user.name!r} may not create, change or delete block {name!r}: a run's key may write "
                        "only its own session's token (session-token-<its run id>); other blocks are for admins")
