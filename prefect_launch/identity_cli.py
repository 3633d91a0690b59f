"""`prefect-launch user`, `project`, `access` and `gateway`: who may use the box, and the door they use (issue 40).

Users, projects, keys and queue access live in the metrics store's database
(:mod:`prefect_launch.blocks.identity_repository`; the store is ``LAUNCH_METRICS_URL``, else the block
``LAUNCH_METRICS_BLOCK``, else SQLite under PREFECT_HOME). A key is printed once, when it is made
(`user add`, `user key rotate`), and never again. `gateway` serves Prefect's API in front of the server
(:mod:`prefect_launch.gateway_app`). Registered on the main app by ``prefect_launch.cli``.
"""

from __future__ import annotations

from typing import Any, List, Optional

import typer
from rich.table import Table

from prefect_launch.cli_common import console, err, fail, print_json

user_app = typer.Typer(help="Users of the gateway: roles, projects and API keys.", no_args_is_help=True)
key_app = typer.Typer(help="A user's API keys.", no_args_is_help=True)
project_app = typer.Typer(help="Projects users belong to (queues can be opened to a project).", no_args_is_help=True)
access_app = typer.Typer(help="Which users and projects a queue is open to (the gateway enforces it).",
                         no_args_is_help=True)
user_app.add_typer(key_app, name="key")


def _repo() -> Any:
    from prefect_launch.blocks.identity_repository import IdentityRepository, store_url

    try:
        return IdentityRepository(store_url())
    except Exception as exc:  # no password in the message: store_url's errors do not carry it
        fail(f"cannot open the metrics store's database: {str(exc).splitlines()[0][:200]}")


def _run(call: Any) -> Any:
    from prefect_launch.blocks.identity_repository import IdentityError

    try:
        return call()
    except IdentityError as exc:
        fail(str(exc))


def _show_key(user: str, key: str, as_json: bool, extra: Optional[dict] = None) -> None:
    if as_json:
        print_json({"user": user, "key": key, **(extra or {})})
        return
    console.print(f"API key for [bold]{user}[/] (shown once, keep it now):", highlight=False)
    console.print(key, highlight=False, soft_wrap=True)
    err.print("give it as PREFECT_API_AUTH_STRING=<user>:<key> (HTTP and events) or PREFECT_API_KEY=<key> (HTTP), "
              "with PREFECT_API_URL pointing at the gateway", highlight=False)


def _user_dict(u: Any) -> dict:
    return {"name": u.name, "role": u.role, "disabled": u.disabled, "projects": list(u.projects),
            "created": u.created.isoformat() if u.created else None}


@user_app.command("add")
def user_add(name: str = typer.Argument(..., help="User name (becomes the owner: tag of their runs)"),
             project: Optional[List[str]] = typer.Option(None, "--project", "-p", help="A project the user belongs "
                                                         "to (repeat); created if missing"),
             admin: bool = typer.Option(False, "--admin", help="An admin: manages users, acts for anyone."),
             agent: bool = typer.Option(False, "--agent", help="An agent's user: changes any run's state."),
             as_json: bool = typer.Option(False, "--json", help="Print the user and key as JSON.")) -> None:
    """Create a user with one API key, printed once."""
    if admin and agent:
        fail("give --admin or --agent, not both")
    repo = _repo()
    role = "admin" if admin else "agent" if agent else "user"
    known = {p.name for p in _run(repo.projects)}
    for p in project or []:
        if p not in known:
            _run(lambda p=p: repo.add_project(p))
    user, key = _run(lambda: repo.add_user(name, role=role, projects=project or []))
    _show_key(user.name, key, as_json, {"role": user.role, "projects": list(user.projects)})


@user_app.command("ls")
def user_ls(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Users, their role, projects, and their keys' last use (never the keys)."""
    repo = _repo()
    users, keys = _run(repo.users), _run(repo.keys)
    live: dict[str, list] = {}
    for k in keys:
        if k.revoked is None and k.run_id is None:  # the user's own keys, not their running jobs' run keys
            live.setdefault(k.user, []).append(k)
    rows = []
    for u in users:
        d = _user_dict(u)
        ks = live.get(u.name, [])
        used = [k.last_used for k in ks if k.last_used]
        d.update(keys=len(ks), last_used=max(used).isoformat() if used else None)
        rows.append(d)
    if as_json:
        print_json(rows)
        return
    t = Table(title="users")
    for c in ("name", "role", "projects", "keys", "last used", "state"):
        t.add_column(c)
    for d in rows:
        t.add_row(d["name"], d["role"], ", ".join(d["projects"]) or "-", str(d["keys"]), d["last_used"] or "never",
                  "disabled" if d["disabled"] else "active")
    console.print(t)


@user_app.command("disable")
def user_disable(name: str = typer.Argument(...),
                 enable: bool = typer.Option(False, "--enable", help="Enable the user again instead.")) -> None:
    """Disable a user: every key of theirs stops working at the gateway (within its key cache time)."""
    u = _run(lambda: _repo().set_disabled(name, not enable))
    console.print(f"user [bold]{u.name}[/]: {'disabled' if u.disabled else 'enabled'}", highlight=False)


@user_app.command("join")
def user_join(name: str = typer.Argument(...),
              project: List[str] = typer.Option(..., "--project", "-p", help="Project to join (repeat).")) -> None:
    """Add a user to projects."""
    u = _run(lambda: _repo().join(name, project))
    console.print(f"user [bold]{u.name}[/]: projects {', '.join(u.projects)}", highlight=False)


@key_app.command("rotate")
def key_rotate(name: str = typer.Argument(...),
               as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Revoke the user's keys and print a new one, once."""
    key = _run(lambda: _repo().rotate_key(name))
    _show_key(name, key, as_json)


@key_app.command("ls")
def key_ls(name: Optional[str] = typer.Argument(None, help="Only this user's keys."),
           as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Keys by their public id: created, revoked, last used, and a run key's run (never the secret)."""
    keys = _run(lambda: _repo().keys(name))
    rows = [k.model_dump(mode="json") for k in keys]
    if as_json:
        print_json(rows)
        return
    t = Table(title="API keys")
    for c in ("key id", "user", "created", "revoked", "last used", "run (run keys)"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["key_id"], r["user"], r["created"] or "", r["revoked"] or "-", r["last_used"] or "never",
                  r["run_id"] or "-")
    console.print(t)


@key_app.command("revoke")
def key_revoke(key_id: str = typer.Argument(..., help="The key's public id (`user key ls`).")) -> None:
    """Revoke one key."""
    _run(lambda: _repo().revoke_key(key_id))
    console.print(f"key {key_id}: revoked", highlight=False)


@project_app.command("add")
def project_add(name: str = typer.Argument(...),
                as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Create a project."""
    p = _run(lambda: _repo().add_project(name))
    if as_json:
        print_json(p.model_dump(mode="json"))
    else:
        console.print(f"project [bold]{p.name}[/]: created", highlight=False)


@project_app.command("ls")
def project_ls(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Projects and their members."""
    rows = [p.model_dump(mode="json") for p in _run(_repo().projects)]
    if as_json:
        print_json(rows)
        return
    t = Table(title="projects")
    t.add_column("name")
    t.add_column("members")
    for r in rows:
        t.add_row(r["name"], ", ".join(r["members"]) or "-")
    console.print(t)


@access_app.command("set")
def access_set(queue: str = typer.Argument(..., help="The launch queue (work pool)."),
               user: Optional[List[str]] = typer.Option(None, "--user", "-u", help="Open to this user (repeat)."),
               project: Optional[List[str]] = typer.Option(None, "--project", "-p",
                                                           help="Open to this project's members (repeat)."),
               as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Open QUEUE to exactly these users and projects; with neither, to every user. Admins always may."""
    acc = _run(lambda: _repo().set_queue_access(queue, user or [], project or []))
    _print_access([acc], as_json)


@access_app.command("ls")
def access_ls(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """The queues that are not open to every user."""
    _print_access(_run(_repo().all_queue_access), as_json)


def _print_access(rows: list, as_json: bool) -> None:
    if as_json:
        print_json([a.model_dump() for a in rows])
        return
    if not rows:
        console.print("every queue is open to every user")
    for a in rows:
        who = [f"user {u}" for u in a.users] + [f"project {p}" for p in a.projects]
        console.print(f"queue [bold]{a.queue}[/]: " + (", ".join(who) if who else "open to every user"),
                      highlight=False)


def gateway(host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on."),
            port: int = typer.Option(4280, "--port", help="Port to serve on."),
            upstream: Optional[str] = typer.Option(None, "--upstream", help="The Prefect server's API URL "
                                                   "(default: PREFECT_API_URL)")) -> None:
    """Serve Prefect's API (and UI) with every request authenticated by a user's key, and forward it to the
    Prefect server, which then listens on loopback only. See docs/security.md."""
    import os

    import uvicorn

    from prefect_launch.blocks.identity_repository import store_url
    from prefect_launch.gateway_app import GatewayConfig, create_app

    target = upstream or os.environ.get("PREFECT_API_URL")
    if not target:
        fail("no Prefect server to forward to: give --upstream http://127.0.0.1:4200/api or set PREFECT_API_URL")
    app = create_app(GatewayConfig.from_env(upstream=target, store_url=store_url()))
    console.print(f"gateway on http://{host}:{port}/api -> {target}", highlight=False)
    # loopback relays: no per-message deflate (it would cost the gateway a decompress and a compress per event)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, ws="websockets",
                ws_per_message_deflate=False)
