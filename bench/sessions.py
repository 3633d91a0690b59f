"""Sessions: time to a usable JupyterLab, ours vs stock Prefect; and how good our start-time predictions are.

(a) An interactive session is submitted; the figure is submit -> JupyterLab answering
    /api/status with the session's token. Ours: `start_session` on a launch queue served by
    a launch agent. Stock: the same session flow deployed on a plain `process` pool served by
    `prefect worker start --type process`, submitted with Prefect's client. Same server, same machine.
    Each side first waits until its agent/worker has polled the server and serves one warm-up
    session that is not counted (a long-lived agent or worker, not one that is still starting).
(b) A mixed batch workload (sleeps of different lengths, two presets) on two agents. Warm-up: one
    run per length, not counted, so every job shape has a past run time. Then, right after each
    submission, our predicted start (placement replayed forward) and the naive estimate (runs ahead
    and running x the queue's median run time / runs that fit at once) against the actual start;
    mean absolute errors over the same runs (those our prediction covers; how many is printed).

    .venv/bin/python bench/sessions.py [--ready-runs 5] [--eta-runs 30]

Last line JSON: ready_p50_s, stock_ready_p50_s, eta_mae_s, naive_eta_mae_s (and counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stack import background, prefect_server  # noqa: E402

CLI = [sys.executable, "-m", "prefect_launch.cli"]


def _cli(*args: str) -> str:
    return subprocess.run([*CLI, *args], check=True, capture_output=True, text=True).stdout


def _token(client, run_id: str, deadline: float) -> str:
    from prefect.blocks.system import Secret

    while time.time() < deadline:
        try:
            return Secret.load(f"session-token-{run_id}").get()
        except Exception:
            time.sleep(0.05)
    raise TimeoutError("no token")


def _ready(port: int, run_id: str, t0: float, client) -> float:
    deadline = time.time() + 240
    token = _token(client, run_id, deadline)
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"},
                         timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError("JupyterLab never answered")


def _wait_polled(client, pool: str, timeout: float = 300) -> None:
    """Until a worker of ``pool`` has polled the server (a heartbeat on the pool)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if client.read_workers_for_work_pool(pool):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no worker of {pool} polled within {timeout:.0f} s")


def _stop(client, run_id: str) -> None:
    from prefect.states import Cancelling

    client.set_flow_run_state(run_id, Cancelling(), force=True)
    deadline = time.time() + 60
    while time.time() < deadline and not client.read_flow_run(run_id).state.is_final():
        time.sleep(0.5)


def bench_ready(tmp: Path, n: int) -> tuple[list[float], list[float]]:
    from prefect import get_client

    from prefect_launch.deployments.sessions import FLOWS_DIR, SessionRequest, start_session
    from prefect_launch.local_server import free_port

    qfile = tmp / "q.yaml"
    qfile.write_text("queues:\n- name: bench-sessions\n  default_preset: s\n  presets:\n    s: {cpu: 1, memory: 2Gi}\n")
    _cli("queue", "apply", str(qfile))
    ours, stock = [], []
    with background([*CLI, "agent", "--queue", "bench-sessions", "--capacity", "cpu=2,memory=8Gi", "--name", "bench",
                     "--on-exit", "cancel"], tmp / "agent.log"):
        with get_client(sync_client=True) as client:
            _wait_polled(client, "bench-sessions")
            for i in range(n + 1):  # the first is the warm-up
                t0 = time.time()
                out = start_session(client, SessionRequest(queue="bench-sessions", name=f"ready-{i}", owner="bench"),
                                    record_recent=False)
                took = _ready(out.ports[0], out.run_ids[0], t0, client)
                _stop(client, out.run_ids[0])
                if i:
                    ours.append(took)
                print(f"ours {'warm-up' if not i else f'{i}/{n}'}: {took:.2f} s", flush=True)
    from prefect import flow

    _cli_env = dict(os.environ)
    subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", "bench-stock", "--type", "process"],
                   check=True, capture_output=True, env=_cli_env)
    flow.from_source(source=str(FLOWS_DIR), entrypoint="session.py:session").deploy(
        name="session-stock", work_pool_name="bench-stock", build=False, push=False, print_next_steps=False,
        ignore_warnings=True)
    with background([sys.executable, "-m", "prefect", "worker", "start", "--pool", "bench-stock", "--type", "process"],
                    tmp / "stock.log"):
        with get_client(sync_client=True) as client:
            _wait_polled(client, "bench-stock")
            dep = client.read_deployment_by_name("launch-session/session-stock")
            for i in range(n + 1):
                port = free_port()
                t0 = time.time()
                fr = client.create_flow_run_from_deployment(dep.id, parameters={"session_type": "interactive",
                                                                               "ports": [port]})
                took = _ready(port, str(fr.id), t0, client)
                _stop(client, str(fr.id))
                if i:
                    stock.append(took)
                print(f"stock {'warm-up' if not i else f'{i}/{n}'}: {took:.2f} s", flush=True)
    return ours, stock


def _queue_median_run_time(client, queue: str) -> float:
    """The naive estimate's run time: the median of the queue's completed runs (what it has seen so far)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    done = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.COMPLETED]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[queue])), limit=200)
    times = [r.total_run_time.total_seconds() for r in done if r.total_run_time]
    return statistics.median(times) if times else 0.0


def bench_eta(tmp: Path, n: int, detail_path: Optional[str] = None) -> dict:
    """Submit a mixed batch workload at once; compare predictions made right after each submission."""
    from prefect import get_client

    from prefect_launch.deployments.eta_reader import predicted_starts
    from prefect_launch.deployments.sessions import SessionRequest, start_session

    qfile = tmp / "eta.yaml"
    qfile.write_text("queues:\n- name: bench-eta\n  default_preset: one\n  presets:\n"
                     "    one: {cpu: 1, memory: 1Gi}\n    two: {cpu: 2, memory: 1Gi}\n")
    _cli("queue", "apply", str(qfile))
    lengths = [2, 6, 4, 8, 3]
    fit_at_once = 4  # 2 agents x 2 one-CPU runs
    predicted, naive, ids, read_s, overheads = {}, {}, [], [], {}
    from prefect_launch.deployments import eta_reader

    learnt: list = []  # the overheads each prediction used (for --eta-detail)
    _learn = eta_reader.learn_overhead
    eta_reader.learn_overhead = lambda *a, **k: learnt.append(_learn(*a, **k)) or learnt[-1]
    agents = [background([*CLI, "agent", "--queue", "bench-eta", "--capacity", "cpu=2,memory=4Gi", "--name", f"eta-{k}",
                          "--on-exit", "cancel"], tmp / f"eta-{k}.log") for k in range(2)]
    for a in agents:
        a.__enter__()

    def submit(client, name: str, secs: int, preset: str) -> str:
        # the timeout is a generous cap: the agent counts it from the process start, which on a busy box
        # includes seconds of engine start, and a run killed by it would not be the length it was meant to be
        out = start_session(client, SessionRequest(type="batch", queue="bench-eta", name=name, owner="bench",
                                                   preset=preset, timeout=f"{secs + 60}s",
                                                   startup_command=f"sleep {secs}"), record_recent=False)
        return out.run_ids[0]

    def wait_final(client, run_ids: list[str], timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and not all(client.read_flow_run(x).state.is_final() for x in run_ids):
            time.sleep(1)

    try:
        with get_client(sync_client=True) as client:
            while len(client.read_workers_for_work_pool("bench-eta")) < 2:
                time.sleep(0.5)
            # warm-up: one run per length gives every job shape a past run time (our medians use the job),
            # in the workload's preset mix, so some wait as they will; the naive estimate's queue median
            # comes from the same runs. Not counted.
            warm = [submit(client, f"eta-warm-{secs}", secs, "two" if k % 3 == 0 else "one")
                    for k, secs in enumerate(lengths)]
            wait_final(client, warm, 300)
            for i in range(n):
                secs = lengths[i % len(lengths)]
                preset = "two" if i % 3 == 0 else "one"
                rid = submit(client, f"eta-{i:03d}", secs, preset)
                now = datetime.now(timezone.utc)  # the prediction is made now, right after the submission
                ids.append(rid)
                t_read = time.time()
                learnt.clear()
                predicted[rid] = predicted_starts(client, ["bench-eta"], now, include_claimed=True).get(rid)
                used = learnt[-1].model_dump() if learnt else None
                read_s.append(time.time() - t_read)
                ahead = len([x for x in ids[:-1] if not client.read_flow_run(x).state.is_final()])
                # naive: runs ahead (running and waiting) x the queue's median run time / runs that fit at once
                naive[rid] = now.timestamp() + ahead * _queue_median_run_time(client, "bench-eta") / fit_at_once
                overheads[rid] = used
            wait_final(client, ids, 600)
            errs, nerrs, nerrs_all = [], [], []
            detail = []
            for rid in ids:
                fr = client.read_flow_run(rid)
                p = predicted[rid]
                pend = [st.timestamp.timestamp() for st in client.read_flow_run_states(rid) if st.type.value == "PENDING"]
                detail.append({"run": fr.name, "submitted": fr.created.timestamp(), "predicted": p and p.timestamp(),
                               "naive": naive[rid], "actual": fr.start_time and fr.start_time.timestamp(),
                               "run_s": fr.total_run_time.total_seconds(), "claimed": pend[-1] if pend else None,
                               "ended": fr.end_time and fr.end_time.timestamp(),
                               "agent": (fr.labels or {}).get("prefect.worker.name"),
                               "preset": next((t for t in fr.tags if t.startswith("preset:")), None),
                               "overhead": overheads.get(rid),
                               "states": [(st.type.value, st.timestamp.timestamp(), st.message) for st in
                                          sorted(client.read_flow_run_states(rid), key=lambda st: st.timestamp)]})
                if not fr.start_time:
                    continue
                actual = fr.start_time.timestamp()
                nerrs_all.append(abs(naive[rid] - actual))
                if predicted[rid] is not None:  # the same runs for both
                    errs.append(abs(predicted[rid].timestamp() - actual))
                    nerrs.append(abs(naive[rid] - actual))
            if detail_path:
                from prefect_launch.deployments.eta_reader import queue_history

                Path(detail_path).write_text(json.dumps({"runs": detail, "overhead": queue_history(
                    client, "bench-eta")[1].model_dump(mode="json")}, indent=1))
    finally:
        for a in agents:
            a.__exit__(None, None, None)
        if detail_path:  # the agents' logs beside the detail (the temporary folder goes)
            for k in range(2):
                log = tmp / f"eta-{k}.log"
                if log.exists():
                    Path(detail_path).with_suffix(f".eta-{k}.log").write_text(log.read_text(errors="replace"))
            server_log = Path(os.environ.get("PREFECT_HOME", "/nonexistent")) / "server.log"
            if server_log.exists():
                Path(detail_path).with_suffix(".server.log").write_text(server_log.read_text(errors="replace"))
    mean = lambda v: statistics.mean(v) if v else float("nan")  # noqa: E731
    print(f"eta: prediction read p50 {statistics.median(read_s):.2f} s per submission", flush=True)
    print(f"eta: {len(errs)} runs compared (of {n} measured, {len(nerrs_all)} started); ours predicted "
          f"{sum(p is not None for p in predicted.values())}, naive {len(naive)}; naive over all started runs: "
          f"MAE {mean(nerrs_all):.1f} s", flush=True)
    return {"eta_mae_s": mean(errs), "naive_eta_mae_s": mean(nerrs), "eta_compared": len(errs), "eta_runs": n,
            "naive_eta_mae_all_s": mean(nerrs_all)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready-runs", type=int, default=5)
    ap.add_argument("--eta-runs", type=int, default=30)
    ap.add_argument("--eta-detail", help="write each measured run's submit, predicted, naive and actual start here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, prefect_server():
        tmp = Path(d)
        ours, stock = bench_ready(tmp, args.ready_runs) if args.ready_runs else ([float("nan")], [float("nan")])
        eta = bench_eta(tmp, args.eta_runs, args.eta_detail) if args.eta_runs else {"eta_mae_s": float("nan"),
                                                                   "naive_eta_mae_s": float("nan")}
    p50, sp50 = statistics.median(ours), statistics.median(stock)
    print(f"ready (submit -> JupyterLab answers with token): ours p50 {p50:.2f} s, stock p50 {sp50:.2f} s, "
          f"ratio {sp50 / p50:.1f}x")
    print(f"start-time prediction MAE (same runs): ours {eta['eta_mae_s']:.1f} s, naive {eta['naive_eta_mae_s']:.1f} s")
    print(json.dumps({"ready_p50_s": round(p50, 3), "stock_ready_p50_s": round(sp50, 3),
                      "speedup_p50": round(sp50 / p50, 2), "ready_runs_s": [round(x, 2) for x in ours],
                      "stock_ready_runs_s": [round(x, 2) for x in stock],
                      **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in eta.items()}}))


if __name__ == "__main__":
    main()
