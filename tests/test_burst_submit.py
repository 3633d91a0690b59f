"""Submitting under contention against a real server: no run lost, none made twice, all or none.

A private SQLite-backed Prefect server for this module (it is killed and restarted by one test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from launch_helpers import CLI, apply_queue, cli, deploy_probe, restored_env
from prefect_launch.local_server import free_port, start_prefect_server, wait_healthy

pytestmark = pytest.mark.server  # its own server, killed and restarted


class _Server:
    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.home / "server.log", "a") as log:
            self.proc = start_prefect_server(self.home, self.port, log)
        wait_healthy(self.api_url, self.proc, log=self.home / "server.log")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory):
    import prefect.context

    srv = _Server(tmp_path_factory.mktemp("burst-home"))
    srv.start()
    with restored_env("PREFECT_API_URL", "PREFECT_HOME"):
        os.environ.update(PREFECT_API_URL=srv.api_url, PREFECT_HOME=str(srv.home))
        prefect.context.refresh_global_settings_context()
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def burst_job(burst_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("burst-queue")
    q = apply_queue(tmp, {"name": "burst", "presets": {"tiny": {"cpu": 0.1, "memory": "64Mi"}},
                          "default_preset": "tiny"})
    return q, deploy_probe(q, "burst-probe")


def _runs_named(prefix: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=prefix)), limit=200)


def test_concurrent_submissions_lose_nothing_and_duplicate_nothing(burst_job, unique_name):
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit
    from prefect_launch.deployments.submit_retry import SubmitFailed

    q, job = burst_job
    clients, per = 8, 3
    start = threading.Barrier(clients)
    results: dict[int, object] = {}

    def one(k: int) -> None:
        with get_client(sync_client=True) as client:
            start.wait()
            try:
                results[k] = submit(client, SubmitRequest(job=job, queue=q, count=per, name=f"c{unique_name}-{k}x",
                                                          params={"record_dir": "/nonexistent"}))
            except Exception as exc:  # recorded, asserted below
                results[k] = exc

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == clients
    ok = {k: r for k, r in results.items() if not isinstance(r, Exception)}
    refused = {k: r for k, r in results.items() if isinstance(r, Exception)}
    # a submission may be refused only cleanly (after minutes of 503s on an overloaded machine), never half-made
    assert all(isinstance(r, SubmitFailed) and "nothing of this submission is queued" in str(r)
               for r in refused.values()), refused
    assert len(ok) >= clients * 3 // 4, f"most submissions get through a busy server: {refused}"
    ids = [rid for r in ok.values() for rid in r.run_ids]
    assert len(ids) == len(ok) * per and len(set(ids)) == len(ids)
    on_server = _runs_named(f"c{unique_name}-")
    assert sorted(str(r.id) for r in on_server) == sorted(ids), "the server holds exactly the runs reported"
    names = sorted(r.name for r in on_server)
    assert names == sorted(f"c{unique_name}-{k}x-{i}" for k in ok for i in range(1, per + 1))


def test_same_submission_key_returns_the_same_runs(burst_job, unique_name):
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit

    q, job = burst_job
    req = SubmitRequest(job=job, queue=q, count=3, name=f"k{unique_name}", idempotency_key=f"key-{unique_name}",
                        params={"record_dir": "/nonexistent"})
    with get_client(sync_client=True) as client:
        first = submit(client, req)
        again = submit(client, req)
    assert first.run_ids == again.run_ids and len(set(first.run_ids)) == 3
    assert len(_runs_named(f"k{unique_name}-")) == 3


def _wait_runs(prefix: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(_runs_named(prefix)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"fewer than {n} runs named {prefix}* appeared"
        time.sleep(0.2)


def test_submit_rides_out_a_server_killed_and_restarted(burst_server, burst_job, unique_name):
    q, job = burst_job
    name, count = f"r{unique_name}", 40
    proc = subprocess.Popen([*CLI, "submit", job, "--queue", q, "--count", str(count), "--name", name,
                             "--param", "record_dir=/nonexistent", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    _wait_runs(f"{name}-", 3, proc)
    burst_server.kill()  # mid-submission, maybe mid-request: an answer may be lost after the commit
    time.sleep(2)
    burst_server.start()
    out, errs = proc.communicate(timeout=300)
    assert proc.returncode == 0, errs
    ids = json.loads(out)["run_ids"]
    assert len(ids) == count and len(set(ids)) == count
    on_server = _runs_named(f"{name}-")
    assert sorted(str(r.id) for r in on_server) == sorted(ids), "no run lost, none made twice"
    assert sorted(r.name for r in on_server) == sorted(f"{name}-{i}" for i in range(1, count + 1))


def test_count_is_all_or_nothing_when_creation_fails_midway(burst_job, unique_name, tmp_path):
    from prefect import get_client

    q, _ = burst_job
    job = deploy_probe(q, f"doomed-{unique_name}")
    name = f"a{unique_name}"
    proc = subprocess.Popen([*CLI, "submit", job, "--queue", q, "--count", "300", "--name", name,
                             "--param", "record_dir=/nonexistent"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    _wait_runs(f"{name}-", 2, proc)
    with get_client(sync_client=True) as client:  # the job goes away mid-submission: creation fails for good
        client.delete_deployment(client.read_deployment_by_name(job).id)
    out, errs = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    msg = " ".join(errs.split())
    assert "failed" in msg and "nothing of this submission is queued" in msg, msg
    assert _runs_named(f"{name}-") == [], "the runs created before the failure were deleted"
    cli("queue", "ls", q)  # the server is healthy afterwards
