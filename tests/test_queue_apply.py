"""`queue apply` never leaves a file half-applied without saying so (issue 38): every queue is checked before
anything is written, and a server failure part-way names what was written and what was not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_helpers import apply_queue, cli


def _queue(name: str, **extra) -> dict:
    return {"name": name, "default_preset": "small", "presets": {"small": {"cpu": 1, "memory": "512Mi"}}, **extra}


def _pool(name: str):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(name)
        except ObjectNotFound:
            return None


def _deployment(name: str):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None


@pytest.mark.usefixtures("prefect_server")
def test_a_conflict_in_the_last_queue_writes_nothing(tmp_path: Path, unique_name):
    first, clash = f"qa-new-{unique_name}", f"qa-clash-{unique_name}"
    apply_queue(tmp_path, _queue(clash))  # a process queue (launch-process pool)
    qfile = tmp_path / "queues.yaml"
    qfile.write_text(json.dumps({"queues": [_queue(first), _queue(clash, target="kubernetes", image="busybox:1")]}))
    proc = cli("queue", "apply", str(qfile), "--json", check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert "nothing applied" in proc.stderr and f"queue {clash!r} exists with target type 'launch-process'" in proc.stderr
    assert _pool(first) is None and _deployment(f"launch-session/session-{first}") is None
    assert _pool(clash).type == "launch-process"


@pytest.mark.usefixtures("prefect_server")
def test_a_failure_part_way_says_what_was_written(tmp_path: Path, unique_name, monkeypatch):
    from prefect_launch.deployments import sessions

    a, b, c = (f"qa-{x}-{unique_name}" for x in "abc")
    deploy = sessions.deploy_session_flow

    def flaky(queue, *args, **kw):  # the server fails while the second queue's session job is written
        if queue == b:
            raise RuntimeError("server went away")
        return deploy(queue, *args, **kw)

    monkeypatch.setattr(sessions, "deploy_session_flow", flaky)
    qfile = tmp_path / "queues.yaml"
    qfile.write_text(json.dumps({"queues": [_queue(a), _queue(b), _queue(c)]}))
    proc = cli("queue", "apply", str(qfile), "--json", check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc
    err = " ".join(proc.stderr.split())
    assert f"applying queue {b!r} failed: RuntimeError: server went away" in err
    assert (f"written before the failure: work pool {a} created with its priority queues; session job "
            f"launch-session/session-{a}; work pool {b} created with its priority queues") in err
    assert f"not applied: {c}" in err
    assert _pool(a) and _deployment(f"launch-session/session-{a}") and _pool(b)
    assert _deployment(f"launch-session/session-{b}") is None and _pool(c) is None
    monkeypatch.setattr(sessions, "deploy_session_flow", deploy)  # applying again completes it
    done = json.loads(cli("queue", "apply", str(qfile), "--json").stdout)
    assert [(r["queue"], r["action"]) for r in done] == [(a, "unchanged"), (b, "unchanged"), (c, "created")]
    assert _deployment(f"launch-session/session-{b}") is not None


@pytest.mark.usefixtures("prefect_server")
def test_a_docker_queue_gets_the_session_job_with_its_image_and_the_flows_folder(tmp_path: Path, unique_name):
    """No Docker daemon needed: the session job's job variables name the queue's image (as written, never
    retagged) and mount the installed flows folder read-only."""
    from prefect_launch.deployments.sessions import FLOWS_DIR

    q = f"qa-docker-{unique_name}"
    qfile = tmp_path / "queues.yaml"
    qfile.write_text(json.dumps({"queues": [_queue(q, target="docker", image="python:3.12-slim")]}))
    out = json.loads(cli("queue", "apply", str(qfile), "--json").stdout)
    assert out == [{"queue": q, "action": "created", "session_job": f"launch-session/session-{q}"}]
    dep = _deployment(f"launch-session/session-{q}")
    assert dep.job_variables["image"] == "python:3.12-slim"
    assert dep.job_variables["volumes"] == [f"{FLOWS_DIR}:{FLOWS_DIR}:ro"]
    assert dep.work_queue_name == "medium" and dep.entrypoint == "session.py:session"
