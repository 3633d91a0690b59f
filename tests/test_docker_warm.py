"""Warm containers on a docker queue (``warm_containers: 1``), against a real dockerd.

The queue's first run starts cold and leaves a warm container of its shape behind; the
next run of that shape starts in it. Checked from outside and inside: the warm
container's id is the run's, renamed ``launch-<run id>``; its CPU, core and memory
limits were set at hand-over (docker inspect and the job's own cgroup/affinity
readings); the run's environment reached the job but not the container's config, and
the order file that carried it is gone. Then the agent is SIGKILLed: a new life
re-adopts the warm-started run by its name, removes the unused warm container the old
life left, and on exit removes its own.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from launch_helpers import CLI, apply_queue, wait_agent_free, wait_agent_online, wait_final, wait_for
from prefect_launch.workers.backends.warm_containers import (ORDER_DONE_PATH, ORDER_PATH, WARM_LABEL, WARM_NAME_PREFIX,
                                                    run_container_name)
from test_docker_backend import MiB, PRESETS, agent, deploy_container_probe, record, submit
from test_docker_backend import docker_client, docker_host, image  # noqa: F401  # session fixtures

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.timeout(1500)]


def warm_containers(client, agent_name: str) -> list:
    return [c for c in client.containers.list(all=True, filters={"label": f"{WARM_LABEL}={agent_name}"})
            if c.name.startswith(WARM_NAME_PREFIX)]


def test_warm_container_takes_the_runs_limits_and_env_and_survives_an_agent_kill(
        tmp_path: Path, unique_name: str, docker_client, image: str):  # noqa: F811
    from prefect_launch.local_server import background_process

    name = f"dkw-{unique_name}"
    q = apply_queue(tmp_path, {"name": name, "target": "docker", "image": image, "presets": PRESETS,
                               "default_preset": "small", "warm_containers": 1})
    out = tmp_path / "out"
    job = deploy_container_probe(q, f"warm-{unique_name}", image, out, keep_container=True)
    args = [*CLI, "agent", "--name", name, "--capacity", "cpu=2,memory=2Gi,gpu=0", "--queue", q]
    log1 = tmp_path / "agent-1.log"
    release = out / "release"  # in the mounted folder: the job inside its container sees it appear
    with background_process(args, log1) as first:
        wait_agent_online(name, [q], timeout=240)
        cold = submit(job, q, "--param", f"record_dir={out}")
        (run,) = wait_final([cold], timeout=240)
        assert run.state_name == "Completed", run.state.message
        warm = wait_for(lambda: [c for c in warm_containers(docker_client, name)
                                 if b"launch-warm-ready" in c.logs()], 120,
                        "no warm container became ready: " + log1.read_text()[-3000:])
        (w,) = warm
        assert w.attrs["HostConfig"]["NanoCpus"] == 0 and w.attrs["HostConfig"]["Memory"] == 0  # no run's limits yet

        # alive until released below (once the next agent life has re-adopted it), 300 s at most
        rid = submit(job, q, "--param", f"record_dir={out}", "--param", "seconds=300", "--param",
                     f"release_file={release}", "--env", "WARM_PROBE=yes")
        wait_for(lambda: (out / f"{rid}.json").exists(), 120, "the warm-started run never ran: "
                 + log1.read_text()[-3000:])
        c = docker_client.containers.get(run_container_name(rid))
        assert c.id == w.id  # the run is in the container that was waiting for it
        hc = c.attrs["HostConfig"]
        # the hand-over's CPU limit: a CFS quota (docker-py's Container.update has no NanoCpus), same limit
        assert hc["CpuQuota"] / hc["CpuPeriod"] == PRESETS["small"]["cpu"] and hc["NanoCpus"] == 0
        assert hc["Memory"] == 256 * MiB and hc["MemorySwap"] == 256 * MiB
        assert hc["ShmSize"] == 64 * MiB and hc["NetworkMode"] == "host"
        cores = [int(x) for x in hc["CpusetCpus"].split(",")]
        inside = record(out, rid)
        assert inside["run_id"] == rid
        assert inside["nproc"] == len(cores) and inside["affinity"] == cores
        assert int(inside["memory_limit"]) == 256 * MiB
        assert inside["shm_bytes"] == 64 * MiB
        assert not any(e.startswith(("WARM_PROBE=", "PREFECT__FLOW_RUN_ID=")) for e in c.attrs["Config"]["Env"])
        assert c.exec_run(["test", "-e", ORDER_PATH]).exit_code == 1  # the order (the run's env) was removed
        assert c.exec_run(["test", "-e", ORDER_DONE_PATH]).exit_code == 0  # its empty done marker stays
        assert f"run {rid} starts in warm container" in log1.read_text()
        left = wait_for(lambda: warm_containers(docker_client, name), 120, "no refill after the hand-over")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()

    assert docker_client.containers.get(c.id).status == "running"  # the run outlives its agent
    with agent([q], name, "cpu=2,memory=2Gi,gpu=0", tmp_path, log_name="agent-2.log"):
        log2 = tmp_path / "agent-2.log"
        wait_for(lambda: "recovered" in log2.read_text(), 240, log2.read_text()[-3000:])
        assert "recovered 1 live run(s)" in log2.read_text(), log2.read_text()[-3000:]
        release.touch()  # re-adopted while alive: now let it end, and this life must read that end
        wait_for(lambda: "removed 1 unused warm container(s)" in log2.read_text(), 60, log2.read_text()[-3000:])
        assert not any(x.id == left[0].id for x in docker_client.containers.list(all=True))
        (run,) = wait_final([rid], timeout=240)
        assert run.state_name == "Completed", run.state.message
        again = submit(job, q, "--param", f"record_dir={out}")  # this life's first run: cold, then it warms one
        (run,) = wait_final([again], timeout=240)
        assert run.state_name == "Completed", run.state.message
        wait_for(lambda: warm_containers(docker_client, name), 120, "the new life never warmed a container")
        wait_agent_free(name, 0, timeout=120)
    assert warm_containers(docker_client, name) == []  # an agent that exits leaves no warm container behind
    assert record(out, rid)["run_id"] == rid
