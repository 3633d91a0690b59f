"""Who may use the box (issue 40): users, projects and the access of a queue, as pydantic models.

A user has a role (:data:`ROLES`: ``admin`` manages users and may act for anyone, ``user`` launches and
changes their own runs, ``agent`` is what an agent's key is: it changes any run's state), belongs to
projects, and holds API keys (:mod:`prefect_launch.blocks.identity_keys`). The tables are version 9 of
:mod:`prefect_launch.blocks.metrics_schema`; reads and writes :mod:`prefect_launch.blocks.identity_repository`.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ADMIN", "USER", "AGENT", "ROLES", "User", "Project", "KeyInfo", "QueueAccess", "check_name"]

ADMIN, USER, AGENT = "admin", "user", "agent"
ROLES = (ADMIN, USER, AGENT)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,62}$")


def check_name(name: str, what: str = "user") -> str:
    """``name`` if it can be a user or project name (it becomes an ``owner:``/``project:`` tag), else ValueError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} name {name!r} is not allowed: use 1-63 letters, digits, '.', '_', '@' or '-', "
                         "starting with a letter or digit")
    return name


class User(BaseModel):
    """A user as the gateway sees one once a key is verified."""

    model_config = ConfigDict(frozen=True)

    name: str
    role: str = USER
    disabled: bool = False
    projects: tuple[str, ...] = ()
    created: Optional[datetime] = None
    run_id: Optional[str] = None  # set when the key was a run key: the run it is bound to (it acts as its owner)
    key_id: Optional[str] = None  # a run key's id (its revocation names it)

    @property
    def is_run_key(self) -> bool:
        return self.run_id is not None

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN

    @property
    def is_agent(self) -> bool:
        return self.role == AGENT


class Project(BaseModel):
    name: str
    members: tuple[str, ...] = ()
    created: Optional[datetime] = None


class KeyInfo(BaseModel):
    """A key as listings show it: never its secret."""

    key_id: str
    user: str
    created: Optional[datetime] = None
    revoked: Optional[datetime] = None
    last_used: Optional[datetime] = None
    run_id: Optional[str] = None  # a run key's run
    expires: Optional[datetime] = None


class QueueAccess(BaseModel):
    """Who a queue is open to; both empty: open to every user."""

    queue: str
    users: tuple[str, ...] = Field(default=())
    projects: tuple[str, ...] = Field(default=())

    @property
    def open_to_all(self) -> bool:
        return not self.users and not self.projects

    def allows(self, user: User) -> bool:
        """Admins always; else the user by name or by one of their projects."""
        if user.is_admin or self.open_to_all:
            return True
        return user.name in self.users or any(p in self.projects for p in user.projects)
