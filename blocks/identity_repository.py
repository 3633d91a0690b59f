"""Users, projects, API keys and queue access in the metrics store's database (schema v9).

:class:`IdentityRepository` reads and writes the identity tables of
:mod:`prefect_launch.blocks.metrics_schema` through the store's cached engines (SQLite or PostgreSQL,
upgraded on first use). Keys are made by :mod:`prefect_launch.blocks.identity_keys`: the plaintext is
returned once by :meth:`add_user` / :meth:`rotate_key` and never stored.

Typical use::

    repo = IdentityRepository(store_url())
    user, key = repo.add_user("alice", projects=["vision"])   # print key once
    repo.verify(key)                                           # -> User, or None
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterable, Iterator, Optional

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_launch.blocks import identity_keys as K
from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.identity_records import (ROLES, USER, KeyInfo, Project, QueueAccess, User,
                                                    check_name)
from prefect_launch.blocks.metrics_engines import engine_for

__all__ = ["IdentityRepository", "IdentityError", "store_url"]


class IdentityError(ValueError):
    """A request the identity tables cannot satisfy (unknown user, name taken...): its message says what."""


def store_url() -> str:
    """The metrics store's URL, as the monitor finds it: ``LAUNCH_METRICS_URL``, else the block
    ``LAUNCH_METRICS_BLOCK`` (default "default") on the Prefect server, else SQLite under PREFECT_HOME."""
    from prefect_launch.blocks.metrics_store import RunMetricsStore

    if os.environ.get("LAUNCH_METRICS_URL"):
        return os.environ["LAUNCH_METRICS_URL"]
    try:
        return RunMetricsStore.load(os.environ.get("LAUNCH_METRICS_BLOCK", "default"), _sync=True).resolved_url()
    except Exception:
        return RunMetricsStore().resolved_url()


def _checked(name: str, what: str = "user") -> str:
    try:
        return check_name(name, what)
    except ValueError as exc:
        raise IdentityError(str(exc)) from None


def _ms(dt: Optional[int]) -> Optional[datetime]:
    return None if dt is None else datetime.fromtimestamp(dt / 1000, tz=timezone.utc)


def _now_ms() -> int:
    return int(time.time() * 1000)


class IdentityRepository:
    """The identity tables behind one SQLAlchemy URL (engines are shared per URL and thread-safe)."""

    LAST_USED_EVERY_MS = 60_000  # a key's last-used time is written at most once a minute

    def __init__(self, url: str) -> None:
        self.url = url

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with engine_for(self.url).connect().execution_options(launch_write=True) as conn:
            with conn.begin():
                yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with engine_for(self.url).connect() as conn:
            with conn.begin():
                yield conn

    # ---------------------------------------------------------------- projects

    def _project_ids(self, conn: Connection, names: Iterable[str], create: bool = False) -> dict[str, int]:
        names = list(dict.fromkeys(names))
        found = dict(conn.execute(sa.select(S.projects.c.name, S.projects.c.id)
                                  .where(S.projects.c.name.in_(names))).all()) if names else {}
        missing = [n for n in names if n not in found]
        if missing and not create:
            raise IdentityError(f"no project {missing[0]!r}: create it with `prefect-launch project add {missing[0]}`")
        for n in missing:
            found[n] = conn.execute(S.projects.insert().values(name=_checked(n, "project"),
                                                               created_ms=_now_ms())).inserted_primary_key[0]
        return found

    def add_project(self, name: str) -> Project:
        _checked(name, "project")
        with self._write() as conn:
            if conn.execute(sa.select(S.projects.c.id).where(S.projects.c.name == name)).first():
                raise IdentityError(f"project {name!r} exists already")
            self._project_ids(conn, [name], create=True)
        return self.projects(name)[0]

    def projects(self, name: Optional[str] = None) -> list[Project]:
        with self._read() as conn:
            q = sa.select(S.projects).order_by(S.projects.c.name)
            if name is not None:
                q = q.where(S.projects.c.name == name)
            rows = conn.execute(q).all()
            members = conn.execute(sa.select(S.project_members.c.project_id, S.users.c.name)
                                   .join(S.users, S.users.c.id == S.project_members.c.user_id)
                                   .order_by(S.users.c.name)).all()
        by = {}
        for pid, uname in members:
            by.setdefault(pid, []).append(uname)
        return [Project(name=r.name, members=tuple(by.get(r.id, ())), created=_ms(r.created_ms)) for r in rows]

    # ------------------------------------------------------------------- users

    def add_user(self, name: str, role: str = USER, projects: Iterable[str] = ()) -> tuple[User, str]:
        """Create ``name`` with one API key; returns the user and the key's plaintext (show it once)."""
        _checked(name)
        if role not in ROLES:
            raise IdentityError(f"role {role!r} is not one of {', '.join(ROLES)}")
        key = K.new_key()
        with self._write() as conn:
            if conn.execute(sa.select(S.users.c.id).where(S.users.c.name == name)).first():
                raise IdentityError(f"user {name!r} exists already; `prefect-launch user key rotate {name}` "
                                    "gives a new key")
            uid = conn.execute(S.users.insert().values(name=name, role=role, disabled=False,
                                                       created_ms=_now_ms())).inserted_primary_key[0]
            for pid in self._project_ids(conn, projects).values():
                conn.execute(S.project_members.insert().values(project_id=pid, user_id=uid))
            self._insert_key(conn, uid, key)
        return self.user(name), key.plaintext

    @staticmethod
    def _insert_key(conn: Connection, uid: int, key: K.NewKey) -> None:
        conn.execute(S.api_keys.insert().values(key_id=key.key_id, user_id=uid, salt=key.salt, hash=key.hash,
                                                created_ms=_now_ms()))

    def _uid(self, conn: Connection, name: str) -> int:
        uid = conn.execute(sa.select(S.users.c.id).where(S.users.c.name == name)).scalar()
        if uid is None:
            raise IdentityError(f"no user {name!r}: `prefect-launch user ls` lists them")
        return uid

    def users(self) -> list[User]:
        with self._read() as conn:
            rows = conn.execute(sa.select(S.users).order_by(S.users.c.name)).all()
            member = conn.execute(sa.select(S.project_members.c.user_id, S.projects.c.name)
                                  .join(S.projects, S.projects.c.id == S.project_members.c.project_id)
                                  .order_by(S.projects.c.name)).all()
        by: dict[int, list[str]] = {}
        for uid, pname in member:
            by.setdefault(uid, []).append(pname)
        return [User(name=r.name, role=r.role, disabled=bool(r.disabled), projects=tuple(by.get(r.id, ())),
                     created=_ms(r.created_ms)) for r in rows]

    def user(self, name: str) -> User:
        for u in self.users():
            if u.name == name:
                return u
        raise IdentityError(f"no user {name!r}: `prefect-launch user ls` lists them")

    def set_disabled(self, name: str, disabled: bool = True) -> User:
        with self._write() as conn:
            uid = self._uid(conn, name)
            conn.execute(S.users.update().where(S.users.c.id == uid).values(disabled=disabled))
        return self.user(name)

    def join(self, name: str, projects: Iterable[str]) -> User:
        with self._write() as conn:
            uid = self._uid(conn, name)
            have = set(conn.execute(sa.select(S.project_members.c.project_id)
                                    .where(S.project_members.c.user_id == uid)).scalars())
            for pid in self._project_ids(conn, projects).values():
                if pid not in have:
                    conn.execute(S.project_members.insert().values(project_id=pid, user_id=uid))
        return self.user(name)

    # -------------------------------------------------------------------- keys

    def rotate_key(self, name: str) -> str:
        """Revoke every key of ``name`` and make a new one; returns its plaintext (show it once)."""
        key = K.new_key()
        with self._write() as conn:
            uid = self._uid(conn, name)
            conn.execute(S.api_keys.update().where(S.api_keys.c.user_id == uid, S.api_keys.c.revoked_ms.is_(None),
                                                   S.api_keys.c.run_id.is_(None))  # running jobs keep theirs
                         .values(revoked_ms=_now_ms()))
            self._insert_key(conn, uid, key)
        return key.plaintext

    def revoke_key(self, key_id: str) -> None:
        with self._write() as conn:
            n = conn.execute(S.api_keys.update().where(S.api_keys.c.key_id == key_id,
                                                       S.api_keys.c.revoked_ms.is_(None))
                             .values(revoked_ms=_now_ms())).rowcount
        if not n:
            raise IdentityError(f"no active key {key_id!r}")

    def keys(self, name: Optional[str] = None) -> list[KeyInfo]:
        with self._read() as conn:
            q = (sa.select(S.api_keys, S.users.c.name.label("user"))
                 .join(S.users, S.users.c.id == S.api_keys.c.user_id).order_by(S.api_keys.c.id))
            if name is not None:
                q = q.where(S.users.c.name == name)
            rows = conn.execute(q).all()
        return [KeyInfo(key_id=r.key_id, user=r.user, created=_ms(r.created_ms), revoked=_ms(r.revoked_ms),
                        last_used=_ms(r.last_used_ms), run_id=r.run_id, expires=_ms(r.expires_ms)) for r in rows]

    def mint_run_key(self, owner: str, run_id: str, ttl_s: float) -> str:
        """A key bound to flow run ``run_id`` acting as its ``owner`` (an enabled user), valid ``ttl_s`` seconds
        at most; returns its plaintext (it goes into the run's environment, never stored)."""
        key = K.new_key(fast=True)
        with self._write() as conn:
            row = conn.execute(sa.select(S.users.c.id, S.users.c.disabled, S.users.c.role)
                               .where(S.users.c.name == owner)).first()
            if row is None or row.disabled:
                raise IdentityError(f"the run's owner {owner!r} is not an enabled user of this gateway, so its run "
                                    "gets no key: launch runs through the gateway (it sets the owner)")
            now = _now_ms()
            conn.execute(S.api_keys.insert().values(key_id=key.key_id, user_id=row.id, salt=key.salt, hash=key.hash,
                                                    created_ms=now, run_id=str(run_id),
                                                    expires_ms=now + int(ttl_s * 1000)))
        return key.plaintext

    def revoke_run_keys(self, run_id: str, key_ids: Optional[Iterable[str]] = None) -> int:
        """Revoke the live keys of run ``run_id`` (its process ended): those of ``key_ids`` (a life of the run:
        a preempted run's next life has its own key by then), else all; returns how many."""
        where = [S.api_keys.c.run_id == str(run_id), S.api_keys.c.revoked_ms.is_(None)]
        if key_ids is not None:
            where.append(S.api_keys.c.key_id.in_(list(key_ids)))
        with self._write() as conn:
            return conn.execute(S.api_keys.update().where(*where).values(revoked_ms=_now_ms())).rowcount

    def verify(self, key: str, user_name: Optional[str] = None) -> Optional[User]:
        """The enabled user whose live key ``key`` is (and named ``user_name`` when given), else None.

        The secret is checked with scrypt and compared in constant time; a key that does not parse, an
        unknown key id, a revoked key and a disabled user all give None alike."""
        parts = K.split_key(key)
        if parts is None:
            return None
        key_id, secret = parts
        with self._read() as conn:
            row = conn.execute(
                sa.select(S.api_keys.c.id, S.api_keys.c.salt, S.api_keys.c.hash, S.api_keys.c.revoked_ms,
                          S.api_keys.c.last_used_ms, S.api_keys.c.run_id, S.api_keys.c.expires_ms, S.users.c.name,
                          S.users.c.disabled)
                .join(S.users, S.users.c.id == S.api_keys.c.user_id).where(S.api_keys.c.key_id == key_id)).first()
        if row is None:
            K.verify_secret(secret, "00" * 16, "00" * K.DKLEN)  # same work for an unknown id
            return None
        if not K.verify_secret(secret, row.salt, row.hash, fast=row.run_id is not None):
            return None
        now = _now_ms()
        if row.revoked_ms is not None or row.disabled or (user_name is not None and user_name != row.name):
            return None
        if row.expires_ms is not None and now >= row.expires_ms:
            return None
        if row.last_used_ms is None or now - row.last_used_ms >= self.LAST_USED_EVERY_MS:
            with self._write() as conn:
                conn.execute(S.api_keys.update().where(S.api_keys.c.id == row.id).values(last_used_ms=now))
        user = self.user(row.name)
        if row.run_id is not None:  # a run key acts as its run's owner, a plain user whatever the owner's role
            return user.model_copy(update={"run_id": row.run_id, "role": USER, "key_id": key_id})
        return user

    # ------------------------------------------------------------ queue access

    def set_queue_access(self, queue: str, users: Iterable[str] = (), projects: Iterable[str] = ()) -> QueueAccess:
        """Open ``queue`` to exactly these users and projects (both empty: to every user)."""
        users, projects = list(dict.fromkeys(users)), list(dict.fromkeys(projects))
        with self._write() as conn:
            for u in users:
                self._uid(conn, u)
            self._project_ids(conn, projects)
            conn.execute(S.queue_access.delete().where(S.queue_access.c.queue == queue))
            rows = [{"queue": queue, "kind": "user", "name": u} for u in users]
            rows += [{"queue": queue, "kind": "project", "name": p} for p in projects]
            if rows:
                conn.execute(S.queue_access.insert(), rows)
        return self.queue_access(queue)

    def queue_access(self, queue: str) -> QueueAccess:
        with self._read() as conn:
            rows = conn.execute(sa.select(S.queue_access.c.kind, S.queue_access.c.name)
                                .where(S.queue_access.c.queue == queue).order_by(S.queue_access.c.name)).all()
        return QueueAccess(queue=queue, users=tuple(n for k, n in rows if k == "user"),
                           projects=tuple(n for k, n in rows if k == "project"))

    def all_queue_access(self) -> list[QueueAccess]:
        with self._read() as conn:
            queues = conn.execute(sa.select(S.queue_access.c.queue).distinct().order_by(S.queue_access.c.queue)).scalars().all()
        return [self.queue_access(q) for q in queues]
