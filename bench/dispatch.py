"""Submit -> Running: stock Prefect `process` worker vs our `launch-process` agent, in one run.

Both paths get the same trivial deployment, the same submissions (one every
--gap seconds through the Prefect client) and the same server; the figure is
each run's server-side start_time minus its creation time.

    .venv/bin/python bench/dispatch.py [--runs 10] [--gap 2.0]

Last line: one JSON object with ours_p50_s, ours_p95_s, stock_p50_s, stock_p95_s, speedup_p50.
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

from _stack import (LAUNCH_QUEUE, ROOT, STOCK_POOL, launch_agent, percentile, prefect_server,  # noqa: E402
                    stock_and_launch_pools, stock_worker)


def deploy(pool: str, name: str) -> str:
    from prefect import flow

    flow.from_source(source=str(ROOT / "bench"), entrypoint="trivial_flow.py:trivial").deploy(
        name=name, work_pool_name=pool, build=False, push=False, print_next_steps=False)
    return f"trivial/{name}"


def measure(deployment: str, runs: int, gap: float, label: str) -> tuple[list[float], list[float]]:
    """Per run: submit -> Running, and submit -> claimed (Pending) to split pickup from start-up."""
    from prefect import get_client

    latencies: list[float] = []
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        ids = []
        for i in _progress(range(runs), f"{label}: submitting"):
            ids.append(client.create_flow_run_from_deployment(dep.id, parameters={"i": i}).id)
            time.sleep(gap)
        deadline = time.time() + 120 + runs * 5
        while time.time() < deadline:
            frs = [client.read_flow_run(i) for i in ids]
            if all(fr.start_time for fr in frs):
                break
            time.sleep(0.5)
        claims: list[float] = []
        for fr in frs:
            if fr.start_time:
                latencies.append((fr.start_time - fr.created).total_seconds())
                pend = [st.timestamp for st in client.read_flow_run_states(fr.id) if st.name == "Pending"]
                if pend:
                    claims.append((pend[0] - fr.created).total_seconds())
    if len(latencies) < runs:
        print(f"warning: {runs - len(latencies)} {label} runs never started", file=sys.stderr)
    return latencies, claims


def _progress(it, desc):
    try:
        from rich.progress import track

        return track(it, description=desc)
    except Exception:
        return it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between submissions")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="dispatch-bench-"))
    with prefect_server():
        stock_and_launch_pools(logs)
        stock_dep = deploy(STOCK_POOL, "stock")
        ours_dep = deploy(LAUNCH_QUEUE, "ours")

        with stock_worker(logs):
            time.sleep(5)
            stock, stock_claim = measure(stock_dep, args.runs, args.gap, "stock process worker")
        with launch_agent(logs):
            time.sleep(5)
            ours, ours_claim = measure(ours_dep, args.runs, args.gap, "launch-process agent")

    figures = {
        "runs": args.runs,
        "ours_p50_s": round(statistics.median(ours), 3),
        "ours_p95_s": round(percentile(ours, 0.95), 3),
        "stock_p50_s": round(statistics.median(stock), 3),
        "stock_p95_s": round(percentile(stock, 0.95), 3),
    }
    figures["speedup_p50"] = round(figures["stock_p50_s"] / figures["ours_p50_s"], 2)
    print(f"submit -> Running over {args.runs} trivial runs, one every {args.gap:g} s (logs in {logs})")
    print(f"  stock process worker : p50 {figures['stock_p50_s']:.2f} s  p95 {figures['stock_p95_s']:.2f} s"
          f"  (claimed after p50 {statistics.median(stock_claim):.2f} s)")
    print(f"  launch-process agent : p50 {figures['ours_p50_s']:.2f} s  p95 {figures['ours_p95_s']:.2f} s"
          f"  (claimed after p50 {statistics.median(ours_claim):.2f} s)")
    print(f"  speedup at p50       : {figures['speedup_p50']:.1f}x")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
