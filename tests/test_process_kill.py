"""The process back end's `kill_infrastructure`: the one way the agent stops a process run.

Real child processes in their own session (as Prefect starts runs); no server: the worker is built
offline and the run's handle is put in its `ActiveRuns` as `run()` would.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import anyio
import psutil
import pytest

from prefect.exceptions import InfrastructureNotAvailable, InfrastructureNotFound

from prefect_launch.workers.agent.active_run import RunHandle
from prefect_launch.workers.agent.context import AgentContext
from prefect_launch.workers.agent.recovery import pid_start_time
from prefect_launch.workers.backends.process import LaunchProcessWorker, process_id

STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
POLITE = "import time\nprint('up', flush=True)\ntime.sleep(60)\n"
# the engine exits on SIGTERM, but a worker it started (here: a stubborn grandchild) ignores it and stays in its group
PARENT_OF_STUBBORN = ("import subprocess, sys, time\n"
                      f"child = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}], stdout=subprocess.PIPE)\n"
                      "child.stdout.readline()\n"
                      "print(child.pid, flush=True)\n"
                      "time.sleep(60)\n")


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH_STATE_DIR", str(tmp_path))
    return LaunchProcessWorker(work_pool_name=f"kill-{uuid.uuid4().hex[:6]}", agent=AgentContext.detect("cpu=2,memory=1Gi"),
                               use_cgroups=False)


def start(worker, source: str) -> tuple[subprocess.Popen, uuid.UUID]:
    run_id = uuid.uuid4()
    proc = subprocess.Popen([sys.executable, "-c", source], start_new_session=True, stdout=subprocess.PIPE,
                            env={"PREFECT__FLOW_RUN_ID": str(run_id), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.readline().strip() == b"up"
    worker._active.of(run_id).handle = RunHandle(pid=proc.pid, pid_started=pid_start_time(proc.pid))
    return proc, run_id


@pytest.mark.parametrize("source, grace, killed_after", [
    (POLITE, 5, None),  # exits on SIGTERM, well before the grace
    (STUBBORN, 1, 1.0),  # ignores SIGTERM: killed once the grace is over
    (STUBBORN, 0, None),  # grace 0: killed at once
])
def test_kill_infrastructure_stops_the_run_within_its_grace(worker, source, grace, killed_after):
    proc, _ = start(worker, source)
    t0 = time.monotonic()
    anyio.run(lambda: worker.kill_infrastructure(process_id(proc.pid), None, grace_seconds=grace))
    took = time.monotonic() - t0
    assert proc.wait(timeout=5) is not None
    if killed_after is not None:
        assert proc.returncode == -9 and took >= killed_after
    else:
        assert took < 2.0


def test_kill_infrastructure_leaves_no_process_of_the_run_behind(worker):
    run_id = uuid.uuid4()
    proc = subprocess.Popen([sys.executable, "-c", PARENT_OF_STUBBORN], start_new_session=True, stdout=subprocess.PIPE,
                            env={"PREFECT__FLOW_RUN_ID": str(run_id), "PATH": "/usr/bin:/bin"})
    child = psutil.Process(int(proc.stdout.readline()))
    worker._active.of(run_id).handle = RunHandle(pid=proc.pid, pid_started=pid_start_time(proc.pid))
    anyio.run(lambda: worker.kill_infrastructure(process_id(proc.pid), None, grace_seconds=1))
    assert proc.wait(timeout=5) == -15  # the engine took the SIGTERM
    try:
        child.wait(timeout=5)  # and the child that ignored it did not outlive the grace
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the run's child process survived kill_infrastructure")


def test_kill_infrastructure_refuses_what_is_not_its_run(worker):
    proc = subprocess.Popen([sys.executable, "-c", POLITE], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"up"
        with pytest.raises(InfrastructureNotAvailable, match="not a run of agent"):
            anyio.run(lambda: worker.kill_infrastructure(process_id(proc.pid), None, grace_seconds=0))
        with pytest.raises(InfrastructureNotAvailable, match="is on host 'elsewhere'"):
            anyio.run(lambda: worker.kill_infrastructure(f"elsewhere:{proc.pid}", None, grace_seconds=0))
        with pytest.raises(InfrastructureNotFound, match="does not name a process"):
            anyio.run(lambda: worker.kill_infrastructure(f"{socket.gethostname()}:abc", None, grace_seconds=0))
        assert proc.poll() is None  # none of them touched it
    finally:
        proc.kill()
        proc.wait()


def test_kill_infrastructure_says_when_the_run_is_already_gone(worker):
    proc, _ = start(worker, POLITE)
    proc.kill()
    proc.wait()
    with pytest.raises(InfrastructureNotFound, match="already exited"):
        anyio.run(lambda: worker.kill_infrastructure(str(proc.pid), None, grace_seconds=1))
