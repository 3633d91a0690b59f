"""The Prefect server goes away mid-run and comes back: nothing lost, nothing run twice.

Uses its own server (a fixed port and database, stopped and started again) so the
outage does not touch the session's server; the session's settings are restored after.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from launch_helpers import agent, apply_queue, cli_json, deploy_probe, read_runs, records, wait_final, wait_running
from prefect_launch.local_server import free_port, local_prefect_server


@pytest.fixture
def restartable_server(tmp_path_factory):
    from launch_helpers import restored_prefect_env

    home, port = tmp_path_factory.mktemp("outage-home"), free_port()
    with restored_prefect_env():
        yield lambda: local_prefect_server(home, port=port)


def test_server_restart_mid_run_loses_nothing(tmp_path: Path, unique_name: str, restartable_server):
    from prefect import get_client

    q, name = f"out-{unique_name}", f"out-{unique_name}"
    rec = tmp_path / "records"
    release = tmp_path / "release"
    with restartable_server():
        apply_queue(tmp_path, {"name": q, "presets": {"g": {"cpu": 1, "memory": "512Mi", "gpu": 1}},
                               "default_preset": "g"})
        job = deploy_probe(q, f"probe-{unique_name}")
    with agent([q], name, "cpu=2,memory=4Gi,gpu=1", tmp_path, wait_online=False) as proc:
        with restartable_server():
            from launch_helpers import wait_agent_online

            wait_agent_online(name, [q])
            # runs through the outage until released once the server is back (300 s at most)
            running = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                               "--param", "seconds=300", "--param", f"release_file={release}",
                               "--param", "tag=running")["run_ids"][0]
            waiting = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                               "--param", "seconds=1", "--param", "tag=waiting")["run_ids"][0]
            wait_running(running)
        # the server is gone while one run runs and one waits; the agent keeps going
        time.sleep(8)
        assert proc.poll() is None, "the agent survived the outage"
        with restartable_server():
            release.touch()  # the running run outlived the outage; it ends now, with the server back
            runs = {str(r.id): r for r in wait_final([running, waiting], timeout=180)}
            assert runs[running].state.is_completed(), runs[running].state
            assert runs[waiting].state.is_completed(), runs[waiting].state
            got = records(rec)
            assert sorted(got) == sorted([running, waiting]), "each run ran exactly once"
            # the waiting run took the GPU only after the running one had released it
            assert got[waiting]["start"] >= got[running]["end"] - 0.5
            with get_client(sync_client=True) as client:
                for rid in (running, waiting):
                    claims = [s for s in client.read_flow_run_states(rid) if s.name == "Pending"]
                    assert len(claims) == 1, f"run {rid} claimed {len(claims)} times"
            assert all(r.run_count == 1 for r in read_runs([running, waiting]))
            # stopped while its server is up: once the server is gone, its drain would wait out the 20-s kill
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
