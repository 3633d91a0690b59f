"""Job environments on container queues (issue 39 sections 3 and 4): an image per content hash, built with docker-py
on a real dockerd from the session's base image, offline (the pins come from a local wheel folder copied into the
build context).

Checked from Docker itself (the image's tag and label, what ``python`` inside it imports) and from the jobs' own
records; the kubernetes half pushes to a real registry (Debian's docker-registry) on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import docker.errors
import pytest

from env_wheels import wheel_folder, write_wheel
from launch_helpers import ROOT, LabelWatch, apply_queue, cli, cli_json, records, wait_final
from prefect_launch.deployments.jobs import deploy_jobs
from docker_env import debian_image
from prefect_launch.workers.environments.image import (HASH_LABEL, ImageBuildError, ensure_image, image_identity,
                                                       image_tag)
from prefect_launch.workers.environments.image_cache import ImageCache
from prefect_launch.workers.environments.spec import inline, parse_environment
from prefect_launch.workers.scheduling.resources import LaunchValidationError
from test_docker_backend import PRESETS, agent, deploy_mounted_job
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
        assert image_identity(spec, docker_client, debian_image(docker_client), PREFECT).hash != ident.hash
        # env ls | rm | prune --images: the image with both tags, its own layers' size, last used by the runs
        # above; a live container holds it (prune leaves it, rm refuses), and once it is gone prune removes it
        cache = ImageCache(docker_client, tmp_path / "locks")
        (row,) = [r for r in cli_json("env", "ls", "--images", "--dir", str(tmp_path / "locks"))["images"]
                  if r["hash"] == ident.hash]
        assert row["tags"] == sorted([tag, image_tag("other", ident.hash)]) and row["users"] == []
        assert 0 < row["size"] < row["total_size"] and time.time() - row["last_used"] < 120
        # against Docker's own records: the whole image, and its own layers = all but the queue image's under it
        job_size, base_size = docker_client.images.get(tag).attrs["Size"], docker_client.images.get(image).attrs["Size"]
        assert (row["total_size"], row["size"]) == (job_size, job_size - base_size), (row, job_size, base_size)
        # another environments folder (another host's agents) neither lists nor prunes it
        assert ImageCache(docker_client, tmp_path / "elsewhere").prune(all_unused=True) == []
        holder = docker_client.containers.create(tag, ["true"], network_mode="none")
        try:
            assert [r["users"] for r in cache.entries() if r["hash"] == ident.hash] == [[holder.name]]
            assert ident.hash not in cache.prune(all_unused=True)
            refused = cli("env", "rm", "--images", "--dir", str(tmp_path / "locks"), ident.hash[:10], check=False)
            assert refused.returncode != 0 and f"used by run(s) {holder.name}" in refused.stdout + refused.stderr
        finally:
            holder.remove(force=True)
        pruned = cli_json("env", "prune", "--images", "--dir", str(tmp_path / "locks"), "--max", "1")["removed"]
        assert ident.hash in pruned and not _tagged(docker_client, ident.hash)
    finally:
        for t in (tag, image_tag("other", ident.hash)):
            with contextlib.suppress(docker.errors.ImageNotFound):
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


def _run_logs(run_id: str, want: str = "built in") -> list[str]:
    """The run's Prefect logs (the agent sends them in batches: read until a line holding ``want`` is there)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.time() + 30
    with get_client(sync_client=True) as client:
        while True:
            logs = [log.message for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)]
            if any(want in m for m in logs) or time.time() > deadline:
                return logs
            time.sleep(1)


@contextlib.contextmanager
def git_daemon(tmp_path: Path):
    """A git repository holding examples/ (tag v1), served read-only by ``git daemon`` on loopback: a remote the
    job's container clones from (containers use host networking), as it would clone from a real forge."""
    import socket

    base = tmp_path / "git"
    repo = base / "jobs-repo"
    shutil.copytree(ROOT / "examples", repo / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x"}
    for args in (["init", "-q", "-b", "main"], ["add", "examples"], ["commit", "-q", "-m", "v1"], ["tag", "v1"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={base}",
                             "--listen=127.0.0.1", f"--port={port}", str(base)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"git://127.0.0.1:{port}/jobs-repo"
    try:
        deadline = time.time() + 30
        while subprocess.run(["git", "ls-remote", url], capture_output=True).returncode != 0:
            assert time.time() < deadline and proc.poll() is None, "git daemon did not answer"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


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
    job = deploy_mounted_job(q, f"envdk-{unique_name}", image, out, "env_job.py:env_job", environment={
        "requirements": str(tmp_path / "requirements.txt"), "find_links": str(wheels)})
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
    requirements = str(ROOT / "examples" / "requirements-report.txt")
    report_env = json.dumps({"requirements": requirements, "find_links": str(wheels)})
    # the image job: examples/Dockerfile copies the flow into an image FROM this queue's image (its BASE_IMAGE)
    image_env = json.dumps({"dockerfile": str(ROOT / "examples" / "Dockerfile"), "requirements": requirements,
                            "find_links": str(wheels)})
    assert deploy_jobs(ROOT / "prefect.yaml", names=["report-image-env"], pool=q) == ["report/report-image-env"]

    def submit_report(job_name: str, environment: str) -> str:
        return cli_json("submit", f"report/{job_name}", "--queue", q, "--environment", environment)["run_ids"][0]

    tags_before = {t for i in docker_client.images.list(name="launch-env/*") for t in i.tags}
    with git_daemon(tmp_path) as repo_url, LabelWatch() as labels:
        # the git job: Prefect's git_clone pull step clones the pinned commit inside the container (git is in the
        # queue's image), from a remote the container reaches, in the image built from the job's requirements
        assert deploy_jobs(ROOT / "prefect.yaml", names=["report-git-docker-env"], pool=q,
                           env={"LAUNCH_GIT_REPO": repo_url, "LAUNCH_GIT_REF": "v1"}) == ["report/report-git-docker-env"]
        with agent([q], f"envdk-{unique_name}", "cpu=3,memory=2Gi", tmp_path):
            first, broken = submit("one"), submit("bad", "--environment", nope)
            report = submit_report("report-docker-env", report_env)
            git_run = submit_report("report-git-docker-env", report_env)
            image_run = submit_report("report-image-env", image_env)
            labels.run_ids += [report, git_run, image_run]
            runs = {str(r.id): r for r in wait_final([first, broken, report, git_run, image_run], timeout=400)}
            again = submit("again")
            runs.update({str(r.id): r for r in wait_final([again], timeout=120)})
    try:
        assert runs[first].state.is_completed() and runs[again].state.is_completed(), {
            k: (r.state_name, r.state.message) for k, r in runs.items()}
        for run_id in (report, git_run, image_run):  # code, git and image job: each needs tabulate
            assert runs[run_id].state.is_completed(), (runs[run_id].state_name, runs[run_id].state.message)
            # the flow logs its table, here the fake tabulate's own file: installed in the built image
            table = "site-packages/tabulate/__init__.py"
            assert any("/opt/venv/" in m and table in m for m in _run_logs(run_id, want=table)), run_id
        # the code and the git job have one environment: built once (the other run waited for it, or found it)
        assert sorted(r["error_code"] for run_id in (report, git_run) for r in _history(run_id, "build")) == [
            "env-cache-hit", "env-cache-miss"]
        assert [r["error_code"] for r in _history(image_run, "build")] == ["env-cache-miss"]
        # while its image was built, the run's waiting reason said so, with the seconds so far
        image_hash = docker_client.images.list(name="launch-env/report-image-env")[0].labels[HASH_LABEL]
        assert any(t.startswith(f"building image {image_hash[:8]}, ") and t.endswith(f"s on agent envdk-{unique_name}")
                   for t in labels.seen.get(image_run, [])), labels.seen
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
        assert sorted(t.split(":")[0] for t in new) == [
            f"launch-env/envdk-{unique_name.lower()}", "launch-env/report-docker-env",
            "launch-env/report-git-docker-env", "launch-env/report-image-env"], new
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
