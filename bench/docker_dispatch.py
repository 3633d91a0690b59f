"""Submit -> Running and submit -> container started: stock prefect-docker `docker` worker vs our `launch-docker`.

One run, one Prefect server, one dockerd (tests/docker_env.py starts a private one
when none answers, and builds the local base image when it is missing): the same
image job (bench/trivial_flow.py, mounted into the container), the same
submissions (one every --gap seconds through the Prefect client). Per run:
server-side start_time minus creation time, and the container's StartedAt minus
creation time. Our containers are kept (``keep_container``) so each preset limit
is read back with docker inspect (``limits_ok``).

    .venv/bin/python bench/docker_dispatch.py [--runs 10] [--gap 2.0]

Our queue keeps one warm container (``--warm 1``, the queue setting ``warm_containers``):
the first run starts cold and each later one in the container its predecessor's start
left warm (workers/backends/warm_containers.py); ``--warm 0`` times cold starts only. Stock
prefect-docker has no such thing, so it starts every run cold.

Each phase waits (up to --timeout s) for all its runs to end, then stops its containers so they
do not load the next phase. A percentile no run reached is null, never a crash.

Last line: one JSON object with ours_p50_s, ours_p95_s, stock_p50_s, stock_p95_s, speedup_p50,
ours_container_p50_s, stock_container_p50_s, limits_ok, warm_containers, ours_warm_started; also submit -> claimed (Pending) p50 per side
(dispatch alone, before any container), the runs that reached Running / Completed per side, and this
machine's 1-minute load average at start and end.
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
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _stack import ROOT, background, percentile, prefect_server  # noqa: E402

PRESET = {"cpu": 0.5, "memory": "256Mi", "gpu": 0, "shm_size": "32Mi"}
FLOW_RUN_LABEL = "io.prefect.flow-run-id"  # prefect-docker's container label for the run


def deploy(pool: str, name: str, image: str, **job_variables) -> str:
    from prefect import flow

    bench = str(ROOT / "bench")
    flow.from_source(source=bench, entrypoint="trivial_flow.py:trivial").deploy(
        name=name, work_pool_name=pool, build=False, push=False, print_next_steps=False, image=image,
        job_variables={"volumes": [f"{bench}:{bench}:ro"], "network_mode": "host", "stream_output": False,
                       **job_variables})
    return f"trivial/{name}"


def _started_at(value: str) -> float:
    """Docker's RFC 3339 nanosecond timestamp as epoch seconds."""
    head, _, frac = value.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0")[:6])


def measure(deployment: str, runs: int, gap: float, label: str, docker_client, timeout: float):
    """Per run: submit -> Running (server) and submit -> container started (dockerd).

    Waits until every run is final (at most ``timeout`` s after the last submission); runs still
    not final then are cancelled so they do not load the next phase, and their containers are
    read (limits) and then stopped.
    """
    from prefect import get_client
    from prefect.states import Cancelled

    running: list[float] = []
    container: list[float] = []
    claimed: list[float] = []
    warm: list[bool] = []
    containers = {}
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        ids = []
        for i in range(runs):
            ids.append(client.create_flow_run_from_deployment(dep.id, parameters={"i": i}).id)
            time.sleep(gap)
        deadline = time.time() + timeout
        while True:
            frs = [client.read_flow_run(i) for i in ids]
            if all(fr.state and fr.state.is_final() for fr in frs) or time.time() > deadline:
                break
            time.sleep(0.5)
        for fr in frs:
            pending = [st.timestamp for st in client.read_flow_run_states(fr.id) if st.type.value == "PENDING"]
            if pending:  # the worker's claim: what dispatch itself costs, before any container exists
                claimed.append((min(pending) - fr.created).total_seconds())
            found = docker_client.containers.list(all=True, filters={"label": f"{FLOW_RUN_LABEL}={fr.id}"})
            if not found:  # a warm-started container: its labels were fixed before the run, its name is the run's
                found = [c for c in docker_client.containers.list(all=True, filters={"name": f"launch-{fr.id}"})
                         if c.name == f"launch-{fr.id}"]
                warm.append(bool(found))
            if fr.start_time:
                running.append((fr.start_time - fr.created).total_seconds())
            if found:
                containers[str(fr.id)] = found[0]
                started = found[0].attrs["State"]["StartedAt"]
                if not started.startswith("0001-"):  # never started: Docker's zero time
                    container.append(_started_at(started) - fr.created.timestamp())
        states = [fr.state_name for fr in frs]
        late = [fr for fr in frs if not (fr.state and fr.state.is_final())]
        for fr in late:
            client.set_flow_run_state(fr.id, Cancelled(message=f"benchmark: not final {timeout:g} s after the "
                                                               "last submission"), force=True)
    if late:
        print(f"warning: {label}: {len(late)} of {runs} runs not final after {timeout:g} s "
              f"(states {states}); cancelled", file=sys.stderr, flush=True)
    if len(running) < runs:
        print(f"warning: {label}: {runs - len(running)} runs never reached Running", file=sys.stderr, flush=True)
    return running, container, containers, states, claimed, sum(warm)


def stop_containers(containers: dict) -> None:
    """Stop a phase's containers before the next phase starts (a lingering one would load it)."""
    for c in containers.values():
        try:
            c.reload()
            if c.status == "running":
                c.kill()
        except Exception:
            pass


def wait_worker(pool: str, timeout: float = 300) -> None:
    """Submit only once a worker of ``pool`` has polled the server (imports are slow on a busy machine)."""
    from prefect import get_client

    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            if client.read_workers_for_work_pool(pool):
                time.sleep(2)  # its first poll and event subscription
                return
            time.sleep(0.5)
    raise RuntimeError(f"no worker of {pool} came online in {timeout:g} s")


def limits_ok(containers: dict) -> bool:
    from prefect_launch.workers.scheduling.resources import parse_size

    mem = parse_size(PRESET["memory"])
    ok = bool(containers)
    for c in containers.values():
        hc = c.attrs["HostConfig"]
        ok &= hc["NanoCpus"] == int(PRESET["cpu"] * 1e9)
        ok &= hc["Memory"] == mem and hc["MemorySwap"] == mem
        ok &= hc["ShmSize"] == parse_size(PRESET["shm_size"])
        ok &= len(hc["CpusetCpus"].split(",")) == 1
        ok &= hc["NetworkMode"] == "host"
    return ok


def _p(values: list[float], q: float):
    """A percentile rounded for the report, or None when no run got there (never a crash)."""
    if not values:
        return None
    return round(statistics.median(values) if q == 0.5 else percentile(values, q), 3)


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between submissions")
    ap.add_argument("--warm", type=int, default=1,
                    help="our queue's warm_containers (0: every container starts cold, as prefect-docker's do)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds after the last submission to wait for every run of a phase to end")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="docker-dispatch-bench-"))
    py = sys.executable
    from docker_env import base_image, docker_daemon

    import docker

    load_before = round(os.getloadavg()[0], 2)
    with docker_daemon() as url, prefect_server():
        os.environ["DOCKER_HOST"] = url
        client = docker.DockerClient(base_url=url, timeout=120)
        t0 = time.time()
        image = base_image(client)
        print(f"base image {image} ready in {time.time() - t0:.1f} s", flush=True)
        from prefect import get_client
        from prefect.client.schemas.actions import WorkPoolCreate

        from prefect_docker.worker import DockerWorker

        with get_client(sync_client=True) as pc:
            pc.create_work_pool(WorkPoolCreate(name="bench-stock-docker", type="docker",
                                               base_job_template=DockerWorker.get_default_base_job_template()))
        queues = logs / "queues.yaml"
        queues.write_text(
            "queues:\n  - name: bench-launch-docker\n    target: docker\n"
            f"    image: {image}\n    presets: {{tiny: {json.dumps(PRESET)}}}\n    default_preset: tiny\n"
            f"    warm_containers: {args.warm}\n")
        subprocess.run([py, "-m", "prefect_launch.cli", "queue", "apply", str(queues)], check=True,
                       capture_output=True)
        stock_dep = deploy("bench-stock-docker", "stock", image, image_pull_policy="Never")
        ours_dep = deploy("bench-launch-docker", "ours", image, keep_container=True)
        env = dict(os.environ, DOCKER_HOST=url)
        with background([py, "-m", "prefect", "worker", "start", "--pool", "bench-stock-docker", "--type", "docker"],
                        logs / "stock-worker.log", env):
            wait_worker("bench-stock-docker")
            stock, stock_c, stock_containers, stock_states, stock_claim, _ = measure(stock_dep, args.runs, args.gap,
                                                                      "stock docker worker", client, args.timeout)
        stop_containers(stock_containers)
        with background([py, "-m", "prefect_launch.cli", "agent", "--queue", "bench-launch-docker", "--name",
                         "bench-docker", "--capacity", "cpu=2,memory=8Gi"], logs / "launch-agent.log", env):
            wait_worker("bench-launch-docker")
            ours, ours_c, ours_containers, ours_states, ours_claim, ours_warm = measure(ours_dep, args.runs, args.gap,
                                                                  "launch-docker agent", client, args.timeout)
            stop_containers(ours_containers)
        checked = limits_ok(ours_containers)
        for c in list(stock_containers.values()) + list(ours_containers.values()):
            c.remove(force=True)
        client.close()

    figures = {
        "runs": args.runs,
        "ours_p50_s": _p(ours, 0.5),
        "ours_p95_s": _p(ours, 0.95),
        "stock_p50_s": _p(stock, 0.5),
        "stock_p95_s": _p(stock, 0.95),
        "ours_container_p50_s": _p(ours_c, 0.5),
        "ours_container_p95_s": _p(ours_c, 0.95),
        "stock_container_p50_s": _p(stock_c, 0.5),
        "stock_container_p95_s": _p(stock_c, 0.95),
        "ours_claim_p50_s": _p(ours_claim, 0.5),
        "stock_claim_p50_s": _p(stock_claim, 0.5),
        "ours_running": len(ours),
        "stock_running": len(stock),
        "ours_completed": ours_states.count("Completed"),
        "stock_completed": stock_states.count("Completed"),
        "limits_ok": checked,
        "warm_containers": args.warm,
        "ours_warm_started": ours_warm,  # runs that started in a warm container (the rest started cold)
        "loadavg_1m": [load_before, round(os.getloadavg()[0], 2)],  # this machine's load at start and end
    }
    both = figures["ours_p50_s"] and figures["stock_p50_s"]
    figures["speedup_p50"] = round(figures["stock_p50_s"] / figures["ours_p50_s"], 2) if both else None
    print(f"image job, {args.runs} runs one every {args.gap:g} s (logs in {logs}); "
          f"load average {figures['loadavg_1m'][0]} at start, {figures['loadavg_1m'][1]} at end")
    for who, key in (("stock docker worker", "stock"), ("launch-docker agent", "ours")):
        print(f"  {who:20s}: {figures[key + '_running']}/{args.runs} Running, {figures[key + '_completed']} "
              f"Completed; submit->Running p50 {_fmt(figures[key + '_p50_s'])} p95 {_fmt(figures[key + '_p95_s'])};"
              f" submit->claimed (Pending) p50 {_fmt(figures[key + '_claim_p50_s'])};"
              f" submit->container started p50 {_fmt(figures[key + '_container_p50_s'])}"
              f" p95 {_fmt(figures[key + '_container_p95_s'])}")
    print(f"  launch-docker runs started in a warm container: {ours_warm} of {args.runs} (warm_containers: {args.warm});"
          " a warm container started before its run was submitted, so its submit->container started is negative")
    speedup = f"{figures['speedup_p50']:.1f}x" if figures["speedup_p50"] else "n/a"
    print(f"  speedup at p50 (Running): {speedup}; limits read back: {checked}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
