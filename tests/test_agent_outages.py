"""The Prefect server goes away mid-run and comes back: nothing lost, nothing run twice.

Uses its own server (a fixed port and database, stopped and started again) so the
outage does not touch the session's server; the session's settings are restored after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from launch_helpers import agent, apply_queue, cli_json, deploy_probe, read_runs, records, wait_final, wait_running
from prefect_launch.local_server import free_port, local_prefect_server

pytestmark = pytest.mark.server  # its own server, stopped and started again, and agents


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
            # stopped with its server up (an agent stopped during an outage: the next test)
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)



def test_agent_stopped_during_an_outage_exits_and_says_why(tmp_path: Path, unique_name: str,
                                                          restartable_server):
    """Ctrl-C on an agent whose server went away just as a run ended: the run's end cannot be recorded
    there, nor its events delivered. The agent used to wait on those API calls until killed; it now
    exits by itself within seconds, says why, and loses nothing it can keep locally."""
    from launch_helpers import wait_agent_online
    from prefect_launch.blocks.metrics_store import RunMetricsStore, default_store_url
    from prefect_launch.blocks.scheduling_history import read_history

    q, name = f"cc-{unique_name}", f"cc-{unique_name}"
    rec = tmp_path / "records"
    log = tmp_path / "agent.log"
    with contextlib.ExitStack() as server:
        server.enter_context(restartable_server())
        apply_queue(tmp_path, {"name": q, "presets": {"c": {"cpu": 1, "memory": "256Mi"}}, "default_preset": "c"})
        job = deploy_probe(q, f"probe-{unique_name}")
        with agent([q], name, "cpu=2,memory=4Gi", tmp_path, wait_online=False, log_name=log.name,
                   on_exit="drain") as proc:
            wait_agent_online(name, [q])
            done = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                            "--param", "seconds=1", "--param", "linger=20")["run_ids"][0]
            assert wait_final([done], timeout=120)[0].state.is_completed()
            server.close()
            # the server is gone the moment the run reported Completed: its process (which lingers 20 s after its
            # end, as a job's last upload would; warm engines otherwise exit within ~0.5 s now) and the agent's
            # record of its end are still talking to it
            assert proc.poll() is None, "the agent survived the outage"
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: drain, which waits for the run's process (told why) ...
            deadline = time.monotonic() + 30
            while "draining" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            text = log.read_text()
            if "draining" in text:  # (unless its process had already exited: then the agent just stops)
                assert "does not answer: a run that has finished its work may still be waiting" in text, text[-3000:]
            t0 = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)  # ... and Ctrl-C again: cancel it and stop
            proc.wait(60)
            took = time.monotonic() - t0
    text = log.read_text()
    assert "[background_process]" not in text, text[-3000:]  # it exited by itself, not by the test's kill
    assert proc.returncode == 0, text[-3000:]
    assert took < 25, f"the agent took {took:.1f} s to stop:\n{text[-3000:]}"
    assert f"the end of 1 run(s) ({done}) is not recorded" in text and "does not answer" in text, text[-3000:]
    assert "not delivered to the Prefect server" in text, text[-3000:]
    assert "drained" not in text, text[-3000:]  # the second Ctrl-C cancelled; the drain did not claim success
    # kept locally: the run's end in the scheduling history (saying why its state is unread) and its summary
    store = RunMetricsStore(url=default_store_url())
    ends = read_history(store, done, phase="terminate")
    assert len(ends) == 1 and "Prefect state was not read" in ends[0].message, ends
    assert ends[0].to_state == "UNKNOWN", ends  # the run had reported Completed: the agent claims no other end
    assert store.summaries(flow_run_ids=[done])[0]["has_summary"]
    assert list(records(rec)) == [done]  # run once
