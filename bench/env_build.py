"""Job environments (issue 39 section 5): ours against Prefect's `pip_install_requirements` pull step, in one run.

The same job needs three small packages (launchalpha, launchbeta, launchgamma: wheels written into a local
folder, installed offline, no network). On one throw-away Prefect server:

- **ours**: a launch agent; the job declares ``environment: {requirements: [...], find_links: <folder>}``. The
  first run builds the environment (``cold_build_s``: the build's own time, from the cache's record); later
  runs find it built. ``ours_warm_start_overhead_s`` = median claim->Running of a run of the built environment
  minus that of the same agent's run with no environment (a trivial flow). A run with an environment starts
  cold (the agent's warm engines run the agent's own Python), so this is measured twice: against the default
  agent (its no-environment runs start warm) and against an agent with ``LAUNCH_WARM_ENGINES=0`` (both cold:
  the environment's own cost), reported as ``ours_env_overhead_vs_cold_s``.
- **stock**: ``prefect worker start --type process`` with the pull steps ``set_working_directory`` +
  ``pip_install_requirements`` (its requirements.txt names the folder with ``--no-index --find-links``).
  ``stock_per_run_install_s`` = median claim->Running of those runs (after the first, which really installs:
  every later run still runs pip, finding everything "already satisfied") minus that of the stock worker's run
  with no pull-step install. The stock worker runs in a throw-away virtual environment that sees the project's
  packages through a .pth file, so its installs never touch .venv.

``ours_env_prepare_s``: the agent's own time on a built environment per run (the lookup and the deployment read,
from the run's ``build`` record). ``speedup_warm`` = stock_per_run_install_s / max(ours_warm_start_overhead_s,
ours_env_prepare_s): where the start latencies' difference is within their noise (at or below zero), the agent's
measured time is the floor. All runs of a comparison alternate (A, B, A, B, ...) so a slow moment falls on both.

**Docker** (issue 39 section 3; skipped with ``--no-docker`` or where no Docker daemon can run, keys then null):
one dockerd (tests/docker_env.py: a private one when none answers) and the local base image (Prefect on Debian).
The same job, its folder and the wheel folder mounted into the container:

- **ours**: a ``launch-docker`` queue FROM the base image (``warm_containers: 0``: the comparison is of the
  environment, not of warm containers); the job declares the same ``environment``. ``docker_cold_build_s``: the
  first run's image build (``launch-env/<job>:<hash>``, from its ``build`` record); ``docker_warm_overhead_s`` =
  median claim->Running of a run whose image is built minus that of a no-environment run (alternating).
- **stock**: prefect-docker's ``docker`` worker on the base image, the job's pull steps
  ``set_working_directory`` + ``pip_install_requirements`` run in each new container;
  ``docker_stock_per_run_install_s`` = median claim->Running of those runs minus that of a no-install run. A new
  container starts from the image, so *every* stock run really installs (nothing is "already satisfied").
- ``docker_speedup_warm`` = docker_stock_per_run_install_s / max(docker_warm_overhead_s, the agent's own time
  on a built image per run, from its ``build`` record). The docker start latencies (4-12 s on the shared box)
  vary far more than either side's install, so both differences are noise-bound: a run on 2026-12-06 had
  ours at -2.1 s (the floor, 0.05 s, was used) and stock at 0.67 s.

**Why the process ``speedup_warm`` goal (10x) is not reliably met** (bench/results/env_build.txt): the ratio's
denominator is a difference of two start-latency medians (~0.6 s each on a quiet box) whose run-to-run spread
(0.5-0.75 s) is larger than the difference itself, while the agent's own measured work on a built environment
(``ours_env_prepare_s``: the cache lookup, the record) is ~0.01 s; and its numerator is small because pip, on the
stock worker's *shared* environment, finds three tiny wheels "already satisfied" in ~0.5 s from the second run
on. 10x needs ours <= 0.05 s over a no-environment run, below what five runs of this measurement resolve: a
quiet run gave 0.09 s (5.5x), one at load 4-5 0.29 s (5.6x), a loaded one (load average 11-19 on 2 cores)
0.19 s against a stock step inflated to 13 s (69x). Neither ratio measures our work; the floor (0.01 s) would be ~50x on the quiet figures. A stock
worker that installs per run into a fresh environment (the docker case: every container starts from the image)
pays the whole install each run.

    .venv/bin/python bench/env_build.py               # 5 runs of each kind
    .venv/bin/python bench/env_build.py --repeats 3   # quicker
    .venv/bin/python bench/env_build.py --no-docker   # the process half only

Progress on stderr; medians and ratios on stdout; last line one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _stack import LAUNCH_QUEUE, STOCK_POOL, background, prefect_server, stock_and_launch_pools  # noqa: E402
from env_wheels import wheel_folder  # noqa: E402

PY = sys.executable
DOCKER_QUEUE = "bench-env-docker"  # a launch docker queue FROM the local base image
STOCK_DOCKER = "bench-env-stock-docker"  # a stock prefect-docker `docker` work pool
PACKAGES = ["launchalpha", "launchbeta", "launchgamma"]
FLOW = '''
from prefect import flow


@flow
def needs():
    import launchalpha, launchbeta, launchgamma
    return [launchalpha.hello(), launchbeta.hello(), launchgamma.hello()]


@flow
def plain():
    return "ok"
'''


def _ratio(stock_cost: float, ours_cost: float) -> "float | None":
    """Stock's per-run cost over ours; None when either is not above zero (a difference of medians within the
    start latencies' noise: a ratio of it, even a negative one, would say nothing)."""
    return round(stock_cost / ours_cost, 2) if stock_cost > 0 and ours_cost > 0 else None


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def deployment(client, name: str, entry: str, pool: str, job_dir: Path, pip: bool, job_variables: dict) -> str:
    from prefect.client.schemas.actions import DeploymentCreate  # noqa: F401 (the client builds it)

    flow_id = client.create_flow_from_name(entry)
    steps = [{"prefect.deployments.steps.set_working_directory": {"directory": str(job_dir)}}]
    if pip:
        steps.append({"prefect.deployments.steps.pip_install_requirements": {
            "directory": str(job_dir), "requirements_file": "requirements.txt", "stream_output": False}})
    launch = pool in (LAUNCH_QUEUE, DOCKER_QUEUE)  # launch queues have priority work queues
    return str(client.create_deployment(flow_id=flow_id, name=name, entrypoint=f"job.py:{entry}",
                                        work_pool_name=pool, work_queue_name="medium" if launch
                                        else None, pull_steps=steps, job_variables=job_variables, path=str(job_dir)))


def start_latency(client, run_id) -> float:
    """Seconds from the worker's claim (Pending) to Running, from the run's own state history."""
    states = client.read_flow_run_states(run_id)
    pend = min(s.timestamp for s in states if s.type.value == "PENDING")
    run = min(s.timestamp for s in states if s.type.value == "RUNNING")
    return (run - pend).total_seconds()


RUNS: dict[str, list] = {}  # deployment id -> its runs, in order


def run_once(client, dep_id: str, launch: bool, timeout: float = 180) -> float:
    from prefect_launch.workers.agent.queued_state import queued

    state = queued() if launch else None
    fr = client.create_flow_run_from_deployment(dep_id, state=state) if state else \
        client.create_flow_run_from_deployment(dep_id)
    RUNS.setdefault(dep_id, []).append(fr.id)
    deadline = time.time() + timeout
    while True:
        cur = client.read_flow_run(fr.id)
        if cur.state and cur.state.is_final():
            break
        if time.time() > deadline:
            raise SystemExit(f"run {fr.id} did not finish in {timeout:.0f} s (state {cur.state_name})")
        time.sleep(0.2)
    if not cur.state.is_completed():
        raise SystemExit(f"run {fr.id} ended {cur.state_name}: {cur.state.message}")
    return start_latency(client, fr.id)


def series(client, dep_id: str, launch: bool, n: int, what: str) -> list[float]:
    out = [run_once(client, dep_id, launch) for _ in range(n)]
    say(f"  {what}: {', '.join(f'{x:.2f}' for x in out)} s")
    return out


def interleaved(client, a: str, b: str, launch: bool, n: int, what_a: str, what_b: str) -> tuple[list, list]:
    """``n`` runs of each, alternating, so that a slow moment of the box falls on both alike."""
    xs, ys = [], []
    for _ in range(n):
        xs.append(run_once(client, a, launch))
        ys.append(run_once(client, b, launch))
    say(f"  {what_a}: {', '.join(f'{x:.2f}' for x in xs)} s")
    say(f"  {what_b}: {', '.join(f'{y:.2f}' for y in ys)} s")
    return xs, ys


def prepare_seconds(client, run_ids: list) -> list[float]:
    """The agent's own time between a run's claim and its start spent on its environment (cache hit: the lookup,
    the deployment read), from the run's ``build`` record in the scheduling history."""
    import re

    from prefect_launch.blocks.scheduling_history import read_history
    from prefect_launch.workers.metrics.run_sampling import load_store

    import anyio

    store = anyio.run(load_store)
    out = []
    for rid in run_ids:
        for rec in read_history(store, str(rid), phase="build"):
            m = re.search(r"capacity for ([0-9.]+) s", rec.message or "")
            if m:
                out.append(float(m.group(1)))
    return out


def build_record_seconds(run_id) -> tuple[Optional[float], Optional[float]]:
    """From the run's ``build`` record: (the build's own seconds on a cache miss, the agent's held seconds)."""
    import re

    import anyio

    from prefect_launch.blocks.scheduling_history import read_history
    from prefect_launch.workers.metrics.run_sampling import load_store

    store = anyio.run(load_store)
    for rec in read_history(store, str(run_id), phase="build"):
        built = re.search(r"built in ([0-9.]+) s", rec.message or "")
        held = re.search(r"capacity for ([0-9.]+) s", rec.message or "")
        return (float(built.group(1)) if built else None), (float(held.group(1)) if held else None)
    return None, None


def docker_half(work: Path, job_dir: Path, wheels: Path, environment: dict, n: int) -> dict:
    """Ours (launch-docker, an image per environment) against prefect-docker's worker with the pip pull step."""
    from docker_env import base_image, docker_daemon, why_no_docker

    why = why_no_docker()
    if why:
        return {"docker_reason": f"no Docker daemon: {why}"}
    import docker
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect_docker.worker import DockerWorker

    with docker_daemon() as url:
        os.environ["DOCKER_HOST"] = url
        dc = docker.DockerClient(base_url=url, timeout=300)
        image = base_image(dc)
        say(f"docker: base image {image}")
        queues = work / "queues-docker.yaml"
        queues.write_text(f"queues:\n  - name: {DOCKER_QUEUE}\n    target: docker\n    image: {image}\n"
                          "    presets: {tiny: {cpu: 0.5, memory: 512Mi}}\n    default_preset: tiny\n"
                          "    warm_containers: 0\n")
        subprocess.run([PY, "-m", "prefect_launch.cli", "queue", "apply", str(queues)], check=True,
                       capture_output=True)
        mounts = {"volumes": [f"{job_dir}:{job_dir}:ro", f"{wheels}:{wheels}:ro"], "network_mode": "host",
                  "stream_output": False, "image": image}
        with get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name=STOCK_DOCKER, type="docker",
                                                   base_job_template=DockerWorker.get_default_base_job_template()))
            deps = {
                "ours-env": deployment(client, "dk-ours-env", "needs", DOCKER_QUEUE, job_dir, False,
                                       {**mounts, "environment": environment}),
                "ours-plain": deployment(client, "dk-ours-plain", "plain", DOCKER_QUEUE, job_dir, False, mounts),
                "stock-env": deployment(client, "dk-stock-env", "needs", STOCK_DOCKER, job_dir, True,
                                        {**mounts, "image_pull_policy": "Never"}),
                "stock-plain": deployment(client, "dk-stock-plain", "plain", STOCK_DOCKER, job_dir, False,
                                          {**mounts, "image_pull_policy": "Never"}),
            }
            env = dict(os.environ, DOCKER_HOST=url)
            say("docker ours: launch agent on a docker queue (an image per environment)")
            with background([PY, "-m", "prefect_launch.cli", "agent", "--queue", DOCKER_QUEUE, "--name",
                             "bench-env-docker", "--capacity", "cpu=2,memory=8Gi"], work / "agent-docker.log", env):
                wait_agent(client, "bench-env-docker", timeout=240)
                cold = series(client, deps["ours-env"], True, 1, "docker environment, first run (builds the image)")
                ours_plain, ours_env = interleaved(client, deps["ours-plain"], deps["ours-env"], True, n,
                                                   "docker, no environment", "docker, image built (cache hit)")
            cold_build_s, _ = build_record_seconds(RUNS[deps["ours-env"]][0])
            held = [h for h in (build_record_seconds(r)[1] for r in RUNS[deps["ours-env"]][1:]) if h is not None]
            say("docker stock: prefect-docker worker, pip_install_requirements pull step in each container")
            with background([PY, "-m", "prefect", "worker", "start", "--pool", STOCK_DOCKER, "--type", "docker"],
                            work / "stock-docker-worker.log", env):
                series(client, deps["stock-env"], False, 1, "docker stock install step, first run")
                stock_plain, stock_env = interleaved(client, deps["stock-plain"], deps["stock-env"], False, n,
                                                     "docker stock, no install step", "docker stock, install step")
        for c in dc.containers.list(all=True, filters={"label": "io.prefect.flow-run-id"}):
            with contextlib.suppress(Exception):
                c.remove(force=True)
        for img in dc.images.list(name="launch-env/dk-ours-env"):
            for t in img.tags:
                with contextlib.suppress(Exception):
                    dc.images.remove(t, force=True)
        dc.close()
    med = statistics.median
    overhead = med(ours_env) - med(ours_plain)
    stock_install = med(stock_env) - med(stock_plain)
    held_s = med(held) if held else 0.0
    ours_cost = max(overhead, held_s)
    return {"docker_cold_build_s": cold_build_s, "docker_cold_first_run_start_s": round(cold[0], 3),
            "docker_warm_overhead_s": round(overhead, 3), "docker_env_prepare_s": round(held_s, 3),
            "docker_stock_per_run_install_s": round(stock_install, 3),
            "docker_speedup_warm": _ratio(stock_install, ours_cost),
            "docker_medians_s": {"ours_plain": med(ours_plain), "ours_env": med(ours_env),
                                 "stock_plain": med(stock_plain), "stock_env": med(stock_env)}}


def agent(work: Path, name: str, extra_env: dict):
    env = {**os.environ, **extra_env}
    return background([PY, "-m", "prefect_launch.cli", "agent", "--queue", LAUNCH_QUEUE, "--name", name,
                       "--capacity", "cpu=2,memory=8Gi"], work / f"agent-{name}.log", env)


def wait_agent(client, name: str, timeout: float = 90) -> None:
    from prefect_launch.workers.agent.registry import read_agents_sync

    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(a.name == name and a.online() for a in read_agents_sync(client)):
            time.sleep(2)  # its warm engines start after it comes online
            return
        time.sleep(0.5)
    raise SystemExit(f"agent {name} did not come online")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-docker", action="store_true", help="the process half only")
    args = ap.parse_args()
    n = args.repeats
    load_before = round(os.getloadavg()[0], 2)
    work = Path(tempfile.mkdtemp(prefix="bench-env-"))
    wheels = wheel_folder(work / "wheels")
    job_dir = work / "job"
    job_dir.mkdir()
    (job_dir / "job.py").write_text(FLOW)
    (job_dir / "requirements.txt").write_text(f"--no-index\n--find-links {wheels}\n" + "\n".join(PACKAGES) + "\n")
    env_dir = work / "envs"
    environment = {"requirements": PACKAGES, "find_links": str(wheels)}

    # the stock worker's own interpreter: sees .venv's packages, installs into itself
    from prefect_launch.workers.environments.builder import agent_site_paths, uv_bin

    stock_venv = work / "stock-venv"
    subprocess.run([uv_bin(), "venv", "-q", "--python", PY, str(stock_venv)], check=True)
    site_dir = next((stock_venv / "lib").glob("python*/site-packages"))
    (site_dir / "zzz-agent.pth").write_text("".join(p + "\n" for p in agent_site_paths()))

    from prefect import get_client

    with prefect_server():
        stock_and_launch_pools(work)
        with get_client(sync_client=True) as client:
            deps = {
                "ours-env": deployment(client, "ours-env", "needs", LAUNCH_QUEUE, job_dir, False,
                                       {"environment": environment}),
                "ours-plain": deployment(client, "ours-plain", "plain", LAUNCH_QUEUE, job_dir, False, {}),
                "stock-env": deployment(client, "stock-env", "needs", STOCK_POOL, job_dir, True, {}),
                "stock-plain": deployment(client, "stock-plain", "plain", STOCK_POOL, job_dir, False, {}),
            }
            say(f"ours: launch agent (warm engines on), environments in {env_dir}")
            with agent(work, "bench-env", {"LAUNCH_ENV_DIR": str(env_dir)}):
                wait_agent(client, "bench-env")
                cold = series(client, deps["ours-env"], True, 1, "environment, first run (builds it)")
                ours_plain, ours_env = interleaved(client, deps["ours-plain"], deps["ours-env"], True, n,
                                                   "no environment (warm start)", "environment built (cache hit)")
            metas = [json.loads(p.read_text()) for p in env_dir.glob("*/launch-env.json")]
            cold_build_s = metas[0]["build_seconds"] if len(metas) == 1 else None
            say("ours: launch agent with LAUNCH_WARM_ENGINES=0")
            with agent(work, "bench-env-cold", {"LAUNCH_ENV_DIR": str(env_dir), "LAUNCH_WARM_ENGINES": "0"}):
                wait_agent(client, "bench-env-cold")
                ours_plain_cold, ours_env_cold = interleaved(client, deps["ours-plain"], deps["ours-env"], True, n,
                                                             "no environment (cold start)",
                                                             "environment built (cold agent)")
            say("stock: prefect worker --type process, pip_install_requirements pull step")
            with background([str(stock_venv / "bin" / "python"), "-m", "prefect", "worker", "start", "--pool",
                             STOCK_POOL, "--type", "process"], work / "stock-worker.log"):
                stock_first = series(client, deps["stock-env"], False, 1, "install step, first run (installs)")
                stock_plain, stock_env = interleaved(client, deps["stock-plain"], deps["stock-env"], False, n,
                                                     "no install step", "install step (already satisfied)")
            prep = prepare_seconds(client, RUNS[deps["ours-env"]][1:])  # the cache hits
        dk = {"docker_reason": "--no-docker"} if args.no_docker else docker_half(work, job_dir, wheels, environment, n)

    med = statistics.median
    overhead = med(ours_env) - med(ours_plain)
    overhead_cold = med(ours_env_cold) - med(ours_plain_cold)
    stock_install = med(stock_env) - med(stock_plain)
    prep_s = med(prep) if prep else None
    # our per-run cost is at least the agent's own time on the environment: the floor where the start latencies'
    # difference is within their noise (at or below zero)
    ours_cost = max(overhead, prep_s or 0.0)
    speedup = _ratio(stock_install, ours_cost)
    speedup_cold = _ratio(stock_install, max(overhead_cold, prep_s or 0.0))
    print(f"medians claim->Running over {n} runs (s): ours no env warm {med(ours_plain):.2f}, ours env "
          f"{med(ours_env):.2f}; ours no env cold {med(ours_plain_cold):.2f}, ours env on cold agent "
          f"{med(ours_env_cold):.2f}; stock no install {med(stock_plain):.2f}, stock pip step {med(stock_env):.2f} "
          f"(first {stock_first[0]:.2f})")
    print(f"cold build {cold_build_s} s (first run claim->Running {cold[0]:.2f} s); ours overhead "
          f"{overhead:.2f} s vs warm, {overhead_cold:.2f} s vs cold; stock per-run install {stock_install:.2f} s; "
          f"agent's own time on a built environment {prep_s} s (median); speedup {speedup and round(speedup, 1)}x "
          f"(vs warm), {speedup_cold and round(speedup_cold, 1)}x (vs cold)")
    if "docker_warm_overhead_s" in dk:
        m = dk["docker_medians_s"]
        print(f"docker: medians claim->Running (s): ours no env {m['ours_plain']:.2f}, ours image built "
              f"{m['ours_env']:.2f}; stock no install {m['stock_plain']:.2f}, stock pip step {m['stock_env']:.2f}; "
              f"cold image build {dk['docker_cold_build_s']} s; ours overhead {dk['docker_warm_overhead_s']:.2f} s; "
              f"stock per-run install {dk['docker_stock_per_run_install_s']:.2f} s; speedup "
              f"{dk['docker_speedup_warm']}x")
    print(json.dumps({
        "cold_build_s": cold_build_s, "cold_first_run_start_s": round(cold[0], 3),
        "ours_warm_start_overhead_s": round(overhead, 3), "ours_env_overhead_vs_cold_s": round(overhead_cold, 3),
        "ours_env_prepare_s": prep_s,
        "stock_per_run_install_s": round(stock_install, 3), "stock_first_run_install_s":
            round(stock_first[0] - med(stock_plain), 3),
        "speedup_warm": speedup and round(speedup, 2), "speedup_vs_cold": speedup_cold and round(speedup_cold, 2),
        "docker_cold_build_s": None, "docker_warm_overhead_s": None, **dk,
        "repeats": n, "loadavg_1m": [load_before, round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
