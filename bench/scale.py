"""Bursts, many agents and an agent restart, on one machine, in one run.

(a) burst: N submissions (`submit`, the Python API the CLI uses) from C concurrent clients, on a
    SQLite-backed and on a PostgreSQL-backed Prefect server: how many were lost (reported created,
    not on the server), duplicated (more than one run for one submission, or a run left behind by a
    submission reported as failed) and cleanly refused (reported failed, nothing left). The same
    burst through stock `create_flow_run_from_deployment` (no idempotency key) on SQLite, for reference.
(b) throughput: A agents on one queue, R short runs with mixed presets (CPU and GPU): runs/min and
    oversubscriptions counted from the jobs' own records (flows/probe.py: CUDA_VISIBLE_DEVICES and
    allocation per run; per agent, the resources of runs overlapping in time against its declared
    capacity), on SQLite and on PostgreSQL; next to A stock `prefect worker start --type process`
    workers on the same runs (same probe, same parameters) on SQLite.
(c) restart: an agent with 2 GPU runs going is SIGKILLed and started again with the same capacity,
    then more GPU runs are submitted: GPU overlaps counted from the jobs' own records.

    .venv/bin/python bench/scale.py            # full size (minutes)
    .venv/bin/python bench/scale.py --quick    # small sizes, to check it works
    .venv/bin/python bench/scale.py --skip b   # parts to leave out (a, b, c; repeatable)

Sizes also from the environment: SCALE_BURST, SCALE_CLIENTS, SCALE_RUNS, SCALE_AGENTS, SCALE_HOLD,
SCALE_MORE. Last line: one JSON object with burst_lost, burst_duplicated, oversubscriptions,
restart_gpu_overlaps, runs_per_min_sqlite, runs_per_min_postgres, stock_runs_per_min (and details).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _stack import background  # noqa: E402
from launch_helpers import apply_queue, cli_json, deploy_probe, read_runs, records  # noqa: E402

from prefect_launch.local_server import (create_database, local_postgres, local_prefect_server,  # noqa: E402
                                         pg_url)

PY = sys.executable
CLI = [PY, "-m", "prefect_launch.cli"]
PRESETS = {
    "small": {"cpu": 0.5, "memory": "256Mi", "gpu": 0},
    "cpu1": {"cpu": 1, "memory": "512Mi", "gpu": 0},
    "gpu1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1},
    "gpu2": {"cpu": 1, "memory": "512Mi", "gpu": 2},
}
MIX = ["small", "gpu1", "cpu1", "gpu1", "small", "gpu2"]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def server(db: str, work: Path) -> Iterator[str]:
    """A Prefect server on SQLite or on a private PostgreSQL (metrics store there too); exported."""
    if db == "sqlite":
        with local_prefect_server(work / "home-sqlite") as url:
            subprocess.run([*CLI, "setup"], check=True, capture_output=True)
            yield url
        return
    with local_postgres() as port:  # its own temp folder: the server's user must reach it
        create_database(port, "prefect")
        create_database(port, "launch_metrics")
        with local_prefect_server(work / "home-pg", db_url=pg_url(port, "prefect", driver="asyncpg")) as url:
            subprocess.run([*CLI, "setup", "--metrics-url", pg_url(port, "launch_metrics")], check=True,
                           capture_output=True)
            yield url


def all_runs_named(prefix: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    out: list = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=prefix)),
                                         limit=200, offset=len(out))
            out += page
            if len(page) < 200:
                return out


# ------------------------------------------------------------------------------------------ (a) burst
def burst(job: str, queue: str, n: int, clients: int, tag: str, stock: bool = False) -> dict[str, Any]:
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit

    counter, lock = itertools.count(), threading.Lock()
    outcome: dict[int, tuple[str, Any]] = {}
    barrier = threading.Barrier(clients)

    def client_loop() -> None:
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name(job)
            barrier.wait()
            while True:
                with lock:
                    i = next(counter)
                if i >= n:
                    return
                name, params = f"{tag}-{i}x", {"record_dir": "/nonexistent", "tag": str(i)}
                try:
                    if stock:
                        ids = [str(client.create_flow_run_from_deployment(dep.id, name=name, parameters=params).id)]
                    else:
                        ids = submit(client, SubmitRequest(job=job, queue=queue, name=name, params=params)).run_ids
                    outcome[i] = ("ok", ids)
                except Exception as exc:  # counted below against what the server holds
                    outcome[i] = ("refused", f"{type(exc).__name__}: {str(exc)[:160]}")

    t0 = time.time()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.time() - t0
    on_server: dict[str, list[str]] = {}
    for fr in all_runs_named(f"{tag}-"):
        on_server.setdefault(fr.name, []).append(str(fr.id))
    lost = dup = refused_clean = orphaned = 0
    reasons: dict[str, int] = {}
    for i in range(n):
        kind, val = outcome.get(i, ("refused", "no outcome"))
        have = on_server.get(f"{tag}-{i}x", [])
        if kind == "ok":
            lost += 0 if set(val) <= set(have) else 1
            dup += max(0, len(have) - 1)
        else:
            reasons[val[:90]] = reasons.get(val[:90], 0) + 1
            if have:
                orphaned += len(have)  # told "failed" while runs were queued: a resubmission duplicates them
            else:
                refused_clean += 1
    return {"submissions": n, "clients": clients, "seconds": round(took, 1), "created_per_s": round(n / took, 1),
            "lost": lost, "duplicated": dup + orphaned, "orphaned": orphaned, "refused_clean": refused_clean,
            "refusal_reasons": reasons}


def part_a(db: str, work: Path, n: int, clients: int, stock: bool) -> dict[str, Any]:
    q = apply_queue(work, {"name": f"burst-{db}", "presets": {"tiny": {"cpu": 0.1, "memory": "64Mi"}},
                           "default_preset": "tiny"})
    job = deploy_probe(q, f"burst-{db}")
    say(f"(a) {db}: {n} submissions from {clients} clients (launch submit)")
    out = {"ours": burst(job, q, n, clients, f"bo{db}")}
    say(f"    {out['ours']}")
    if stock:
        say(f"(a) {db}: the same burst through stock create_flow_run_from_deployment")
        out["stock"] = burst(job, q, n, clients, f"bs{db}", stock=True)
        say(f"    {out['stock']}")
    return out


# ------------------------------------------------------------------------------------- (b) throughput
def create_runs(deployment: str, n: int, seconds: float, rec: Path, presets: Optional[list[str]],
                launch_queue: Optional[str] = None) -> list[str]:
    """n runs of the probe, created in order (4 threads), with the mixed presets if given: through
    prefect-launch's ``submit`` (what `prefect-launch submit` does: the run waits as Queued) when
    ``launch_queue`` is given, else with Prefect's client (job variables pick the presets)."""
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit

    ids: dict[int, str] = {}
    batch = uuid.uuid4().hex[:8]

    def part(k: int) -> None:
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name(deployment)
            for i in range(k, n, 4):
                jv = {"preset": presets[i % len(presets)]} if presets else {}
                params = {"record_dir": str(rec), "seconds": seconds, "tag": str(i)}
                key = f"scale-{batch}-{i}"
                for attempt in range(10):  # a busy SQLite server answers 503; the key makes a retry safe
                    try:
                        if launch_queue:
                            ids[i] = submit(client, SubmitRequest(
                                job=deployment, queue=launch_queue, name=f"run-{i}", params=params,
                                preset=presets[i % len(presets)] if presets else None, idempotency_key=key)).run_ids[0]
                            break
                        ids[i] = str(client.create_flow_run_from_deployment(
                            dep.id, parameters=params, job_variables=jv, name=f"run-{i}", idempotency_key=key).id)
                        break
                    except Exception:
                        if attempt == 9:
                            raise
                        time.sleep(min(5.0, 0.5 * 2 ** attempt))

    threads = [threading.Thread(target=part, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [ids[i] for i in range(n)]


def wait_all_final(ids: list[str], timeout: float) -> list:
    deadline = time.time() + timeout
    while True:
        runs = read_runs(ids)
        done = [r for r in runs if r.state and r.state.is_final()]
        if len(done) == len(ids) or time.time() > deadline:
            return runs
        time.sleep(2)


def gpus(rec: dict) -> set[str]:
    return set(filter(None, (rec.get("cuda_visible_devices") or "").split(",")))


def oversubscriptions(recs: list[dict], caps: dict[str, dict[str, float]]) -> dict[str, int]:
    """From the jobs' own records, per agent: runs that started while the runs then going held more CPU or
    GPU than the agent declared, GPU indices outside the declared ones, and overlapping runs sharing a GPU."""
    out = {"cpu_over": 0, "gpu_over": 0, "gpu_index_outside": 0, "gpu_shared_pairs": 0}
    by_agent: dict[str, list[dict]] = {}
    for r in recs:
        by_agent.setdefault(r.get("launch_agent") or "?", []).append(r)
    for agent_name, rs in by_agent.items():
        cap = caps.get(agent_name)
        if cap is None:
            continue
        for r in rs:
            active = [x for x in rs if x["start"] <= r["start"] < x["end"]]
            out["cpu_over"] += sum(float(x["launch_cpu"] or 0) for x in active) > cap["cpu"] + 1e-6
            out["gpu_over"] += sum(len(gpus(x)) for x in active) > cap["gpu"]
            out["gpu_index_outside"] += not gpus(r) <= {str(i) for i in range(int(cap["gpu"]))}
        for a, b in itertools.combinations(rs, 2):
            if a["start"] < b["end"] and b["start"] < a["end"] and gpus(a) & gpus(b):
                out["gpu_shared_pairs"] += 1
    return out


def _cap(spec: str) -> dict[str, float]:
    kv = dict(p.split("=", 1) for p in spec.split(","))
    return {"cpu": float(kv.get("cpu", 0)), "gpu": float(kv.get("gpu", 0))}


def part_b_ours(db: str, work: Path, n: int, agents: int, capacity: str, seconds: float) -> dict[str, Any]:
    q = apply_queue(work, {"name": f"scale-{db}", "presets": PRESETS, "default_preset": "small"})
    job = deploy_probe(q, f"scale-{db}")
    rec = work / f"records-{db}"
    say(f"(b) {db}: creating {n} runs with mixed presets")
    ids = create_runs(job, n, seconds, rec, MIX, launch_queue=q)
    names = [f"scale-{db}-{k}" for k in range(agents)]
    say(f"(b) {db}: {agents} launch agents ({capacity} each) start")
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        for nm in names:
            stack.enter_context(background([*CLI, "agent", "--queue", q, "--name", nm, "--capacity", capacity],
                                           work / f"agent-{nm}.log"))
        runs = wait_all_final(ids, timeout=max(600, n * 6))
    return _throughput(runs, rec, t0, {nm: _cap(capacity) for nm in names})


def stock_process_runs(pool: str, work: Path, n: int, seconds: float, limit: int, label: str,
                       launchers: list[Callable[[list[str]], list[str]]]) -> tuple[list, list[str], float, Path]:
    """Stock Prefect's side of a throughput part (also bench/hosts.py's): a `process` work pool, the same
    probe runs without presets, and one `prefect worker start --type process --limit N` per launcher (a
    launcher turns the command into what starts it: as is, or inside a host). Returns the final runs, their
    ids, the workers' start time and the runs' record folder."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    job = deploy_probe(pool, pool)
    rec = work / "records-stock"
    say(f"{label} stock: creating the same {n} runs")
    ids = create_runs(job, n, seconds, rec, None)
    say(f"{label} stock: {len(launchers)} `prefect worker start --type process --limit {limit}` workers start")
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        for k, launch in enumerate(launchers):
            stack.enter_context(background(launch([PY, "-m", "prefect", "worker", "start", "--pool", pool,
                                                   "--type", "process", "--name", f"stock-{k}", "--limit", str(limit)]),
                                           work / f"stock-{k}.log"))
        runs = wait_all_final(ids, timeout=max(900, n * 10))
    return runs, ids, t0, rec


def part_b_stock(work: Path, n: int, workers: int, seconds: float, limit: int) -> dict[str, Any]:
    runs, _ids, t0, rec = stock_process_runs("scale-stock", work, n, seconds, limit, "(b)",
                                             [lambda argv: argv] * workers)
    return _throughput(runs, rec, t0, {})


def _throughput(runs: list, rec: Path, t0: float, caps: dict) -> dict[str, Any]:
    done = [r for r in runs if r.state and r.state.is_completed()]
    ends = [r.end_time.timestamp() for r in done if r.end_time]
    span = (max(ends) - t0) if ends else float("nan")
    recs = list(records(rec).values()) if rec.exists() else []
    out = {"runs": len(runs), "completed": len(done),
           "not_completed": {r.state_name: 0 for r in runs if not (r.state and r.state.is_completed())},
           "seconds": round(span, 1), "runs_per_min": round(len(done) / span * 60, 1) if ends else 0.0,
           "records": len(recs)}
    for r in runs:
        if not (r.state and r.state.is_completed()):
            out["not_completed"][r.state_name] += 1
    if caps:
        out["oversubscriptions"] = oversubscriptions(recs, caps)
    say(f"    {out}")
    return out


# ---------------------------------------------------------------------------------------- (c) restart
def part_c(work: Path, hold: float, more: int) -> dict[str, Any]:
    from prefect import get_client

    q = apply_queue(work, {"name": "restart", "presets": {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}},
                           "default_preset": "g1"})
    job = deploy_probe(q, "restart")
    rec = work / "records-restart"
    name, capacity = "restart-agent", "cpu=4,memory=8Gi,gpu=2"
    args = [*CLI, "agent", "--queue", q, "--name", name, "--capacity", capacity]
    first = subprocess.Popen(args, stdout=open(work / "agent-restart-1.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    second = None
    try:
        _wait_online(name)
        say(f"(c) two {hold:g}-s GPU runs on {name} ({capacity})")
        long_ids = create_runs(job, 2, hold, rec, None, launch_queue=q)
        _wait_running(long_ids, 120)
        say("(c) SIGKILL the agent (its runs keep going in their own sessions); start it again, same capacity")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        time.sleep(1)
        second = subprocess.Popen(args, stdout=open(work / "agent-restart-2.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        _wait_online(name)
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name(job)
            more_ids = [str(client.create_flow_run_from_deployment(
                dep.id, parameters={"record_dir": str(rec), "seconds": 3, "tag": f"after-{i}"}, name=f"after-{i}").id)
                for i in range(more)]
        say(f"(c) {more} more GPU runs submitted; waiting for all runs to end")
        runs = wait_all_final(long_ids + more_ids, timeout=hold + more * 10 + 180)
        deadline = time.time() + hold + 30  # the old runs' own records appear when their processes end
        while len(records(rec)) < len(long_ids) and time.time() < deadline:
            time.sleep(1)
    finally:
        for p in (second, first):
            if p is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT if p is second else signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    recs = list(records(rec).values())
    overlaps = sum(1 for a, b in itertools.combinations(recs, 2)
                   if a["start"] < b["end"] and b["start"] < a["end"] and gpus(a) & gpus(b))
    out = {"runs": len(runs), "records": len(recs), "gpu_overlaps": overlaps,
           "states": {str(r.name): r.state_name for r in runs}}
    say(f"    {out}")
    return out


def _wait_online(name: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        a = {x["name"]: x for x in cli_json("agent", "ls")}.get(name)
        if a and a["online"]:
            return
        time.sleep(1)
    raise RuntimeError(f"agent {name} did not come online")


def _wait_running(ids: list[str], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(r.state_name == "Running" for r in read_runs(ids)):
            return
        time.sleep(0.5)
    raise RuntimeError("the GPU runs did not start")


def main() -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (burst 40/8, 24 runs, 15-s hold)")
    ap.add_argument("--burst", type=int, default=int(env("SCALE_BURST", 500)))
    ap.add_argument("--clients", type=int, default=int(env("SCALE_CLIENTS", 16)))
    ap.add_argument("--runs", type=int, default=int(env("SCALE_RUNS", 300)))
    ap.add_argument("--agents", type=int, default=int(env("SCALE_AGENTS", 3)))
    ap.add_argument("--capacity", default=env("SCALE_CAPACITY", "cpu=2,memory=8Gi,gpu=2"),
                    help="declared capacity of each agent in (b)")
    ap.add_argument("--seconds", type=float, default=float(env("SCALE_RUN_SECONDS", 0.5)), help="run length in (b)")
    ap.add_argument("--stock-limit", type=int, default=int(env("SCALE_STOCK_LIMIT", 3)),
                    help="--limit of each stock worker (concurrent runs)")
    ap.add_argument("--hold", type=float, default=float(env("SCALE_HOLD", 40)), help="GPU run length in (c)")
    ap.add_argument("--more", type=int, default=int(env("SCALE_MORE", 4)), help="GPU runs after the restart")
    ap.add_argument("--skip", action="append", default=[], choices=["a", "b", "c", "stock", "sqlite", "postgres", "a-sqlite", "b-ours-sqlite"],
                    help="leave out a part, the stock comparisons, one database, the SQLite burst, or our part (b) "
                         "on SQLite (its stock runs only); repeatable")
    args = ap.parse_args()
    if args.quick:
        args.burst, args.clients, args.runs, args.hold, args.more = 40, 8, 24, 15, 2
    work = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    say(f"work dir {work}")
    res: dict[str, Any] = {}
    with (server("sqlite", work) if "sqlite" not in args.skip else contextlib.nullcontext()):
        if "a" not in args.skip and "sqlite" not in args.skip and "a-sqlite" not in args.skip:
            res["a_sqlite"] = part_a("sqlite", work, args.burst, args.clients, stock="stock" not in args.skip)
        if "b" not in args.skip and "sqlite" not in args.skip:
            if "b-ours-sqlite" not in args.skip:
                res["b_sqlite"] = part_b_ours("sqlite", work, args.runs, args.agents, args.capacity, args.seconds)
            if "stock" not in args.skip:
                res["b_stock"] = part_b_stock(work, args.runs, args.agents, args.seconds, args.stock_limit)
        if "c" not in args.skip and "sqlite" not in args.skip:
            res["c"] = part_c(work, args.hold, args.more)
    if ("a" not in args.skip or "b" not in args.skip) and "postgres" not in args.skip:
        with server("postgres", work):
            if "a" not in args.skip:
                res["a_postgres"] = part_a("postgres", work, args.burst, args.clients, stock=False)
            if "b" not in args.skip:
                res["b_postgres"] = part_b_ours("postgres", work, args.runs, args.agents, args.capacity, args.seconds)

    def get(*path, default=None):
        cur: Any = res
        for p in path:
            if not isinstance(cur, dict) or p not in cur:
                return default
            cur = cur[p]
        return cur

    def total(parts: tuple[str, ...], *path: str) -> Optional[int]:
        """Summed over the parts that ran; None (null) when none of them ran."""
        ran = [get(k, *path) for k in parts if k in res]
        return sum(sum(x.values()) if isinstance(x, dict) else x or 0 for x in ran) if ran else None

    over = total(("b_sqlite", "b_postgres"), "oversubscriptions")  # each part's kinds summed
    figures = {
        "burst_lost": total(("a_sqlite", "a_postgres"), "ours", "lost"),
        "burst_duplicated": total(("a_sqlite", "a_postgres"), "ours", "duplicated"),
        "burst_refused_clean": total(("a_sqlite", "a_postgres"), "ours", "refused_clean"),
        "oversubscriptions": over,
        "restart_gpu_overlaps": get("c", "gpu_overlaps"),
        "runs_per_min_sqlite": get("b_sqlite", "runs_per_min"),
        "runs_per_min_postgres": get("b_postgres", "runs_per_min"),
        "stock_runs_per_min": get("b_stock", "runs_per_min"),
        "stock_burst_lost": get("a_sqlite", "stock", "lost"),
        "stock_burst_duplicated": get("a_sqlite", "stock", "duplicated"),
        "stock_burst_refused": get("a_sqlite", "stock", "refused_clean"),
        "burst": args.burst, "clients": args.clients, "runs": args.runs, "agents": args.agents,
    }
    if figures["runs_per_min_sqlite"] and figures["stock_runs_per_min"]:
        figures["speedup_vs_stock"] = round(figures["runs_per_min_sqlite"] / figures["stock_runs_per_min"], 2)
    (work / "details.json").write_text(json.dumps(res, indent=2, default=str))
    say(f"details in {work / 'details.json'}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
