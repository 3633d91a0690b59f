"""Sessions: time to a usable JupyterLab, ours vs stock Prefect; and how good our start-time predictions are.

(a) An interactive session is submitted; the figure is submit -> JupyterLab answering
    /api/status with the session's token. Ours: `start_session` on a launch queue served by
    a launch agent. Stock: the same session flow deployed on a plain `process` pool served by
    `prefect worker start --type process`, submitted with Prefect's client. Same server, same machine.
(b) A mixed batch workload (sleeps of different lengths, two presets) on two agents: at each
    submission, our predicted start (placement replayed forward) and the naive estimate (runs
    ahead and running x the queue's median run time / runs that fit at once) against the actual
    start; mean absolute errors.

    .venv/bin/python bench/sessions.py [--ready-runs 5] [--eta-runs 30]

Last line JSON: ready_p50_s, stock_ready_p50_s, eta_mae_s, naive_eta_mae_s.
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
            time.sleep(0.2)
    raise TimeoutError("no token")


def _ready(port: int, run_id: str, t0: float, client) -> float:
    deadline = time.time() + 180
    token = _token(client, run_id, deadline)
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"},
                         timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("JupyterLab never answered")


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
        time.sleep(5)
        with get_client(sync_client=True) as client:
            for i in range(n):
                t0 = time.time()
                out = start_session(client, SessionRequest(queue="bench-sessions", name=f"ready-{i}", owner="bench"),
                                    record_recent=False)
                ours.append(_ready(out.ports[0], out.run_ids[0], t0, client))
                _stop(client, out.run_ids[0])
                print(f"ours {i + 1}/{n}: {ours[-1]:.2f} s", flush=True)
    from prefect import flow

    _cli_env = dict(os.environ)
    subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", "bench-stock", "--type", "process"],
                   check=True, capture_output=True, env=_cli_env)
    flow.from_source(source=str(FLOWS_DIR), entrypoint="session.py:session").deploy(
        name="session-stock", work_pool_name="bench-stock", build=False, push=False, print_next_steps=False,
        ignore_warnings=True)
    with background([sys.executable, "-m", "prefect", "worker", "start", "--pool", "bench-stock", "--type", "process"],
                    tmp / "stock.log"):
        time.sleep(5)
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name("launch-session/session-stock")
            for i in range(n):
                port = free_port()
                t0 = time.time()
                fr = client.create_flow_run_from_deployment(dep.id, parameters={"session_type": "interactive",
                                                                               "ports": [port]})
                stock.append(_ready(port, str(fr.id), t0, client))
                _stop(client, str(fr.id))
                print(f"stock {i + 1}/{n}: {stock[-1]:.2f} s", flush=True)
    return ours, stock


def bench_eta(tmp: Path, n: int) -> tuple[float, float]:
    """Submit a mixed batch workload at once; compare predictions made right after each submission."""
    from prefect import get_client

    from prefect_launch.deployments.eta_reader import predicted_starts
    from prefect_launch.deployments.sessions import SessionRequest, start_session

    qfile = tmp / "eta.yaml"
    qfile.write_text("queues:\n- name: bench-eta\n  default_preset: one\n  presets:\n"
                     "    one: {cpu: 1, memory: 1Gi}\n    two: {cpu: 2, memory: 1Gi}\n")
    _cli("queue", "apply", str(qfile))
    lengths = [2, 6, 4, 8, 3]
    predicted, naive, ids = {}, {}, []
    agents = [background([*CLI, "agent", "--queue", "bench-eta", "--capacity", "cpu=2,memory=4Gi", "--name", f"eta-{k}",
                          "--on-exit", "cancel"], tmp / f"eta-{k}.log") for k in range(2)]
    for a in agents:
        a.__enter__()
    try:
        time.sleep(6)
        with get_client(sync_client=True) as client:
            # warm-up: one run per length gives every job shape a past run time (our medians use the job)
            for i in range(n):
                secs = lengths[i % len(lengths)]
                preset = "two" if i % 3 == 0 else "one"
                now = datetime.now(timezone.utc)
                out = start_session(client, SessionRequest(type="batch", queue="bench-eta", name=f"eta-{i:03d}",
                                                           owner="bench", preset=preset, timeout=f"{secs + 2}s",
                                                           startup_command=f"sleep {secs}"), record_recent=False)
                rid = out.run_ids[0]
                ids.append(rid)
                predicted[rid] = (predicted_starts(client, ["bench-eta"], now).get(rid), now)
                ahead = len([x for x in ids[:-1] if not client.read_flow_run(x).state.is_final()])
                # naive: runs ahead (running and waiting) x the queue's median run time / runs that fit at once
                naive[rid] = now.timestamp() + ahead * statistics.median(lengths) / 4  # 2 agents x 2 one-CPU runs
            deadline = time.time() + 600
            while time.time() < deadline and not all(client.read_flow_run(x).state.is_final() for x in ids):
                time.sleep(1)
            errs, nerrs = [], []
            for rid in ids:
                fr = client.read_flow_run(rid)
                if not fr.start_time:
                    continue
                actual = fr.start_time.timestamp()
                p, _ = predicted[rid]
                if p is not None:
                    errs.append(abs(p.timestamp() - actual))
                nerrs.append(abs(naive[rid] - actual))
    finally:
        for a in agents:
            a.__exit__(None, None, None)
    print(f"eta: {len(errs)} predictions (of {n}), naive {len(nerrs)}", flush=True)
    return (statistics.mean(errs) if errs else float("nan")), (statistics.mean(nerrs) if nerrs else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready-runs", type=int, default=5)
    ap.add_argument("--eta-runs", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, prefect_server():
        tmp = Path(d)
        ours, stock = bench_ready(tmp, args.ready_runs)
        mae, naive_mae = bench_eta(tmp, args.eta_runs)
    p50, sp50 = statistics.median(ours), statistics.median(stock)
    print(f"ready (submit -> JupyterLab answers with token): ours p50 {p50:.2f} s, stock p50 {sp50:.2f} s, "
          f"ratio {sp50 / p50:.1f}x")
    print(f"start-time prediction MAE: ours {mae:.1f} s, naive {naive_mae:.1f} s")
    print(json.dumps({"ready_p50_s": round(p50, 3), "stock_ready_p50_s": round(sp50, 3),
                      "speedup_p50": round(sp50 / p50, 2), "eta_mae_s": round(mae, 2),
                      "naive_eta_mae_s": round(naive_mae, 2)}))


if __name__ == "__main__":
    main()
