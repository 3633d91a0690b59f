"""Preemptible fill: regular GPU jobs' wait on a box a sweep keeps busy, with preemption on and off.

A 2-GPU declared agent; a sweep of T one-GPU trials (S seconds each) is submitted first; once the
sweep holds both GPUs, B bursts of R regular one-GPU jobs (1 s each) arrive G seconds apart. Each
regular job's wait is its first Running timestamp minus its creation (the runs' own state history).
"On": the trials are `--preemptible` (grace P s); "off": the same trials as regular runs, which is what
stock Prefect or W&B Launch gives (regular jobs queue behind the sweep). The GPU busy share is the
share of GPU-seconds held by some run between the first start and the last end (from the state
histories: Running -> end of that life), and lost trials are those that never completed.

    .venv/bin/python bench/preemption.py [--trials 20] [--trial-seconds 20] [--bursts 3] [--burst-size 2]

Last line JSON: wait_p50_s, wait_p95_s, wait_p50_no_preempt_s, gpu_busy_share, lost_trials, speedup_p50.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _stack import percentile, prefect_server  # noqa: E402
from launch_helpers import agent, apply_queue, cli_json, deploy_probe, wait_final  # noqa: E402

PRESETS = {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _submit(job: str, rec: Path, seconds: float, *extra: str) -> str:
    return cli_json("submit", job, "--param", f"record_dir={rec}", "--param", f"seconds={seconds}", *extra)["run_ids"][0]


def _lives(run_id: str) -> list[tuple[float, float]]:
    """(start, end) of each time the run held a GPU: Running -> the next state that is not Running."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
    out, start = [], None
    for s in states:
        if s.type.value == "RUNNING" and start is None:
            start = s.timestamp.timestamp()
        elif s.type.value != "RUNNING" and start is not None:
            out.append((start, s.timestamp.timestamp()))
            start = None
    return out


def _first_running(run_id: str) -> float:
    lives = _lives(run_id)
    return lives[0][0] if lives else float("nan")


def scenario(tmp: Path, preempt: bool, trials: int, trial_s: float, bursts: int, size: int, gap: float,
             grace: str) -> dict:
    name = f"pre-{'on' if preempt else 'off'}"
    q = apply_queue(tmp, {"name": name, "presets": PRESETS, "default_preset": "g1", "preempt_grace": grace})
    job = deploy_probe(q, name)
    rec = tmp / name
    with agent([q], name, "cpu=4,memory=8Gi,gpu=2", tmp):
        extra = ("--preemptible",) if preempt else ()
        sweep = [_submit(job, rec, trial_s, *extra) for _ in range(trials)]
        say(f"{name}: {trials} trials submitted; waiting for them to hold both GPUs")
        deadline = time.time() + 120
        while time.time() < deadline and sum(bool(_lives(r)) or _is_running(r) for r in sweep[:2]) < 2:
            time.sleep(1)
        regular: list[str] = []
        for b in range(bursts):
            regular += [_submit(job, rec, 1.0) for _ in range(size)]
            say(f"{name}: burst {b + 1}/{bursts} of {size} regular jobs")
            time.sleep(gap)
        runs = {str(r.id): r for r in wait_final(sweep + regular, timeout=trials * trial_s * 2 + 900)}
    waits = [_first_running(r) - runs[r].created.timestamp() for r in regular]
    lives = [life for r in sweep + regular for life in _lives(r)]
    t0, t1 = min(s for s, _ in lives), max(e for _, e in lives)
    busy = sum(e - s for s, e in lives) / (2 * (t1 - t0))
    lost = sum(runs[r].state_name != "Completed" for r in sweep)
    preempted = sum(len(_lives(r)) - 1 for r in sweep)
    out = {"wait_p50_s": round(statistics.median(waits), 2), "wait_p95_s": round(percentile(waits, 0.95), 2),
           "gpu_busy_share": round(min(1.0, busy), 3), "lost_trials": lost, "preemptions": preempted,
           "regular_failed": sum(runs[r].state_name != "Completed" for r in regular)}
    say(f"{name}: {out}")
    return out


def _is_running(run_id: str) -> bool:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state_name == "Running"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--trial-seconds", type=float, default=20.0)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst-size", type=int, default=2)
    ap.add_argument("--gap", type=float, default=15.0, help="seconds between bursts")
    ap.add_argument("--grace", default="5s", help="the queue's preempt_grace")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="preempt-bench-"))
    with prefect_server():
        on = scenario(tmp, True, args.trials, args.trial_seconds, args.bursts, args.burst_size, args.gap, args.grace)
        off = scenario(tmp, False, args.trials, args.trial_seconds, args.bursts, args.burst_size, args.gap, args.grace)
    figures = {"wait_p50_s": on["wait_p50_s"], "wait_p95_s": on["wait_p95_s"],
               "wait_p50_no_preempt_s": off["wait_p50_s"], "gpu_busy_share": on["gpu_busy_share"],
               "lost_trials": on["lost_trials"],
               "speedup_p50": round(off["wait_p50_s"] / on["wait_p50_s"], 2) if on["wait_p50_s"] else None,
               "details": {"on": on, "off": off, "args": vars(args),
                           "loadavg": Path("/proc/loadavg").read_text().split()[:3]}}
    print(f"regular jobs' wait p50: {on['wait_p50_s']} s with preemption, {off['wait_p50_s']} s without "
          f"({figures['speedup_p50']}x); GPU busy {on['gpu_busy_share']:.0%}; lost trials {on['lost_trials']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
