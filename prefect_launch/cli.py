"""The `prefect-launch` command line: queues, jobs, submissions, agents, runs, the monitor's index.

Every listing command takes ``--json`` so scripts and tests can read it; errors
go to stderr with what to do next and a non-zero exit.

(About 660 lines: one typer command per verb, each a thin shell over deployments/ and dashboard/ code;
sessions are session_cli.py, shared helpers cli_common.py.)
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from typing import Any, List, Optional

import typer
from rich.table import Table

from prefect_launch.cli_common import TIME_HELP, console, err, fail, prefect_client, print_json, time_option
from prefect_launch.identity_cli import access_app, gateway, project_app, user_app
from prefect_launch.session_cli import session_app
from prefect_launch.env_cli import env_app

app = typer.Typer(help="Launch queues, resource-aware agents and run metrics on Prefect 3.",
                  no_args_is_help=True, add_completion=False)
queue_app = typer.Typer(help="Launch queues (Prefect work pools with resource presets).", no_args_is_help=True)
jobs_app = typer.Typer(help="Launch jobs (Prefect deployments).", no_args_is_help=True)
agent_app = typer.Typer(help="Start an agent (`agent --queue Q`) or list agents (`agent ls`).",
                        invoke_without_command=True)
runs_app = typer.Typer(help="Runs on launch queues.", no_args_is_help=True)
monitor_app = typer.Typer(help="The queue monitor's run index (built and synced by the dashboard on its own).",
                          no_args_is_help=True)
app.add_typer(queue_app, name="queue")
app.add_typer(jobs_app, name="jobs")
app.add_typer(agent_app, name="agent")
app.add_typer(runs_app, name="runs")
app.add_typer(monitor_app, name="monitor")
store_app = typer.Typer(help="The metrics store: retention and purge.", no_args_is_help=True)
app.add_typer(store_app, name="store")

# ----------------------------------------------------------------------------- queues
@queue_app.command("apply")
def queue_apply(file: str = typer.Argument(..., help="queues.yaml to apply"),
                as_json: bool = typer.Option(False, "--json", help="Print results as JSON.")) -> None:
    """Create or update the queues declared in FILE (idempotent), with the built-in session job on every
    process and docker queue. Everything is checked before anything is written; a server failure part-way
    says what was written and what was not."""
    from prefect_launch.deployments.queues import QueueApplyError, apply_queues
    from prefect_launch.workers.scheduling.queue_spec import load_queues_file
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    try:
        spec_file = load_queues_file(file)
    except LaunchValidationError as exc:
        fail(str(exc))
    with prefect_client() as client:
        try:
            results = apply_queues(client, spec_file.queues)
        except (LaunchValidationError, QueueApplyError) as exc:
            fail(str(exc))
    if as_json:
        print_json([r.model_dump() for r in results])
    else:
        for r in results:
            console.print(f"queue [bold]{r.queue}[/]: {r.action}"
                          + (f"; session job [bold]{r.session_job}[/]" if r.session_job else ""))


@queue_app.command("example")
def queue_example() -> None:
    """Print the example queues file shipped with prefect-launch (``queue example > queues.yaml``)."""
    from importlib.resources import files

    sys.stdout.write(files("prefect_launch.deployments").joinpath("queues.yaml").read_text())


@queue_app.command("ls")
def queue_ls(names: Optional[List[str]] = typer.Argument(None, help="Only these queues."),
             as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Each queue: presets, online agents, queued / running, free capacity, why runs wait."""
    from prefect_launch.deployments.queues import list_queue_status
    from prefect_launch.workers.scheduling.resources import format_size

    with prefect_client() as client:
        try:
            rows = list_queue_status(client, names or None)
        except LookupError as exc:
            fail(str(exc))
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table(title="launch queues")
    for col in ("queue", "state", "target", "presets", "agents", "queued", "waiting", "head ETA", "running", "free"):
        table.add_column(col)
    for r in rows:
        free = (f"cpu={r.free.cpu:g} mem={format_size(r.free.memory)} gpu={r.free.gpu}" if r.free else "-")
        presets = "\n".join(f"{n}{'*' if n == r.default_preset else ''}: {d}" for n, d in r.presets.items())
        table.add_row(r.name, r.state, r.target, presets, ", ".join(r.agents_online) or "-",
                      str(r.queued), str(r.waiting_count), _eta_text(r.head_eta), str(r.running), free)
    console.print(table)
    for r in rows:
        if r.sharing:
            console.print(f"  {r.name}: sharing: {r.sharing}", highlight=False, markup=False)
        for u in r.owners:
            console.print(f"    owner {u.owner}: {u.runs} run(s), {u.held.describe()}, "
                          f"{u.dominant_share:.0%} of the queue's capacity"
                          + (f"; quota {u.quota}" + (" (reached: its next run waits)" if u.at_quota else "")
                             if u.quota else ""), highlight=False, markup=False)
        for w in r.waiting:
            pos = f"#{w['position']}" if w.get("position") else "#-"
            console.print(f"  {r.name}: {pos} {w['name']} ({w['run_id'][:8]}) ETA {_eta_text(w.get('eta'))} "
                          f"{w['reason']}", highlight=False)


def _eta_text(eta: Any) -> str:
    """A predicted start as the listings print it: UTC time of day, with the date when not today; '-' unknown."""
    if not eta:
        return "-"
    from datetime import datetime, timezone

    when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    when = when.astimezone(timezone.utc)
    return f"{when:%H:%M:%S}" if when.date() == datetime.now(timezone.utc).date() else f"{when:%Y-%m-%d %H:%M:%S}"


# ----------------------------------------------------------------------------- jobs
@jobs_app.command("ls")
def jobs_ls(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Jobs (deployments) with their queue and kind."""
    with prefect_client() as client:
        deployments = client.read_deployments()
        flows = {f.id: f.name for f in client.read_flows()}
    rows = []
    for d in deployments:
        variables = d.job_variables or {}
        built = variables.get("environment") if isinstance(variables.get("environment"), dict) else {}
        kind = "image" if variables.get("image") or built.get("dockerfile") else (  # a Dockerfile: code baked in
            "git" if any("git_clone" in json.dumps(s) for s in (d.pull_steps or [])) else "code")
        rows.append({"job": f"{flows.get(d.flow_id, '?')}/{d.name}", "queue": d.work_pool_name,
                     "kind": kind, "parameters": sorted((d.parameter_openapi_schema or {}).get("properties", {}))})
    rows.sort(key=lambda r: r["job"])
    if as_json:
        print_json(rows)
        return
    table = Table(title="launch jobs")
    for col in ("job", "queue", "kind", "parameters"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["job"], r["queue"] or "-", r["kind"], ", ".join(r["parameters"]))
    console.print(table)


# ----------------------------------------------------------------------------- submit
@app.command("submit")
def submit_cmd(
    job: str = typer.Argument(..., help="Job: DEPLOYMENT or FLOW/DEPLOYMENT"),
    queue: Optional[str] = typer.Option(None, "--queue", "-q", help="Queue (work pool) the job is deployed to."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p"),
    cpu: Optional[float] = typer.Option(None, "--cpu"),
    memory: Optional[str] = typer.Option(None, "--memory", help="e.g. 4Gi"),
    gpu: Optional[int] = typer.Option(None, "--gpu"),
    shm_size: Optional[str] = typer.Option(None, "--shm-size", help="e.g. 1Gi"),
    priority: Optional[str] = typer.Option(None, "--priority", help="critical, high, medium or low"),
    param: Optional[List[str]] = typer.Option(None, "--param", help="k=v (JSON values allowed); repeatable"),
    env: Optional[List[str]] = typer.Option(None, "--env", help="NAME=value; repeatable"),
    secret_env: Optional[List[str]] = typer.Option(
        None, "--secret-env", help="NAME=secret-block: the agent sets NAME from that Prefect Secret block at start; "
                                   "only the block name is stored; repeatable"),
    name: Optional[str] = typer.Option(None, "--name", help="Run (session) name"),
    count: int = typer.Option(1, "--count", min=1, max=1000, help="How many identical runs"),
    agent: Optional[str] = typer.Option(None, "--agent", help="Run only on this agent"),
    owner: Optional[str] = typer.Option(None, "--owner", help="Owner tag (default: your user name)"),
    timeout: Optional[str] = typer.Option(None, "--timeout",
                                          help="End the run Failed after it ran this long, e.g. 90s, 30m, 2h "
                                               "(default: the queue's timeout, if any)"),
    preemptible: Optional[bool] = typer.Option(
        None, "--preemptible/--not-preemptible",
        help="May fill idle hardware and be preempted (SIGTERM, the queue's grace, back to the queue keeping its "
             "submit time) when a regular run needs it; default: the queue's setting for the priority"),
    cluster_size: Optional[int] = typer.Option(
        None, "--cluster-size", help="A cluster run of N members (main1, sub1, ...), each with the preset; "
                                     "placed only when all N fit (all or none); members get WORLD_SIZE, RANK, MASTER_ADDR, ..."),
    cluster_mode: Optional[str] = typer.Option(
        None, "--cluster-mode", help="single-node (all members on one agent; default) or multi-node"),
    environment: Optional[str] = typer.Option(
        None, "--environment", help="The run's job environment (process queues): a requirements file, or JSON such "
                                    "as '{\"requirements\": [\"rich==13.7\"], \"find_links\": \"/srv/wheels\"}'; "
                                    "overrides the job's"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show what would be submitted; create nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the created run ids as JSON."),
) -> None:
    """Validate and enqueue run(s) of JOB; nothing is enqueued when anything is wrong."""
    from prefect_launch.deployments.submit import SubmitRequest, parse_params, submit
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    try:
        req = SubmitRequest(job=job, queue=queue, preset=preset, cpu=cpu, memory=memory, gpu=gpu,
                            shm_size=shm_size, priority=priority, params=parse_params(param or []),
                            env=list(env or []), secret_env=list(secret_env or []), name=name, count=count, agent=agent, owner=owner,
                            timeout=timeout, preemptible=preemptible, cluster_size=cluster_size,
                            cluster_mode=cluster_mode, dry_run=dry_run,
                            environment=environment)
        with prefect_client() as client:
            result = submit(client, req)
    except LaunchValidationError as exc:
        fail(str(exc))
    if as_json:
        print_json(result.model_dump())
        return
    verb = "dry run: would submit" if result.dry_run else "submitted"
    console.print(f"{verb} {len(result.names) if result.dry_run else len(result.run_ids)} run(s) of "
                  f"[bold]{result.job}[/] to queue [bold]{result.queue}[/] ({result.priority}, preset {result.preset}: "
                  f"{result.resources}{' per member' if result.cluster_size > 1 else ''})", highlight=False)
    if result.cluster_size > 1:
        console.print(f"  cluster: {result.cluster_size} members ({result.cluster_mode}): "
                      f"main1{''.join(f', sub{i}' for i in range(1, result.cluster_size))}; placed all or none",
                      highlight=False)
    for rid, rname in zip(result.run_ids, result.names):
        console.print(f"  {rid}  {rname}", highlight=False)


# ----------------------------------------------------------------------------- agents
@agent_app.callback()
def agent_start(
    ctx: typer.Context,
    queue: Optional[List[str]] = typer.Option(None, "--queue", "-q", help="Queue to serve; repeatable"),
    capacity: Optional[str] = typer.Option(None, "--capacity", help="e.g. cpu=8,memory=32Gi,gpu=2"),
    name: Optional[str] = typer.Option(None, "--name", help="Agent name (default: host name)"),
    no_cgroups: bool = typer.Option(False, "--no-cgroups", help="Enforce memory by watching RSS only"),
    on_exit: str = typer.Option("drain", "--on-exit",
                                help="On Ctrl-C/SIGTERM: 'drain' (let running runs finish; a second signal "
                                     "cancels them) or 'cancel' (cancel them at once)"),
    advertise_address: Optional[str] = typer.Option(
        None, "--advertise-address", help="Address other hosts reach this agent's cluster members at (default: "
                                          "the source address of this host's route to the Prefect server)"),
) -> None:
    """Start one agent serving every --queue with one capacity ledger."""
    if ctx.invoked_subcommand is not None:
        return
    if not queue:
        fail("give at least one --queue (or use `prefect-launch agent ls`)")
    from prefect_launch.workers.agent.runner import run_agent
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    try:
        run_agent(list(queue), name=name, capacity=capacity, use_cgroups=not no_cgroups, on_exit=on_exit,
                  advertise_address=advertise_address)
    except (LaunchValidationError, LookupError) as exc:
        fail(str(exc))


@agent_app.command("ls")
def agent_ls(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Agents: queues, capacity, free resources, what they run."""
    from prefect_launch.workers.agent.registry import read_agents_sync
    from prefect_launch.workers.scheduling.resources import format_size

    with prefect_client() as client:
        agents = read_agents_sync(client)
    if as_json:
        print_json([dict(a.model_dump(mode="json"), online=a.online(), offline_since=a.offline_since())
                    for a in agents])
        return
    table = Table(title="launch agents")
    for col in ("agent", "address", "online", "queues", "capacity", "free", "runs"):
        table.add_column(col)
    for a in agents:
        fmt = lambda r: f"cpu={r.cpu:g} mem={format_size(r.memory)} gpu={r.gpu}"  # noqa: E731
        since = a.offline_since()  # its last heartbeat: when it went silent
        table.add_row(a.name, a.address or "-", f"no, since {since}" if since else "yes", ", ".join(a.queues),
                      fmt(a.capacity), fmt(a.free), str(len(a.runs)))
    console.print(table)


# ----------------------------------------------------------------------------- runs
@runs_app.command("ls")
def runs_ls(
    queue: Optional[str] = typer.Option(None, "--queue", "-q"),
    state: Optional[List[str]] = typer.Option(None, "--state", help="e.g. SCHEDULED, RUNNING, COMPLETED"),
    limit: int = typer.Option(50, "--limit", min=1, max=200),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Recent runs on launch queues, with resources and why they wait."""
    from prefect_launch.deployments.runs import list_runs

    with prefect_client() as client:
        try:
            rows = list_runs(client, queue=queue, states=state, limit=limit)
        except (LookupError, ValueError) as exc:
            fail(str(exc))
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table(title="launch runs")
    for col in ("run", "name", "queue", "priority", "state", "pos", "ETA", "preset", "resources", "note"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.run_id[:8], r.name, r.queue or "-", r.priority or "-", r.state, str(r.position or "-"),
                      _eta_text(r.eta) if r.eta or r.position else "", r.preset or "-",
                      r.resources or "-", r.note or "")
    console.print(table)


@runs_app.command("show")
def runs_show(run: str = typer.Argument(..., help="Flow run id (or a unique prefix of 8+ characters)"),
              as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """A run's measured resources: summary, allocated vs used, waste flag, sparklines."""
    from prefect_launch.blocks.metrics_store import RunMetricsStore
    from prefect_launch.deployments.runs import resolve_run_id
    from prefect_launch.workers.agent.tags import tag_value
    from prefect_launch.workers.metrics.report import render_run_report, report_dict

    with prefect_client() as client:
        try:
            run_id = resolve_run_id(client, run)
        except LookupError as exc:
            fail(str(exc))
        try:
            fr = client.read_flow_run(run_id)
            state = fr.state  # why it ended, in Prefect's own words
        except Exception:
            fr = state = None
        cluster = _cluster_of_run(fr)
        launched_by = tag_value(fr.tags, "launched_by") if fr is not None else None  # the gateway's tag
        ended_why = (state.message if state is not None and state.type.value in ("FAILED", "CRASHED", "CANCELLED")
                     else None)
        try:
            store = RunMetricsStore.load(os.environ.get("LAUNCH_METRICS_BLOCK", "default"))
        except Exception:
            store = RunMetricsStore()
    record = store.get_run(run_id)
    if record is None:
        fail(f"no metrics recorded for run {run_id}: it has not started on a launch agent yet, "
              "or the agent writes to another store (LAUNCH_METRICS_BLOCK)")
    summary = store.get_summary(run_id)
    series = store.series(run_id, max_points=120)
    members = (record.extra or {}).get("members") if cluster else None
    if cluster and members:
        cluster["members"] = list(members.values())  # per member; the run's figures above are their sum
    if as_json:
        print_json({**report_dict(record, summary, series), "state": state.name if state else None,
                     "reason": ended_why, "cluster": cluster, "launched_by": launched_by})
    else:
        console.print(render_run_report(record, summary, series), highlight=False, markup=False)
        if launched_by:
            console.print(f"launched by: {launched_by}", highlight=False, markup=False)
        if cluster:
            console.print(f"cluster: {cluster['size']} members ({cluster['mode']})"
                          + (f"; {cluster['placement']}" if cluster.get("placement") else ""),
                          highlight=False, markup=False)
            if cluster.get("members"):
                console.print(_members_table(cluster["members"]))
        if ended_why:
            console.print(f"ended: {state.name}: {ended_why}", highlight=False, markup=False)


def _members_table(members: list[dict[str, Any]]) -> Table:
    """A cluster run's figures per member (the run's own figures are their sum)."""
    from prefect_launch.workers.scheduling.resources import format_size

    table = Table(title="per member (the run's figures are their sum)")
    for col in ("member", "process", "GPUs", "CPU s", "peak memory", "GPU util"):
        table.add_column(col)
    for m in members:
        peak = m.get("peak_memory_bytes")
        util = m.get("avg_gpu_util_pct")
        table.add_row(str(m.get("member")), str(m.get("pid")), ",".join(map(str, m.get("gpu_indices") or [])) or "-",
                      f"{m.get('cpu_seconds') or 0:.1f}",
                      f"{format_size(peak)} ({m.get('memory_measure')})" if peak else "-",
                      f"{util:.0f}%" if util is not None else "-")
    return table


def _cluster_of_run(fr: Any) -> Optional[dict[str, Any]]:
    """A cluster run's size, mode and members' placement (from its job variables and placement label)."""
    jv = (getattr(fr, "job_variables", None) or {}) if fr is not None else {}
    size = jv.get("cluster_size")
    if not isinstance(size, int) or size < 2:
        return None
    placement = ((getattr(fr, "labels", None) or {}).get("launch.placement") or "")
    return {"size": size, "mode": jv.get("cluster_mode") or "single-node", "placement": placement or None}


# ----------------------------------------------------------------------------- history
def _find_run_id(client: Any, text: str) -> str:
    """A run by id, unique id prefix (as `runs show`), or name (a live one first, else the newest)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from prefect_launch.deployments.runs import resolve_run_id

    try:
        return resolve_run_id(client, text)
    except LookupError as exc:
        by_name = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[text])),
                                        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=20)
        if not by_name:
            raise LookupError(f"{exc}; no run is named {text!r} either") from None
        live = [r for r in by_name if r.state is not None and not r.state.is_final()]
        if len(live) > 1:
            raise LookupError(f"{len(live)} live runs are named {text!r}; give the id: "
                              + ", ".join(str(r.id) for r in live)) from None
        return str((live or by_name)[0].id)


def _history_table(rows: list, title: str) -> Table:
    """Records with their sub-steps indented below them."""
    table = Table(title=title)
    for col in ("created", "updated", "phase", "result", "attempts", "from -> to", "error", "message"):
        table.add_column(col, overflow="fold")
    for r in rows:
        states = f"{r.from_state or '-'} -> {r.to_state or '-'}" if r.from_state or r.to_state else ""
        table.add_row(f"{r.created:%Y-%m-%d %H:%M:%S}", f"{r.updated:%H:%M:%S}", r.phase, r.result,
                      str(r.attempts), states, r.error_code or "", r.message or "")
        for st in r.sub_steps:
            table.add_row("", f"{st.ended:%H:%M:%S.%f}"[:12] if st.ended else "", f"  └ {st.step}", st.result,
                          "", "", st.error_code or "", st.message or "")
    return table


@app.command("history")
def history_cmd(run: str = typer.Argument(..., help="Run id, unique id prefix (8+) or run/session name"),
                phase: Optional[List[str]] = typer.Option(None, "--phase", help="schedule, check_precondition, "
                                                          "start, check_timeout, idle_check, terminate; repeatable"),
                result: Optional[List[str]] = typer.Option(None, "--result", help="SUCCESS, NEED_RETRY, SKIPPED, "
                                                           "GIVE_UP, EXPIRED, FAILURE; repeatable"),
                error_code: Optional[List[str]] = typer.Option(None, "--error-code", help="e.g. insufficient-resources"),
                since: Optional[datetime] = typer.Option(None, "--since", parser=time_option, metavar="TIME",
                                                         help=f"From this time: {TIME_HELP}"),
                until: Optional[datetime] = typer.Option(None, "--until", parser=time_option, metavar="TIME",
                                                         help=f"Up to this time: {TIME_HELP}"),
                sort: str = typer.Option("created", "--sort", help="created or updated"),
                as_json: bool = typer.Option(False, "--json", help="Print the records as JSON.")) -> None:
    """Why a run waits, or how it went: every decision the agents made about it (scheduling history)."""
    from prefect_launch.blocks.metrics_store import RunMetricsStore
    from prefect_launch.blocks.scheduling_history import PHASES, RESULTS, read_history

    if sort not in ("created", "updated"):
        fail(f"--sort must be created or updated, got {sort!r}")
    bad = [p for p in phase or [] if p not in PHASES] + [r for r in result or [] if r.upper() not in RESULTS]
    if bad:
        fail(f"unknown --phase/--result {', '.join(bad)}; phases: {', '.join(PHASES)}; results: {', '.join(RESULTS)}")
    with prefect_client() as client:
        try:
            run_id = _find_run_id(client, run)
        except LookupError as exc:
            fail(str(exc))
        try:
            store = RunMetricsStore.load(os.environ.get("LAUNCH_METRICS_BLOCK", "default"))
        except Exception:
            store = RunMetricsStore()
    rows = read_history(store, run_id, phase=phase or None, result=[r.upper() for r in result] if result else None,
                        error_code=error_code or None, since=since, until=until, sort=sort)
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    if not rows:
        console.print(f"no scheduling history for run {run_id} (with these filters): no agent has seen it yet, "
                      "or it is older than the store's retention", highlight=False)
        return
    console.print(_history_table(rows, f"scheduling history of run {run_id}"))


@app.command("setup")
def setup(metrics_url: Optional[str] = typer.Option(None, "--metrics-url",
                                                     help="SQLAlchemy URL of the metrics store (default: SQLite "
                                                          "beside the Prefect database); a password in it is "
                                                          "moved to the block's encrypted password field"),
          metrics_password_secret: Optional[str] = typer.Option(
              None, "--metrics-password-secret", help="Name of a Prefect Secret block holding the store's "
                                                      "database password (read at connect time)"),
          check: bool = typer.Option(False, "--check", help="Also check that the Prefect server's automations act "
                                                            "on events (the zombie automation needs them); fails "
                                                            "with what to do if they do not"),
          check_seconds: float = typer.Option(30.0, "--check-seconds", min=1.0,
                                              help="How long --check waits for the probe automation to fire."),
          as_json: bool = typer.Option(False, "--json", help="Print what was registered as JSON (also when "
                                                             "--check fails, before the error).")) -> None:
    """Register prefect-launch's block types and the default metrics store (idempotent)."""
    from prefect_launch.blocks.metrics_store import RunMetricsStore
    from prefect_launch.blocks.queue_links import QueueLinks

    with prefect_client() as client:  # fail early, with a hint, when no server answers
        try:
            client.hello()
        except Exception as exc:
            fail(f"cannot reach the Prefect server at {os.environ.get('PREFECT_API_URL')}: {exc}")
    for block in (RunMetricsStore, QueueLinks):
        block.register_type_and_schema()
    name = os.environ.get("LAUNCH_METRICS_BLOCK", "default")
    from prefect_launch.blocks.metrics_store import configure_store

    try:
        store, action = configure_store(name, metrics_url, metrics_password_secret)
    except ValueError as exc:
        fail(str(exc))
    try:
        version = store.schema_version()
    except ValueError as exc:
        fail(store.redact(str(exc)))
    except Exception as exc:  # the store does not answer: say so, never with its password
        fail(f"cannot open the metrics store {store.display_url()}: "
              f"{store.redact(f'{type(exc).__name__}: {exc}').splitlines()[0]}")
    url = store.display_url()
    from prefect_launch.deployments.zombies import ensure_zombie_automation

    with prefect_client() as client:
        zombies = ensure_zombie_automation(client)
        probe = None
        if check:
            from prefect_launch.deployments.automations_probe import check_automations

            probe = check_automations(client, timeout_s=check_seconds)
    if as_json:
        print_json({"metrics_block": name, "action": action, "url": url, "password": store.password_source(),
                     "schema_version": version,
                     "zombie_automation": zombies.model_dump(),
                     **({"automations": probe.model_dump()} if probe else {})})
    else:
        console.print(f"metrics store block [bold]{name}[/]: {action}; {url} (password: {store.password_source()}); "
                      f"schema v{version}", highlight=False)
        console.print(f"automation [bold]{zombies.name}[/]: {zombies.action}; a run silent for "
                      f"{zombies.within_s} s is marked Crashed", highlight=False)
        if probe and probe.answering:
            console.print(f"automations: acting on events (a probe fired in {probe.seconds:g} s)", highlight=False)
    if probe is not None and not probe.answering:  # after what was registered: that part did happen
        fail(probe.why or "the Prefect server's automations do not act on events")


# ---------------------------------------------------------------------------- monitor
def _index_service():
    from prefect_launch.dashboard import index_sync as X
    from prefect_launch.dashboard.api import get_api
    from prefect_launch.dashboard.metrics_source import metrics_store

    with prefect_client() as client:
        try:
            client.hello()
        except Exception as exc:
            fail(f"cannot reach the Prefect server at {os.environ.get('PREFECT_API_URL')}: {exc}")
    store = metrics_store()
    if store is None:
        fail("no metrics store: run `prefect-launch setup` first")
    return X.service_for(store, get_api()), X


@monitor_app.command("index")
def monitor_index(days: Optional[float] = typer.Option(None, "--days", help="How far back to read (default LAUNCH_INDEX_DAYS, 30)."),
                  as_json: bool = typer.Option(False, "--json", help="Print the result as JSON.")) -> None:
    """Build the run index now (the dashboard otherwise builds it in the background on first use)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    svc, X = _index_service()
    if as_json:
        res = X.build(svc.index, svc.api, days)
    else:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("reading runs", total=None)
            res = X.build(svc.index, svc.api, days, progress=lambda n: bar.update(task, description=f"reading runs: {n:,}"))
    out = dict(res.model_dump(), **svc.status(), indexed=svc.index.count())
    if as_json:
        print_json(out)
    else:
        console.print(f"run index built: {out['indexed']:,} runs, {res.runs_read:,} read in {res.took_s:.1f} s; "
                      f"covers runs expected since {out['covered_since']}", highlight=False)


@monitor_app.command("status")
def monitor_status(sync: bool = typer.Option(True, "--sync/--no-sync", help="Sync with the server first."),
                   as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Show the run index: what it covers, how many runs, when it last synced."""
    svc, X = _index_service()
    out = dict(svc.status(), indexed=svc.index.count())
    if sync and out["built"]:
        out["sync"] = X.sync(svc.index, svc.api).model_dump()
        out.update(svc.status(), indexed=svc.index.count())
    if as_json:
        print_json(out)
        return
    if not out["built"]:
        console.print("run index: not built yet; `prefect-launch monitor index` builds it (or open the dashboard)")
        return
    console.print(f"run index: {out['indexed']:,} runs; covers runs expected since {out['covered_since']}; "
                  f"last sync {out['last_sync']}", highlight=False)


# ----------------------------------------------------------------------------- store
def _store():
    from prefect_launch.blocks.metrics_store import RunMetricsStore

    name = os.environ.get("LAUNCH_METRICS_BLOCK", "default")
    with prefect_client() as client:
        try:
            client.hello()
        except Exception as exc:
            fail(f"cannot reach the Prefect server at {os.environ.get('PREFECT_API_URL')}: {exc}")
    try:
        return name, RunMetricsStore.load(name)
    except ValueError:
        fail(f"no metrics store block {name!r}: run `prefect-launch setup` first")


@store_app.command("retention")
def store_retention(days: Optional[int] = typer.Argument(None, min=1, help="Keep runs for this many days "
                                                                          "(omit to show the setting)"),
                    as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Show or set how long the metrics store keeps runs (the block's retention_days; default 90)."""
    name, store = _store()
    if days is not None and days != store.retention_days:
        store.retention_days = days
        store.save(name, overwrite=True)
    if as_json:
        print_json({"metrics_block": name, "retention_days": store.retention_days})
    else:
        console.print(f"metrics store block [bold]{name}[/]: keeps runs for {store.retention_days} days",
                      highlight=False)


@store_app.command("purge")
def store_purge(older_than_days: Optional[float] = typer.Option(
                    None, "--older-than-days", min=0, help="Default: the store's retention_days setting"),
                as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Delete runs (samples, summaries) that ended longer ago than the retention; run it daily (cron)."""
    name, store = _store()
    days = older_than_days if older_than_days is not None else store.retention_days
    deleted = store.purge(days)
    if as_json:
        print_json({"metrics_block": name, "older_than_days": days, "deleted_runs": deleted})
    else:
        console.print(f"metrics store block [bold]{name}[/]: deleted {deleted} run(s) that ended more than "
                      f"{days:g} days ago", highlight=False)


# ----------------------------------------------------------------------------- report
@app.command("report")
def report(by: str = typer.Option("owner", "--by", help="Group by owner, job or queue."),
           since: datetime = typer.Option("7d", "--since", parser=time_option, metavar="TIME",
                                          help=f"Start of the range: {TIME_HELP}"),
           until: Optional[datetime] = typer.Option(None, "--until", parser=time_option, metavar="TIME",
                                                    help=f"End of the range (default now): {TIME_HELP}"),
           queue: Optional[List[str]] = typer.Option(None, "--queue", "-q", help="Only these queues."),
           as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
           as_csv: bool = typer.Option(False, "--csv", help="Print as CSV.")) -> None:
    """Cost and waste: GPU-hours and CPU core-hours allocated vs used, and energy, per owner/job/queue.

    The monitor's "Cost and waste" table, from the metrics store the agents write
    (LAUNCH_METRICS_URL, else the block LAUNCH_METRICS_BLOCK, default "default"). Energy the
    agents could not measure is shown as unavailable, never estimated.
    """
    from prefect_launch.dashboard import cost as C
    from prefect_launch.dashboard.api import fetch_deployments, get_api
    from prefect_launch.dashboard.metrics_source import metrics_store
    from prefect_launch.dashboard.spec import UTC

    if by not in C.BY:
        fail(f"--by must be one of {', '.join(C.BY)}")
    if as_json and as_csv:
        fail("give --json or --csv, not both")
    t0, t1 = since, until
    store = metrics_store()
    if store is None:
        fail("no metrics store: set LAUNCH_METRICS_URL or run `prefect-launch setup`")
    try:
        deployments = fetch_deployments(get_api())  # names the jobs of runs whose record has only the id
    except Exception:
        deployments = {}
    try:
        table = C.report(store, by, t0, t1, queues=queue or (), deployments=deployments)
    except Exception as exc:
        fail(f"cannot read the metrics store: {str(exc).splitlines()[0][:300]}")
    if as_json:
        print_json({"by": by, "since": t0.isoformat(), "until": (t1 or datetime.now(UTC)).isoformat(),
                     "rows": C.report_rows(table)})
        return
    if as_csv:
        sys.stdout.write(table.to_csv(index=False, float_format="%.4f", na_rep="unavailable"))
        return
    if table.empty:
        console.print(f"no runs measured since {t0:%Y-%m-%d %H:%M} UTC")
        return
    t = Table(title=f"Cost by {by} since {t0:%Y-%m-%d %H:%M} UTC")
    cols = [(by, by), ("runs", "runs"), ("gpu_alloc_h", "GPU-h held"), ("gpu_used_h", "GPU-h used"),
            ("gpu_used_pct", "GPU used % (measured)"), ("gpu_unmeasured_h", "GPU-h unmeasured"), ("cpu_alloc_h", "core-h held"), ("cpu_used_h", "core-h used"),
            ("gpu_energy_wh", "GPU Wh"), ("cpu_energy_wh", "CPU Wh"), ("peak_memory_gib", "peak mem GiB")]
    for _, title in cols:
        t.add_column(title, justify="left" if title == by else "right")
    for rec in C.report_rows(table):
        t.add_row(*["unavailable" if rec[k] is None else f"{rec[k]:,.2f}" if isinstance(rec[k], float) else str(rec[k])
                    for k, _ in cols])
    console.print(t)


app.add_typer(session_app, name="session")
app.add_typer(env_app, name="env")
app.add_typer(user_app, name="user")
app.add_typer(project_app, name="project")
app.add_typer(access_app, name="access")
app.command("gateway")(gateway)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
