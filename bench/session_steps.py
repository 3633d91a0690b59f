"""Where does an interactive session's time to a usable JupyterLab go? One line per step.

Starts a throw-away server and one agent, submits ``--runs`` interactive sessions one after
the other and, for each, splits submit -> JupyterLab answering /api/status with its token
into: submit -> claim (Pending), claim -> engine running the flow (Running), Running -> flow
body (first session log), flow body -> app listening ("ready on" log), listening -> token
stored (Secret readable), token -> /api/status 200. Timestamps come from the run's state
history and its logs (server clock = this machine's clock).

    .venv/bin/python bench/session_steps.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stack import background, prefect_server  # noqa: E402

CLI = [sys.executable, "-m", "prefect_launch.cli"]
STEPS = ["submit->claim", "claim->running", "running->flow body", "flow body->listening", "listening->token",
         "token->answers", "total"]


def one(client, i: int) -> dict[str, float]:
    from prefect.blocks.system import Secret
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.states import Cancelling

    from prefect_launch.deployments.sessions import SessionRequest, start_session

    t0 = time.time()
    out = start_session(client, SessionRequest(queue="steps", name=f"steps-{i}", owner="bench"), record_recent=False)
    rid, port = out.run_ids[0], out.ports[0]
    deadline = time.time() + 240
    token = t_token = None
    while token is None and time.time() < deadline:
        try:
            token = Secret.load(f"session-token-{rid}").get()
            t_token = time.time()
        except Exception:
            time.sleep(0.05)
    t_ok = None
    while t_ok is None and time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"},
                         timeout=2).status_code == 200:
                t_ok = time.time()
        except httpx.HTTPError:
            time.sleep(0.05)
    states = {s.type.value: s.timestamp.timestamp() for s in reversed(client.read_flow_run_states(rid))}
    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[rid])))
    body = min((lg.timestamp.timestamp() for lg in logs if "mounts" in lg.message), default=float("nan"))
    listening = min((lg.timestamp.timestamp() for lg in logs if "ready on" in lg.message), default=float("nan"))
    how = next((("fork" if "forked" in lg.message else "cold") for lg in logs if "ready on" in lg.message), "?")
    client.set_flow_run_state(rid, Cancelling(), force=True)
    while time.time() < deadline and not client.read_flow_run(rid).state.is_final():
        time.sleep(0.3)
    marks = [t0, states.get("PENDING"), states.get("RUNNING"), body, listening, t_token, t_ok]
    row = {STEPS[k]: marks[k + 1] - marks[k] for k in range(6)}
    row["total"] = t_ok - t0
    row["how"] = how
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0, help="seconds to wait once the agent has polled")
    ap.add_argument("--keep-log", help="copy the agent's log here")
    ap.add_argument("--gap", type=float, default=0, help="seconds between sessions")
    args = ap.parse_args()
    from prefect import get_client

    with tempfile.TemporaryDirectory() as d, prefect_server():
        tmp = Path(d)
        (tmp / "q.yaml").write_text("queues:\n- name: steps\n  default_preset: s\n  presets:\n    s: {cpu: 1, memory: 2Gi}\n")
        subprocess.run([*CLI, "queue", "apply", str(tmp / "q.yaml")], check=True, capture_output=True)
        rows = []
        with background([*CLI, "agent", "--queue", "steps", "--capacity", "cpu=2,memory=8Gi", "--name", "steps",
                         "--on-exit", "cancel"], tmp / "agent.log"):
            with get_client(sync_client=True) as client:
                while not client.read_workers_for_work_pool("steps"):
                    time.sleep(0.5)
                time.sleep(args.settle)
                for i in range(args.runs):
                    rows.append(one(client, i))
                    print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in rows[-1].items()), flush=True)
                    time.sleep(args.gap)
        if args.keep_log:
            Path(args.keep_log).write_text((tmp / "agent.log").read_text(errors="replace"))
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.2f} s" for k in STEPS))


if __name__ == "__main__":
    main()
