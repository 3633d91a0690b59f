"""`prefect-launch session ...`: start, list, inspect, follow, rename and terminate compute sessions."""

from __future__ import annotations

import getpass
import json
import time
from typing import List, Optional

import typer

from prefect_launch.cli_common import console, fail, prefect_client, print_json, starts_at_option

session_app = typer.Typer(help="Batch and interactive compute sessions (Backend.AI-style).", no_args_is_help=True)


def _owner(owner: Optional[str]) -> str:
    return owner or getpass.getuser()


def _ports(value: Optional[List[str]]) -> list[int]:
    out = []
    for p in value or []:
        try:
            out.append(int(p))
        except ValueError:
            fail(f"--port {p!r} is not a number; give a port 1024-65535")
    return out


@session_app.command("start")
def session_start(
    type_: str = typer.Option("interactive", "--type", help="batch or interactive"),
    queue: str = typer.Option(..., "--queue", "-q"),
    name: Optional[str] = typer.Option(None, "--name"),
    preset: Optional[str] = typer.Option(None, "--preset", "-p"),
    cpu: Optional[float] = typer.Option(None, "--cpu"),
    memory: Optional[str] = typer.Option(None, "--memory"),
    gpu: Optional[int] = typer.Option(None, "--gpu"),
    shm_size: Optional[str] = typer.Option(None, "--shm-size"),
    image: Optional[str] = typer.Option(None, "--image", help="Environment image (docker queues)"),
    env: Optional[List[str]] = typer.Option(None, "--env", help="NAME=value; repeatable"),
    mount: Optional[List[str]] = typer.Option(None, "--mount", help="HOST_FOLDER:PATH; repeatable"),
    port: Optional[List[str]] = typer.Option(None, "--port", help="Port for the session's apps; repeatable"),
    count: int = typer.Option(1, "--count"),
    owner: Optional[str] = typer.Option(None, "--owner"),
    startup_command: Optional[str] = typer.Option(None, "--startup-command", help="Batch: the command to run"),
    starts_at: Optional[str] = typer.Option(None, "--starts-at", parser=starts_at_option, metavar="TIME",
                                            help="Batch: ISO date or time (no offset: UTC), or a delay from now: "
                                                 "90s, 1h30m, 2d"),
    timeout: Optional[str] = typer.Option(None, "--timeout", help="Batch: end it Failed after e.g. 30m"),
    omp_threads: Optional[int] = typer.Option(None, "--omp-threads"),
    priority: Optional[str] = typer.Option(None, "--priority"),
    agent: Optional[str] = typer.Option(None, "--agent"),
    preemptible: bool = typer.Option(False, "--preemptible", help="Fill idle hardware; may be preempted by "
                                     "regular work (then it waits again, keeping its submit time)"),
    cluster_size: Optional[int] = typer.Option(
        None, "--cluster-size", help="A cluster session of N members (main1, sub1, ...), each with the preset; "
                                     "batch: every member runs the command with its RANK; interactive: main1 "
                                     "serves the apps"),
    cluster_mode: Optional[str] = typer.Option(None, "--cluster-mode", help="single-node (default) or multi-node"),
    expose: bool = typer.Option(False, "--expose", help="Interactive: apps listen on the agent host's addresses "
                                "(the URL then names the host; the token is still required); default: loopback "
                                "only, reached through an SSH tunnel from another machine"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved session and every error; start nothing"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Start COUNT sessions (all or none); `--dry-run` shows what would start and every problem at once."""
    from prefect_launch.deployments.sessions import SessionRequest, start_session
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    if type_ not in ("batch", "interactive"):
        fail(f"--type must be batch or interactive, got {type_!r}")
    req = SessionRequest(type=type_, queue=queue, name=name, preset=preset, cpu=cpu, memory=memory, gpu=gpu,
                         shm_size=shm_size, image=image, env=list(env or []), mounts=list(mount or []),
                         ports=_ports(port), count=count, owner=owner, startup_command=startup_command,
                         starts_at=starts_at, timeout=timeout, omp_threads=omp_threads, priority=priority,
                         agent=agent, preemptible=preemptible, cluster_size=cluster_size, cluster_mode=cluster_mode,
                         expose=expose)
    try:
        with prefect_client() as client:
            out = start_session(client, req, dry_run=dry_run)
    except LaunchValidationError as exc:
        fail(str(exc))
    if as_json:
        print_json(out.model_dump(mode="json"))
        return
    verb = "would start" if dry_run else "started"
    console.print(f"{verb} {len(out.names)} {out.type} session(s) on [bold]{out.queue}[/] "
                    f"(preset {out.preset}: {out.resources}"
                    + (f" per member; cluster of {out.cluster_size}, {out.cluster_mode}" if out.cluster_size > 1 else "")
                    + (", preemptible" if out.preemptible else "") + ")", highlight=False)
    for rid, n in zip(out.run_ids or [""] * len(out.names), out.names):
        console.print(f"  {rid or '-'}  {n}", highlight=False)
    for w in out.warnings:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)


@session_app.command("ls")
def session_ls(owner: Optional[str] = typer.Option(None, "--owner", help="Default: you"),
               all_owners: bool = typer.Option(False, "--all", help="Every owner's sessions"),
               ended: bool = typer.Option(False, "--ended", help="Include ended sessions"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Sessions with status, type, queue, resources, elapsed or waited time, agent, queue position."""
    from rich.table import Table

    from prefect_launch.deployments.session_view import list_sessions

    with prefect_client() as client:
        rows = list_sessions(client, owner=None if all_owners else _owner(owner), include_ended=ended)
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table(title="sessions")
    for col in ("id", "name", "status", "type", "queue", "resources", "time", "agent", "position", "eta", "why"):
        table.add_column(col, overflow="fold")
    for r in rows:
        t = f"ran {r.elapsed_s:.0f}s" if r.elapsed_s is not None else (f"waited {r.waited_s:.0f}s" if r.waited_s else "-")
        table.add_row(r.id[:8], r.name, r.status, r.type or "-", r.queue or "-", r.resources or "-", t,
                      r.agent or "-", str(r.position or "-"), f"{r.eta:%H:%M:%S}" if r.eta else "-", r.reason or "")
    console.print(table)


@session_app.command("show")
def session_show(session: str = typer.Argument(..., help="Name or id"),
                 owner: Optional[str] = typer.Option(None, "--owner"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """One session: owner, status, type, env, mounts, allocation, times, agent, usage, app URLs, idle checks."""
    from datetime import datetime, timezone

    from prefect_launch.deployments.session_view import app_tunnel, app_urls, find_session, idle_checks_of, row_of

    with prefect_client() as client:
        try:
            fr = find_session(client, session, _owner(owner))
        except LookupError as exc:
            fail(str(exc))
        urls = app_urls(client, fr)
        tunnel = app_tunnel(client, fr) if urls else None
    now = datetime.now(timezone.utc)
    row = row_of(fr, now)
    jv = fr.job_variables or {}
    data = {**row.model_dump(mode="json"), "env": jv.get("env") or {}, "mounts": (fr.parameters or {}).get("mounts", []),
            "startup_command": (fr.parameters or {}).get("startup_command") or None,
            "allocation": (fr.labels or {}).get("launch.placement"), "app_urls": urls, "app_tunnel": tunnel,
            "state_message": fr.state.message if fr.state else None, "idle_checks": idle_checks_of(fr, now)}
    try:
        from prefect_launch.blocks.metrics_store import RunMetricsStore

        summary = RunMetricsStore().get_summary(str(fr.id))
        data["usage"] = summary.model_dump(mode="json") if summary else None
    except Exception:
        data["usage"] = None
    if as_json:
        print_json(data)
        return
    for k, v in data.items():
        if k not in ("usage", "idle_checks") and v not in (None, [], {}):
            console.print(f"[bold]{k}[/]: {v}", highlight=False)
    if data["idle_checks"]:
        console.print("[bold]idle checks[/]:", highlight=False)
        for line in data["idle_checks"]["lines"]:
            console.print(f"  {line}", highlight=False, markup=False)
    if data["usage"]:
        u = data["usage"]
        console.print(f"[bold]usage[/]: cpu mean {u.get('cpu_mean_pct')}%, peak memory {u.get('peak_rss_bytes')} B, "
                        f"net rx {u.get('net_rx_bytes')} B / tx {u.get('net_tx_bytes')} B", highlight=False)


@session_app.command("logs")
def session_logs(session: str = typer.Argument(...), owner: Optional[str] = typer.Option(None, "--owner"),
                 follow: bool = typer.Option(False, "--follow", "-f"),
                 as_json: bool = typer.Option(False, "--json", help="One JSON list of {time, level, message}; "
                                              "with --follow, one such object per line (JSON Lines) as they come")
                 ) -> None:
    """The session's logs (Prefect's run logs); --follow until it ends."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from prefect_launch.deployments.session_view import find_session

    seen = 0
    with prefect_client() as client:
        try:
            fr = find_session(client, session, _owner(owner))
        except LookupError as exc:
            fail(str(exc))
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])),
                                    sort=LogSort.TIMESTAMP_ASC, limit=200, offset=seen)
            if as_json and not follow:  # one document: every line read so far
                rows = [{"time": lg.timestamp, "level": lg.level, "message": lg.message} for lg in logs]
                while len(logs) == 200:
                    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])),
                                            sort=LogSort.TIMESTAMP_ASC, limit=200, offset=len(rows))
                    rows += [{"time": lg.timestamp, "level": lg.level, "message": lg.message} for lg in logs]
                print_json(rows)
                return
            for lg in logs:
                if as_json:
                    print(json.dumps({"time": lg.timestamp, "level": lg.level, "message": lg.message}, default=str),
                          flush=True)
                else:
                    print(f"{lg.timestamp:%H:%M:%S} {lg.message}", flush=True)
            seen += len(logs)
            if not follow:
                return
            state = client.read_flow_run(fr.id).state
            if state and state.is_final() and not logs:
                return
            time.sleep(1)


@session_app.command("terminate")
def session_terminate(session: str = typer.Argument(...), owner: Optional[str] = typer.Option(None, "--owner"),
                      wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until it has ended"),
                      as_json: bool = typer.Option(False, "--json")) -> None:
    """Stop a session: a waiting one is cancelled at once; a running one is stopped and its capacity released."""
    from prefect.states import Cancelled, Cancelling

    from prefect_launch.deployments.session_view import find_session

    who = getpass.getuser()
    with prefect_client() as client:
        try:
            fr = find_session(client, session, _owner(owner))
        except LookupError as exc:
            fail(str(exc))
        if fr.state and fr.state.is_final():
            fail(f"session {fr.name} already ended ({fr.state_name})")
        message = f"terminated by {who}"
        if fr.state and fr.state.type.value in ("SCHEDULED", "PAUSED"):
            client.set_flow_run_state(fr.id, Cancelled(message=message), force=True)
        else:
            client.set_flow_run_state(fr.id, Cancelling(message=message), force=True)
        state = client.read_flow_run(fr.id).state
        deadline = time.time() + 90
        while wait and not state.is_final() and time.time() < deadline:
            time.sleep(1)
            state = client.read_flow_run(fr.id).state
    if as_json:
        print_json({"id": str(fr.id), "name": fr.name, "status": state.name, "message": state.message})
    else:
        console.print(f"session {fr.name}: {state.name}", highlight=False)


@session_app.command("rename")
def session_rename(session: str = typer.Argument(...), new_name: str = typer.Argument(...),
                   owner: Optional[str] = typer.Option(None, "--owner"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Rename a running session (the seed's rule: only while it runs; names stay unique per owner)."""

    from prefect_launch.deployments.session_view import find_session
    from prefect_launch.deployments.sessions import NAME_RE, live_sessions

    if not NAME_RE.match(new_name):
        fail(f"name {new_name!r}: use 4-64 letters, digits, '_', '.' or '-', starting and ending with a letter or digit")
    with prefect_client() as client:
        try:
            fr = find_session(client, session, _owner(owner))
        except LookupError as exc:
            fail(str(exc))
        if not fr.state or fr.state.type.value != "RUNNING":
            fail(f"session {fr.name} is {fr.state_name}; only a running session can be renamed")
        if any(r.name == new_name for r in live_sessions(client, _owner(owner))):
            fail(f"name {new_name!r} is taken by another live session")
        client.update_flow_run(fr.id, name=new_name)
    if as_json:
        print_json({"id": str(fr.id), "old_name": fr.name, "name": new_name})
    else:
        console.print(f"renamed {fr.name} -> {new_name}", highlight=False)


@session_app.command("recent")
def session_recent(owner: Optional[str] = typer.Option(None, "--owner"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Your last five launch configurations (and pinned ones)."""
    from prefect_launch.deployments.session_recent import load

    with prefect_client() as client:
        recent = load(client, _owner(owner))
    if as_json:
        print_json([e.model_dump(mode="json") for e in recent.entries])
        return
    for e in recent.entries:
        console.print(f"{e.id}  {'[pinned] ' if e.pinned else ''}{e.label}  {e.created:%Y-%m-%d %H:%M}", highlight=False)


@session_app.command("pin")
def session_pin(entry: str = typer.Argument(..., help="Recent entry id"), unpin: bool = typer.Option(False, "--unpin"),
                label: Optional[str] = typer.Option(None, "--label", help="Rename the entry"),
                owner: Optional[str] = typer.Option(None, "--owner"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Pin (keep beyond five) or rename a recent launch configuration."""
    from prefect_launch.deployments.session_recent import update

    with prefect_client() as client:
        try:
            e = update(client, _owner(owner), entry, pinned=not unpin, label=label)
        except (LookupError, ValueError) as exc:
            fail(str(exc))
    if as_json:
        print_json(e.model_dump(mode="json"))
    else:
        console.print(f"{e.id}: {'pinned' if e.pinned else 'unpinned'} {e.label}", highlight=False)


@session_app.command("relaunch")
def session_relaunch(entry: str = typer.Argument(..., help="Recent entry id"),
                     name: Optional[str] = typer.Option(None, "--name", help="New name (default: a fresh one)"),
                     owner: Optional[str] = typer.Option(None, "--owner"),
                     as_json: bool = typer.Option(False, "--json")) -> None:
    """Start a session again from a recent launch configuration."""
    from prefect_launch.deployments.session_recent import find, load
    from prefect_launch.deployments.sessions import SessionRequest, start_session
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    with prefect_client() as client:
        try:
            e = find(load(client, _owner(owner)), entry)
            req = SessionRequest.model_validate({**e.request, "name": name, "owner": _owner(owner)})
            out = start_session(client, req)
        except (LookupError, LaunchValidationError) as exc:
            fail(str(exc))
    if as_json:
        print_json(out.model_dump(mode="json"))
    else:
        console.print(f"relaunched {e.label}: {', '.join(out.names)}", highlight=False)


@session_app.command("images")
def session_images(owner: Optional[str] = typer.Option(None, "--owner"),
                   as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List the images the owner committed from sessions (`session commit`), newest first, on this Docker host."""
    from prefect_launch.deployments.session_commit import list_owner_images
    from prefect_launch.workers.scheduling.resources import format_size

    try:
        import docker

        docker_client = docker.from_env(timeout=60)
        images = list_owner_images(docker_client, _owner(owner))
        docker_client.close()
    except Exception as exc:
        fail(f"cannot list images on the Docker daemon (DOCKER_HOST): {exc}")
    if as_json:
        print_json([i.model_dump(mode="json") for i in images])
        return
    if not images:
        console.print(f"no committed images of {_owner(owner)} on this Docker host; make one with "
                        "`prefect-launch session commit SESSION --image-name NAME`", highlight=False)
        return
    from rich.table import Table

    table = Table("image", "created", "size", "from session", "other tags")
    for i in images:
        table.add_row(i.image, f"{i.created:%Y-%m-%d %H:%M}" if i.created else "-",
                      format_size(i.size_bytes) if i.size_bytes else "-", i.session or "-",
                      ", ".join(t.rsplit(":", 1)[-1] for t in i.tags[1:]) or "-")
    console.print(table)


@session_app.command("commit")
def session_commit(session: str = typer.Argument(..., help="Name or id of a running session on a docker queue"),
                   image_name: str = typer.Option(..., "--image-name", help="4-32 letters, digits, '-', '_'"),
                   owner: Optional[str] = typer.Option(None, "--owner"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Commit a running docker session's container to an image of its owner (launch/OWNER/IMAGE-NAME);
    mounted folders are volumes and are not part of it. Start a new session on it with --image."""
    from prefect_launch.deployments.session_commit import check_image_name, commit_session
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    problem = check_image_name(image_name)
    if problem:
        fail(problem)
    try:
        import docker

        docker_client = docker.from_env(timeout=120)
    except Exception as exc:
        fail(f"cannot reach the Docker daemon (DOCKER_HOST) to commit: {exc}")
    try:
        with prefect_client() as client:
            out = commit_session(client, docker_client, session, image_name, _owner(owner))
    except LaunchValidationError as exc:
        fail(str(exc))
    finally:
        docker_client.close()
    if as_json:
        print_json(out.model_dump(mode="json"))
        return
    console.print(f"session {out.session} committed to [bold]{out.image}[/] (also :{out.tag}, id {out.image_id[7:19]})",
                    highlight=False)
    if out.excluded_mounts:
        console.print(f"  not in the image (mounted folders, volumes): {', '.join(out.excluded_mounts)}",
                        highlight=False)
    console.print(f"  start a session on it: prefect-launch session start --queue QUEUE --image {out.image}",
                    highlight=False)
