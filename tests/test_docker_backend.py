"""The launch-docker back end against a real dockerd (started by the fixture when none answers).

Each run's container is read back twice: `docker inspect` (HostConfig limits, labels,
host networking, mounts) and the job itself (tests/jobs/container_probe.py: nproc,
cgroup memory limit and CPU quota, /dev/shm size, CUDA_VISIBLE_DEVICES). Ends:
success, a non-zero exit, an OOM kill, a cancel and a timeout each end the run
with its reason, remove the container and give the capacity back; a SIGKILLed
agent re-adopts a live container by its run-id label. Skipped, with the reason,
where no Docker daemon can run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from docker_env import base_image, docker_daemon, why_no_docker
from launch_helpers import CLI, apply_queue, cli_json, read_runs, wait_agent_free, wait_agent_online, wait_final
from launch_helpers import agent as _agent
from prefect_launch.workers.agent.tags import RUN_ID_LABEL

# generous: the first test also builds the base image when the project changed (minutes on a busy machine)
pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.timeout(1500)]
JOBS = Path(__file__).resolve().parent / "jobs"
MiB = 1 << 20
PRESETS = {
    "small": {"cpu": 1, "memory": "256Mi", "gpu": 0, "shm_size": "64Mi"},
    "gpu-1": {"cpu": 0.5, "memory": "192Mi", "gpu": 1, "shm_size": "32Mi"},
    "tiny": {"cpu": 0.5, "memory": "256Mi", "gpu": 0},  # the engine itself needs ~150 MiB
}


@pytest.fixture(scope="session")
def docker_host():
    why = why_no_docker()
    if why:
        pytest.skip(f"no Docker daemon: {why}")
    old = os.environ.get("DOCKER_HOST")
    with docker_daemon() as url:
        os.environ["DOCKER_HOST"] = url  # agents and the CLI started by the tests inherit it
        try:
            yield url
        finally:
            if old is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = old


@pytest.fixture(scope="session")
def docker_client(docker_host):
    import docker

    client = docker.DockerClient(base_url=docker_host, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def image(docker_client) -> str:
    t0 = time.time()
    tag = base_image(docker_client)
    print(f"base image {tag} ready in {time.time() - t0:.1f} s")
    return tag


@contextlib.contextmanager
def agent(queues: list[str], name: str, capacity: str, log_dir: Path, **kw):
    """launch_helpers.agent, waiting longer for it to come online (imports are slow on a busy machine)."""
    with _agent(queues, name, capacity, log_dir, wait_online=False, **kw) as proc:
        wait_agent_online(name, queues, timeout=240)
        yield proc


def deploy_mounted_job(queue: str, name: str, image: str, out: Path, entrypoint: str, **job_variables) -> str:
    """A flow of tests/jobs (``entrypoint``: ``file.py:function``) as a job of ``queue`` running in ``image``; the
    job folder and ``out`` are mounted at their host paths. Returns "flow/deployment"."""
    out.mkdir(parents=True, exist_ok=True)
    variables = {"image": image, "volumes": [f"{JOBS}:{JOBS}:ro", f"{out}:{out}"], "stream_output": False,
                 **job_variables}
    code = (
        "from prefect import flow\n"
        f"flow.from_source(source={str(JOBS)!r}, entrypoint={entrypoint!r}).deploy("
        f"name={name!r}, work_pool_name={queue!r}, work_queue_name='medium', build=False, push=False,"
        f" image={image!r}, print_next_steps=False, job_variables={variables!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=os.environ.copy(), timeout=120)
    return f"{entrypoint.rsplit(':', 1)[1].replace('_', '-')}/{name}"


def deploy_container_probe(queue: str, name: str, image: str, out: Path, **job_variables) -> str:
    """tests/jobs/container_probe.py as a job of ``queue`` (`deploy_mounted_job`)."""
    return deploy_mounted_job(queue, name, image, out, "container_probe.py:container_probe", **job_variables)


def docker_queue(tmp_path: Path, name: str, image: str) -> str:
    return apply_queue(tmp_path, {"name": name, "target": "docker", "image": image, "presets": PRESETS,
                                  "default_preset": "small"})


def submit(job: str, queue: str, *args: str) -> str:
    return cli_json("submit", job, "--queue", queue, *args)["run_ids"][0]


def containers_of(client, run_id: str) -> list:
    return client.containers.list(all=True, filters={"label": f"{RUN_ID_LABEL}={run_id}"})


def record(out: Path, run_id: str) -> dict:
    return json.loads((out / f"{run_id}.json").read_text())


def test_presets_become_container_limits_read_back_inside_and_by_inspect(
        tmp_path: Path, unique_name: str, docker_client, image: str):
    q = docker_queue(tmp_path, f"dk-{unique_name}", image)
    out = tmp_path / "out"
    job = deploy_container_probe(q, f"lim-{unique_name}", image, out, keep_container=True)
    with agent([q], f"dk-{unique_name}", "cpu=2,memory=2Gi,gpu=2", tmp_path):
        small = submit(job, q, "--preset", "small", "--param", f"record_dir={out}")
        gpu = submit(job, q, "--preset", "gpu-1", "--param", f"record_dir={out}")
        runs = {str(r.id): r for r in wait_final([small, gpu], timeout=240)}
        assert {r.state_name for r in runs.values()} == {"Completed"}, {k: r.state.message for k, r in runs.items()}
        wait_agent_free(f"dk-{unique_name}", 2)
        for rid, preset in ((small, "small"), (gpu, "gpu-1")):
            p = PRESETS[preset]
            mem = 256 * MiB if preset == "small" else 192 * MiB
            (c,) = containers_of(docker_client, rid)
            hc = c.attrs["HostConfig"]
            assert hc["NanoCpus"] == int(p["cpu"] * 1e9)
            assert hc["Memory"] == mem and hc["MemorySwap"] == mem
            assert hc["ShmSize"] == int(p["shm_size"][:-2]) * MiB
            assert hc["NetworkMode"] == "host"
            assert f"{out}:{out}" in hc["Binds"]
            assert not hc.get("DeviceRequests")  # this host has no GPUs: rendered, not sent
            cores = [int(x) for x in hc["CpusetCpus"].split(",")]
            labels = c.attrs["Config"]["Labels"]
            assert labels[RUN_ID_LABEL] == rid and labels["io.prefect-launch.queue"] == q
            inside = record(out, rid)
            assert inside["nproc"] == len(cores) and inside["affinity"] == cores
            assert int(inside["memory_limit"]) == mem
            assert int(inside["cpu_quota"]) == int(p["cpu"] * int(inside["cpu_period"]))
            assert inside["shm_bytes"] == int(p["shm_size"][:-2]) * MiB
            assert inside["cuda_visible_devices"] == ("" if preset == "small" else inside["cuda_visible_devices"])
            c.remove(force=True)
        assert record(out, gpu)["cuda_visible_devices"] in ("0", "1")
        # measured from outside like any run: the metrics store has the container's record and summary
        report = cli_json("runs", "show", small)
        assert report["run"]["queue"] == q and report["summary"]["samples"] >= 1


def test_container_ends_exit_code_oom_cancel_timeout_release_capacity(
        tmp_path: Path, unique_name: str, docker_client, image: str):
    q = docker_queue(tmp_path, f"dke-{unique_name}", image)
    out = tmp_path / "out"
    job = deploy_container_probe(q, f"end-{unique_name}", image, out)
    name = f"dke-{unique_name}"
    with agent([q], name, "cpu=2,memory=2Gi,gpu=0", tmp_path):
        exit3 = submit(job, q, "--preset", "tiny", "--param", f"record_dir={out}", "--param", "exit_code=3")
        oom = submit(job, q, "--preset", "tiny", "--param", f"record_dir={out}", "--param", "alloc_mb=400")
        timeout = submit(job, q, "--preset", "tiny", "--param", f"record_dir={out}", "--param", "seconds=60",
                         "--timeout", "8s")
        cancel = submit(job, q, "--preset", "tiny", "--param", f"record_dir={out}", "--param", "seconds=60")
        deadline = time.time() + 120
        while not (out / f"{cancel}.json").exists() and time.time() < deadline:
            time.sleep(0.5)
        subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", cancel], check=True,
                       capture_output=True, env=os.environ.copy(), timeout=60)
        runs = {str(r.id): r for r in wait_final([exit3, oom, timeout, cancel], timeout=240)}
        assert runs[exit3].state_name == "Crashed" and "3" in runs[exit3].state.message
        assert runs[oom].state_name == "Crashed" and "OOMKilled" in runs[oom].state.message, runs[oom].state.message
        assert runs[timeout].state_name == "Failed" and runs[timeout].state.message.startswith("task-timeout: timeout after 8 s")
        assert runs[cancel].state_name == "Cancelled"
        wait_agent_free(name, 0)
        assert all(containers_of(docker_client, rid) == [] for rid in runs)  # removed on every end


def test_killed_agent_readopts_its_live_container(tmp_path: Path, unique_name: str, docker_client, image: str):
    from prefect_launch.local_server import background_process

    q = docker_queue(tmp_path, f"dkr-{unique_name}", image)
    out = tmp_path / "out"
    job = deploy_container_probe(q, f"re-{unique_name}", image, out)
    name = f"dkr-{unique_name}"
    release = out / "release"  # in the mounted folder: the job inside its container sees it appear
    args = [*CLI, "agent", "--name", name, "--capacity", "cpu=2,memory=2Gi,gpu=0", "--queue", q]
    with background_process(args, tmp_path / "agent-1.log") as first:
        wait_agent_online(name, [q], timeout=240)
        # alive until released below (once the new agent has re-adopted it), 300 s at most
        rid = submit(job, q, "--preset", "tiny", "--param", f"record_dir={out}", "--param", "seconds=300",
                     "--param", f"release_file={release}")
        deadline = time.time() + 120
        while not (out / f"{rid}.json").exists() and time.time() < deadline:
            time.sleep(0.3)
        assert (out / f"{rid}.json").exists(), (tmp_path / "agent-1.log").read_text()[-3000:]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    (c,) = containers_of(docker_client, rid)
    assert c.status == "running"  # the container outlives its agent
    with agent([q], name, "cpu=2,memory=2Gi,gpu=0", tmp_path, log_name="agent-2.log"):
        log_path = tmp_path / "agent-2.log"
        deadline = time.time() + 240  # the killed agent's last heartbeat still reads "online": wait for the new one
        while "recovered" not in log_path.read_text() and time.time() < deadline:
            time.sleep(0.5)
        assert "recovered 1 live run(s), 0 ended while it was away" in log_path.read_text(), log_path.read_text()[-3000:]
        release.touch()  # re-adopted while alive: now let it end, and the new agent must read that end
        (run,) = wait_final([rid], timeout=240)
        assert run.state_name == "Completed", run.state.message
        wait_agent_free(name, 0, timeout=120)
    assert containers_of(docker_client, rid) == []  # removed once its end was read


def test_one_agent_serves_process_and_docker_queues_with_one_ledger(
        tmp_path: Path, unique_name: str, docker_client, image: str):
    from launch_helpers import deploy_probe

    dq = docker_queue(tmp_path, f"dkm-{unique_name}", image)
    pq = apply_queue(tmp_path, {"name": f"pm-{unique_name}", "presets": {"gpu-1": PRESETS["gpu-1"]},
                                "default_preset": "gpu-1"})
    out = tmp_path / "out"
    djob = deploy_container_probe(dq, f"mix-{unique_name}", image, out)
    pjob = deploy_probe(pq, f"mixp-{unique_name}")
    name = f"dkm-{unique_name}"
    with agent([pq, dq], name, "cpu=2,memory=2Gi,gpu=1", tmp_path):
        p = submit(pjob, pq, "--param", f"record_dir={tmp_path / 'rec'}", "--param", "seconds=6")
        time.sleep(1.0)
        d = submit(djob, dq, "--preset", "gpu-1", "--param", f"record_dir={out}")
        runs = {str(r.id): r for r in wait_final([p, d], timeout=240)}
        assert {r.state_name for r in runs.values()} == {"Completed"}
        # one GPU for both back ends: the container started only after the process run gave it back
        pend = json.loads((tmp_path / "rec" / f"{p}.json").read_text())
        assert record(out, d)["start"] >= pend["end"] - 0.5
        labels = read_runs([d])[0].labels
        assert not labels.get("launch.waiting")  # cleared once placed


def test_image_job_from_prefect_yaml_builds_deploys_and_runs(
        tmp_path: Path, unique_name: str, docker_client, image: str):
    """prefect-docker's build_docker_image builds the job image FROM the local base; prefect deploy registers
    it; `prefect-launch submit` runs it on a docker queue; it completes and is measured like any run."""
    import shutil

    q = docker_queue(tmp_path, f"dki-{unique_name}", image)
    proj = tmp_path / "proj"
    (proj / "flows").mkdir(parents=True)
    shutil.copy(JOBS / "container_probe.py", proj / "flows" / "container_probe.py")
    (proj / "Dockerfile").write_text(f"FROM {image}\nCOPY flows /opt/prefect/job/flows\n")
    out = tmp_path / "out"
    out.mkdir()
    (proj / "prefect.yaml").write_text(f"""
name: image-job
build:
  - prefect_docker.deployments.steps.build_docker_image:
      id: build-image
      requires: prefect-docker>=0.7
      image_name: launch-test/probe-job
      tag: "{unique_name}"
      dockerfile: Dockerfile
      pull: false
push: null
pull:
  - prefect.deployments.steps.set_working_directory:
      directory: /opt/prefect/job
deployments:
  - name: probe-image-{unique_name}
    entrypoint: flows/container_probe.py:container_probe
    parameters: {{record_dir: "{out}"}}
    work_pool:
      name: {q}
      work_queue_name: medium
      job_variables:
        image: "{{{{ build-image.image }}}}"
        volumes: ["{out}:{out}"]
        stream_output: false
        preset: tiny
""")
    env = os.environ.copy()
    deployed = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                               "prefect.yaml"], cwd=proj, env=env, capture_output=True, text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    assert docker_client.images.get(f"launch-test/probe-job:{unique_name}")
    name = f"dki-{unique_name}"
    with agent([q], name, "cpu=2,memory=2Gi,gpu=0", tmp_path):
        rid = submit(f"container-probe/probe-image-{unique_name}", q)
        (run,) = wait_final([rid], timeout=240)
        assert run.state_name == "Completed", run.state.message
        inside = record(out, rid)
        assert int(inside["memory_limit"]) == 256 * MiB  # preset tiny, from the deployment's job variables
        wait_agent_free(name, 0)
    report = cli_json("runs", "show", rid)
    assert report["run"]["queue"] == q and report["summary"]["samples"] >= 1
    docker_client.images.remove(f"launch-test/probe-job:{unique_name}", force=True)
