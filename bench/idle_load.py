"""What an idle worker costs its Prefect server: stock Prefect `process` worker vs our `launch-process`
agent, in one run on one server.

A shared box runs agents all day and most of the day they wait. Each keeps polling: Prefect's worker
every 10 s (its poll and heartbeat), our agent more often (it re-plans every 2 s and on every flow-run
event, follows multi-node plans, publishes its free capacity), so that a run starts as soon as hardware
is free. This measures what that costs the server, with nothing submitted: the server's CPU seconds per
minute with no worker (its own services), then with one stock worker, then with one agent, each over
``--windows`` windows of ``--window`` seconds after a settling pause; and each worker's own CPU.

    .venv/bin/python bench/idle_load.py [--windows 5] [--window 20]

Prints medians, what each worker adds to the server (its windows less the server's own), and the ratio;
the last line is one JSON object: server_base_cpu_per_min_s, stock_server_cpu_per_min_s,
ours_server_cpu_per_min_s, stock_worker_cpu_per_min_s, ours_worker_cpu_per_min_s, ours_over_stock_server
(what the agent adds to the server over what the stock worker adds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stack import launch_agent, prefect_server, stock_and_launch_pools, stock_worker  # noqa: E402

SETTLE_S = 10.0  # after a worker starts: its start-up (imports, first sync) is not idle load


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def per_minute(server: list[psutil.Process], worker_pid: int | None, windows: int, window: float,
               label: str) -> tuple[list[float], list[float]]:
    """CPU seconds per minute of the server and of the worker's process tree, one figure per window."""
    srv: list[float] = []
    own: list[float] = []
    for k in range(windows):
        worker = _tree(worker_pid) if worker_pid else []
        s0, w0, t0 = _cpu(server), _cpu(worker), time.monotonic()
        time.sleep(window)
        dt = time.monotonic() - t0
        srv.append((_cpu(server) - s0) * 60 / dt)
        own.append((_cpu(worker) - w0) * 60 / dt)
        print(f"  {label}: window {k + 1}/{windows}: server {srv[-1]:.2f} CPU-s/min, worker {own[-1]:.2f}", flush=True)
    return srv, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--window", type=float, default=20.0, help="seconds per window")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="idle-load-bench-"))
    print(f"bench/idle_load.py: load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}, "
          f"{psutil.cpu_count()} CPUs; logs in {logs}", flush=True)
    with prefect_server():
        me = psutil.Process()
        server = [p for p in me.children(recursive=True) if "server" in " ".join(p.cmdline())]
        if not server:
            sys.exit("the Prefect server process was not found among this process's children")
        stock_and_launch_pools(logs)
        time.sleep(SETTLE_S)
        base, _ = per_minute(server, None, args.windows, args.window, "no worker")
        with stock_worker(logs) as proc:
            time.sleep(SETTLE_S)
            stock, stock_own = per_minute(server, proc.pid, args.windows, args.window, "stock process worker")
        with launch_agent(logs) as proc:
            time.sleep(SETTLE_S)
            ours, ours_own = per_minute(server, proc.pid, args.windows, args.window, "launch-process agent")

    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    figures = {
        "windows": args.windows, "window_s": args.window,
        "server_base_cpu_per_min_s": med(base),
        "stock_server_cpu_per_min_s": med(stock), "ours_server_cpu_per_min_s": med(ours),
        "stock_worker_cpu_per_min_s": med(stock_own), "ours_worker_cpu_per_min_s": med(ours_own),
    }
    added_stock = max(figures["stock_server_cpu_per_min_s"] - figures["server_base_cpu_per_min_s"], 1e-3)
    added_ours = max(figures["ours_server_cpu_per_min_s"] - figures["server_base_cpu_per_min_s"], 0.0)
    figures["ours_over_stock_server"] = round(added_ours / added_stock, 2)
    print(f"idle load, CPU seconds per minute (medians of {args.windows} x {args.window:g} s):")
    print(f"  server alone         : {figures['server_base_cpu_per_min_s']:.2f}")
    print(f"  stock process worker : server {figures['stock_server_cpu_per_min_s']:.2f} (+{added_stock:.2f}), "
          f"worker {figures['stock_worker_cpu_per_min_s']:.2f}")
    print(f"  launch-process agent : server {figures['ours_server_cpu_per_min_s']:.2f} (+{added_ours:.2f}), "
          f"agent {figures['ours_worker_cpu_per_min_s']:.2f}")
    print(f"  the agent adds {figures['ours_over_stock_server']:.1f}x what the stock worker adds to the server")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
