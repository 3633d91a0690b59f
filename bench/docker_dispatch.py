"""Submit -> Running and submit -> container started: stock prefect-docker `docker` worker vs our `launch-docker`.

One run, one Prefect server, one dockerd (tests/docker_env.py starts a private one
when none answers, and builds the local base image when it is missing): the same
image job (bench/trivial_flow.py, mounted into the container), the same
submissions (one every --gap seconds through the Prefect client). Per run:
server-side start_time minus creation time, and the container's StartedAt minus
creation time. Our containers are kept (``keep_container``) so each preset limit
is read back with docker inspect (``limits_ok``).

    .venv/bin/python bench/docker_dispatch.py [--runs 10] [--gap 2.0]

Last line: one JSON object with ours_p50_s, ours_p95_s, stock_p50_s, stock_p95_s, speedup_p50,
ours_container_p50_s, stock_container_p50_s, limits_ok.
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


def measure(deployment: str, runs: int, gap: float, label: str, docker_client):
    """Per run: submit -> Running (server) and submit -> container started (dockerd)."""
    from prefect import get_client

    running: list[float] = []
    container: list[float] = []
    containers = {}
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        ids = []
        for i in range(runs):
            ids.append(client.create_flow_run_from_deployment(dep.id, parameters={"i": i}).id)
            time.sleep(gap)
        deadline = time.time() + 180 + runs * 10
        while time.time() < deadline:
            frs = [client.read_flow_run(i) for i in ids]
            if all(fr.state and fr.state.is_final() for fr in frs):
                break
            time.sleep(0.5)
        for fr in frs:
            found = docker_client.containers.list(all=True, filters={"label": f"{FLOW_RUN_LABEL}={fr.id}"})
            if fr.start_time:
                running.append((fr.start_time - fr.created).total_seconds())
            if found:
                containers[str(fr.id)] = found[0]
                container.append(_started_at(found[0].attrs["State"]["StartedAt"]) - fr.created.timestamp())
        states = [fr.state_name for fr in frs]
    if len(running) < runs:
        print(f"warning: {label}: {runs - len(running)} runs never started; states {states}", file=sys.stderr)
    return running, container, containers, states


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
    from prefect_launch.workers.resources import parse_size

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between submissions")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="docker-dispatch-bench-"))
    py = sys.executable
    from docker_env import base_image, docker_daemon

    import docker

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
            f"    image: {image}\n    presets: {{tiny: {json.dumps(PRESET)}}}\n    default_preset: tiny\n")
        subprocess.run([py, "-m", "prefect_launch.cli", "queue", "apply", str(queues)], check=True,
                       capture_output=True)
        stock_dep = deploy("bench-stock-docker", "stock", image, image_pull_policy="Never")
        ours_dep = deploy("bench-launch-docker", "ours", image, keep_container=True)
        env = dict(os.environ, DOCKER_HOST=url)
        with background([py, "-m", "prefect", "worker", "start", "--pool", "bench-stock-docker", "--type", "docker"],
                        logs / "stock-worker.log", env):
            wait_worker("bench-stock-docker")
            stock, stock_c, stock_containers, stock_states = measure(stock_dep, args.runs, args.gap,
                                                                      "stock docker worker", client)
        with background([py, "-m", "prefect_launch.cli", "agent", "--queue", "bench-launch-docker", "--name",
                         "bench-docker", "--capacity", "cpu=2,memory=8Gi"], logs / "launch-agent.log", env):
            wait_worker("bench-launch-docker")
            ours, ours_c, ours_containers, ours_states = measure(ours_dep, args.runs, args.gap,
                                                                  "launch-docker agent", client)
        checked = limits_ok(ours_containers)
        for c in list(stock_containers.values()) + list(ours_containers.values()):
            c.remove(force=True)
        client.close()

    figures = {
        "runs": args.runs,
        "ours_p50_s": round(statistics.median(ours), 3),
        "ours_p95_s": round(percentile(ours, 0.95), 3),
        "stock_p50_s": round(statistics.median(stock), 3),
        "stock_p95_s": round(percentile(stock, 0.95), 3),
        "ours_container_p50_s": round(statistics.median(ours_c), 3),
        "ours_container_p95_s": round(percentile(ours_c, 0.95), 3),
        "stock_container_p50_s": round(statistics.median(stock_c), 3),
        "stock_container_p95_s": round(percentile(stock_c, 0.95), 3),
        "ours_completed": ours_states.count("Completed"),
        "stock_completed": stock_states.count("Completed"),
        "limits_ok": checked,
    }
    figures["speedup_p50"] = round(figures["stock_p50_s"] / figures["ours_p50_s"], 2)
    print(f"image job, {args.runs} runs one every {args.gap:g} s (logs in {logs})")
    for who, key in (("stock docker worker", "stock"), ("launch-docker agent", "ours")):
        print(f"  {who:20s}: submit->Running p50 {figures[key + '_p50_s']:.2f} s p95 {figures[key + '_p95_s']:.2f} s;"
              f" submit->container started p50 {figures[key + '_container_p50_s']:.2f} s"
              f" p95 {figures[key + '_container_p95_s']:.2f} s")
    print(f"  speedup at p50 (Running): {figures['speedup_p50']:.1f}x; limits read back: {checked}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
