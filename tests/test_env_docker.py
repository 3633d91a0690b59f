"""Job environments on container queues (issue 39 sections 3 and 4): an image per content hash, built with docker-py
on a real dockerd from the session's base image, offline (the pins come from a local wheel folder copied into the
build context).

Checked from Docker itself (the image's tag and label, what ``python`` inside it imports) and from the jobs' own
records; the kubernetes half pushes to a real registry (Debian's docker-registry) on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from env_wheels import wheel_folder, write_wheel
from launch_helpers import ROOT, apply_queue, cli, cli_json, records, wait_final
from prefect_launch.deployments.jobs import deploy_jobs
from prefect_launch.workers.environments.image import (HASH_LABEL, ImageBuildError, ensure_image, image_identity,
                                                       image_tag)
from prefect_launch.workers.environments.spec import inline, parse_environment
from prefect_launch.workers.scheduling.resources import LaunchValidationError
from test_docker_backend import JOBS, PRESETS, agent
from test_docker_backend import docker_client, docker_host, image  # noqa: F401  # session fixtures
from test_kubernetes_worker import kube  # noqa: F401  # the fake Kubernetes API

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.timeout(1500)]
PREFECT = "test"  # the Prefect version in the identity (the agent's, in real runs)


def _spec(value, bases=()):
    return inline(parse_environment(value), list(bases))


def _in_image(client, ref: str, code: str) -> str:
    out = client.containers.run(ref, ["python", "-c", code], remove=True, network_mode="none")
    return out.decode().strip()


def _tagged(client, env_hash: str) -> list:
    return client.images.list(filters={"label": f"{HASH_LABEL}={env_hash}"})


def test_an_image_per_hash_built_once_and_reused(tmp_path: Path, docker_client, image: str, unique_name: str):
    wheels = wheel_folder(tmp_path / "wheels")
    spec = _spec({"requirements": ["launchtiny==2.0", "launchalpha"], "find_links": str(wheels)})
    ident = image_identity(spec, docker_client, image, PREFECT)
    tag = image_tag(f"Job {unique_name}", ident.hash)
    assert tag == f"launch-env/job-{unique_name.lower()}:{ident.hash}"
    results, lines = [], []

    def run() -> None:
        results.append(ensure_image(docker_client, spec, ident, tag, tmp_path / "locks", log=lines.append))

    threads = [threading.Thread(target=run) for _ in range(2)]  # concurrent runs of one hash: one build
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sorted(r.built for r in results) == [False, True]
        assert len({r.id for r in results}) == 1
        assert any("launchtiny" in line for line in lines)  # Docker's own output reached the log
        assert _in_image(docker_client, tag, "import launchtiny, launchalpha; print(launchtiny.VERSION)") == "2.0"
        assert docker_client.images.get(tag).labels[HASH_LABEL] == ident.hash
        again = ensure_image(docker_client, spec, ident, tag, tmp_path / "locks")
        assert not again.built and again.id == results[0].id  # a cached image is reused, never rebuilt
        # another job with the same environment: the image is tagged for it too, not built again
        other = ensure_image(docker_client, spec, ident, image_tag("other", ident.hash), tmp_path / "locks")
        assert not other.built and other.id == results[0].id
        # what shapes the image changes the hash: another pin, another base image
        assert image_identity(_spec({"requirements": ["launchtiny==1.0"], "find_links": str(wheels)}),
                              docker_client, image, PREFECT).hash != ident.hash
        assert image_identity(spec, docker_client, "prefect-launch-debian:bookworm", PREFECT).hash != ident.hash
    finally:
        for t in (tag, image_tag("other", ident.hash)):
            docker_client.images.remove(t, force=True)


def test_bad_dockerfiles_and_failed_builds_leave_nothing_tagged(tmp_path: Path, docker_client, image: str):
    wheels = wheel_folder(tmp_path / "wheels")
    # known before anything is enqueued: a missing Dockerfile, one that is not a Dockerfile
    with pytest.raises(LaunchValidationError, match="dockerfile .*nope.* does not exist"):
        _spec({"dockerfile": "nope/Dockerfile"}, [tmp_path])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "Dockerfile").write_text(f"RUN true\nFROM {image}\n")
    with pytest.raises(LaunchValidationError, match="first instruction must be FROM"):
        _spec({"dockerfile": "bad/Dockerfile"}, [tmp_path])
    (tmp_path / "bad" / "Dockerfile").write_text(f"FROM {image}\nRUNN true\n")
    with pytest.raises(LaunchValidationError, match="line 2: unknown instruction 'RUNN'"):
        _spec({"dockerfile": "bad/Dockerfile"}, [tmp_path])
    # known only by building: a RUN that fails, a pin no wheel satisfies -> Docker's words, no image tagged
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {image}\nRUN echo launch-broken-step >&2 && exit 3\n")
    failing = [_spec({"dockerfile": "ctx/Dockerfile"}, [tmp_path]),
               _spec({"requirements": ["launchnope==9"], "find_links": str(wheels)})]
    for spec, words in zip(failing, ("launch-broken-step", "launchnope")):
        ident = image_identity(spec, docker_client, image, PREFECT)
        tag = image_tag("broken", ident.hash)
        with pytest.raises(ImageBuildError, match=words) as err:
            ensure_image(docker_client, spec, ident, tag, tmp_path / "locks")
        assert str(err.value).startswith(f"environment build failed: image {tag}")
        assert not _tagged(docker_client, ident.hash) and not docker_client.images.list(name=tag)
    # the fixed Dockerfile is another hash and builds; its context files are in the image
    (ctx / "Dockerfile").write_text(f"FROM {image}\nCOPY data.txt /data.txt\n")
    (ctx / "data.txt").write_text("context file\n")
    spec = _spec({"dockerfile": "ctx/Dockerfile", "requirements": ["launchbeta"], "find_links": str(wheels)},
                 [tmp_path])
    ident = image_identity(spec, docker_client, image, PREFECT)
    built = ensure_image(docker_client, spec, ident, image_tag("fixed", ident.hash), tmp_path / "locks")
    try:
        assert built.built
        assert _in_image(docker_client, built.tag, "import launchbeta; print(open('/data.txt').read().strip())") \
            == "context file"
        (ctx / ".dockerignore").write_text("# not sent\nscratch/\n")  # an ignored file is not part of it
        (ctx / "scratch").mkdir()
        (ctx / "scratch" / "big.bin").write_bytes(b"x" * 1000)
        assert image_identity(spec, docker_client, image, PREFECT).hash == ident.hash
        (ctx / "data.txt").write_text("changed\n")  # a context file is part of the identity
        assert image_identity(spec, docker_client, image, PREFECT).hash != ident.hash
    finally:
        docker_client.images.remove(built.tag, force=True)


@pytest.fixture
def registry(tmp_path: Path):
    """Debian's docker-registry serving on a free loopback port, its storage in tmp_path."""
    exe = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    if not os.path.exists(exe):
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "registry.yml"
    conf.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'registry'}\n"
                    f"http:\n  addr: 127.0.0.1:{port}\nlog:\n  level: warn\n")
    proc = subprocess.Popen([exe, "serve", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2)
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("docker-registry did not answer")
            time.sleep(0.2)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _deploy_env_job(queue: str, name: str, image: str, out: Path, environment: dict) -> str:
    import sys

    variables = {"image": image, "volumes": [f"{JOBS}:{JOBS}:ro", f"{out}:{out}"], "stream_output": False,
                 "environment": environment}
    code = (
        "from prefect import flow\n"
        f"flow.from_source(source={str(JOBS)!r}, entrypoint='env_job.py:env_job').deploy("
        f"name={name!r}, work_pool_name={queue!r}, work_queue_name='medium', build=False, push=False,"
        f" image={image!r}, print_next_steps=False, job_variables={variables!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=os.environ.copy(), timeout=120)
    return f"env-job/{name}"


def _run_logs(run_id: str) -> list[str]:
    """The run's Prefect logs (the agent sends them in batches: read until the build's last line is there)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.time() + 30
    with get_client(sync_client=True) as client:
        while True:
            logs = [log.message for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)]
            if any("built in" in m for m in logs) or time.time() > deadline:
                return logs
            time.sleep(1)


def _history(run_id: str, phase: str) -> list[dict]:
    return [r for r in cli_json("history", run_id) if r["phase"] == phase]


def test_a_docker_queue_runs_a_job_needing_a_package_in_its_image(tmp_path: Path, unique_name: str, docker_client,
                                                                  image: str):
    wheels = wheel_folder(tmp_path / "wheels")
    (tmp_path / "requirements.txt").write_text("launchtiny==1.0\n")
    out = tmp_path / "out"
    out.mkdir()
    q = apply_queue(tmp_path, {"name": f"envdk-{unique_name}", "target": "docker", "image": image,
                               "presets": PRESETS, "default_preset": "small"})
    job = _deploy_env_job(q, f"envdk-{unique_name}", image, out,
                          {"requirements": str(tmp_path / "requirements.txt"), "find_links": str(wheels)})
    # a Dockerfile that does not exist is refused before anything is enqueued; dockerfile on a docker queue is fine
    bad = cli("submit", job, "--queue", q, "--dry-run", "--environment",
              '{"dockerfile": "%s"}' % (tmp_path / "missing" / "Dockerfile"), check=False)
    assert bad.returncode != 0 and "does not exist" in bad.stdout + bad.stderr
    nope = '{"requirements": ["launchnope==9"], "find_links": "%s"}' % wheels

    def submit(tag: str, *extra: str) -> str:
        return cli_json("submit", job, "--queue", q, "--param", f"record_dir={out}", "--param", f"tag={tag}",
                        *extra)["run_ids"][0]

    # prefect.yaml's report-docker-env on this queue: its code snapshot pulled into the container, tabulate (which
    # neither the agent nor the base image has) from the image the agent builds from the job's requirements
    write_wheel(wheels, "tabulate", "0.9.0", body="def tabulate(rows, headers=()):\n    return __file__\n")
    storage = tmp_path / "storage"
    assert deploy_jobs(ROOT / "prefect.yaml", names=["report-docker-env"], pool=q,
                       env={"LAUNCH_CODE_STORAGE": str(storage)}) == ["report/report-docker-env"]
    report_env = json.dumps({"requirements": str(ROOT / "examples" / "requirements-report.txt"),
                             "find_links": str(wheels)})

    tags_before = {t for i in docker_client.images.list(name="launch-env/*") for t in i.tags}
    with agent([q], f"envdk-{unique_name}", "cpu=2,memory=2Gi", tmp_path):
        first, broken = submit("one"), submit("bad", "--environment", nope)
        report = cli_json("submit", "report/report-docker-env", "--queue", q, "--environment", report_env)["run_ids"][0]
        runs = {str(r.id): r for r in wait_final([first, broken, report], timeout=300)}
        again = submit("again")
        runs.update({str(r.id): r for r in wait_final([again], timeout=120)})
    try:
        assert runs[first].state.is_completed() and runs[again].state.is_completed(), {
            k: (r.state_name, r.state.message) for k, r in runs.items()}
        assert runs[report].state.is_completed(), (runs[report].state_name, runs[report].state.message)
        # the flow logs its table, here the fake tabulate's own file: installed in the built image
        assert any("/opt/venv/" in m and "site-packages/tabulate/__init__.py" in m for m in _run_logs(report))
        assert [r["error_code"] for r in _history(report, "build")] == ["env-cache-miss"]
        got = records(out)
        assert got[first]["launchtiny"] == got[again]["launchtiny"] == "1.0"
        assert got[first]["launchtiny_file"].startswith("/opt/venv/")  # installed in the image, not mounted
        assert [r["error_code"] for r in _history(first, "build")] == ["env-cache-miss"]
        assert any("Successfully installed launchtiny-1.0" in line for line in _run_logs(first))  # Docker's output
        assert [r["error_code"] for r in _history(again, "build")] == ["env-cache-hit"]
        failed = runs[broken]
        assert failed.state.is_failed() and failed.state.message.startswith("environment build failed: image ")
        assert "launchnope" in failed.state.message
        assert [r["result"] for r in _history(broken, "build")] == ["FAILURE"]
        new = {t for i in docker_client.images.list(name="launch-env/*") for t in i.tags} - tags_before
        assert sorted(t.split(":")[0] for t in new) == [f"launch-env/envdk-{unique_name.lower()}",
                                                        "launch-env/report-docker-env"], new
    finally:
        for i in docker_client.images.list(name="launch-env/*"):
            for t in set(i.tags) - tags_before:
                docker_client.images.remove(t, force=True)


def test_a_kubernetes_queue_builds_pushes_and_names_the_image_by_digest(tmp_path: Path, docker_client,
                                                                        registry: str, kube):
    """The launch-kubernetes worker against the fake API (tests/kube_fake.py): the run's environment is built on
    the agent's daemon, pushed to the queue's registry (a real one), and the Job's container names its digest.

    The image is a Dockerfile ``FROM scratch`` with one file (the fake runs no pod, and pushing the Prefect base
    image's layers costs minutes of gzip on a loaded box); installing pins is the docker tests' part."""
    import asyncio
    import json
    import urllib.request
    import uuid

    import anyio
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Completed

    from prefect_launch.workers.agent.tags import RUN_ID_LABEL
    from prefect_launch.workers.backends.kubernetes.worker import LaunchKubernetesWorker

    pool = f"k8s-env-{uuid.uuid4().hex[:8]}"
    template = LaunchKubernetesWorker.get_default_base_job_template()
    template["job_configuration"]["launch"] = {"name": pool, "target": "kubernetes", "default_preset": "small",
                                               "presets": {"small": {"cpu": 0.5, "memory": "512Mi"}},
                                               "registry": registry}
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "Dockerfile").write_text("FROM scratch\nCOPY marker.txt /marker.txt\n")
    (tmp_path / "img" / "marker.txt").write_text(f"{pool}\n")
    environment = {"dockerfile": str(tmp_path / "img" / "Dockerfile")}

    async def until(what, timeout: float = 240.0):
        deadline = time.monotonic() + timeout
        while not (value := await what()):
            assert time.monotonic() < deadline, f"timed out waiting for {what.__name__}"
            await asyncio.sleep(0.2)
        return value

    async def main() -> tuple[dict, str]:
        async with get_client() as client:
            await client.create_work_pool(WorkPoolCreate(name=pool, type="launch-kubernetes",
                                                         base_job_template=template))
            flow_id = await client.create_flow_from_name("k8s-env-probe")
            dep = await client.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool,
                                                 job_variables={"image": "unused:1", "environment": environment})
            worker = LaunchKubernetesWorker(work_pool_name=pool, name="k8s-env-agent", create_pool_if_not_found=False)
            worker.watch_seconds = 0.1
            worker.poll_seconds = 3600
            with anyio.fail_after(400):
                async with worker:
                    fr = await client.create_flow_run_from_deployment(dep)
                    await worker.get_and_submit_flow_runs()

                    async def created():
                        return next((j for j in list(kube.jobs.values())
                                     if j["metadata"]["labels"].get(RUN_ID_LABEL) == str(fr.id)), None)

                    job = await until(created)
                    pod = kube.add_pod(job, conditions=[{"type": "PodScheduled", "status": "True"}])
                    await client.set_flow_run_state(fr.id, Completed())
                    kube.set_pod(pod, "Succeeded", containerStatuses=[{"name": "prefect-job", "state": {
                        "terminated": {"exitCode": 0, "reason": "Completed"}}}])

                    async def done():
                        return fr.id not in worker._watching and (await client.read_flow_run(fr.id)).state.is_final()

                    await until(done, 60)
                    return job, str(fr.id)

    job, run_id = asyncio.run(main())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    repo, _, digest = container["image"].partition("@")
    assert repo == f"{registry}/launch-env/{pool}" and digest.startswith("sha256:")
    local = [i for i in docker_client.images.list(name=f"launch-env/{pool}")]
    try:
        assert len(local) == 1 and local[0].labels[HASH_LABEL]
        req = urllib.request.Request(f"http://{registry}/v2/launch-env/{pool}/manifests/{digest}", headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        with urllib.request.urlopen(req, timeout=10) as resp:  # the registry serves exactly that image
            assert json.loads(resp.read())["config"]["digest"] == local[0].id
    finally:
        for i in local:
            docker_client.images.remove(i.id, force=True)
