"""Bad input: a clear error, a non-zero exit, and nothing enqueued. One test per case."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_helpers import agent, apply_queue, cli, deploy_probe

pytestmark = pytest.mark.usefixtures("prefect_server")


@pytest.fixture(scope="module")
def setup(prefect_server, tmp_path_factory):
    import uuid

    tmp = tmp_path_factory.mktemp("validation")
    u = uuid.uuid4().hex[:6]
    q = apply_queue(tmp, {
        "name": f"val-{u}",
        "presets": {"small": {"cpu": 1, "memory": "1Gi"}, "big": {"cpu": 2, "memory": "4Gi", "gpu": 2}},
        "default_preset": "small",
        "bounds": {"cpu": {"min": 0.5, "max": 4}, "memory": {"max": "8Gi"}, "gpu": {"max": 4}},
    })
    job = deploy_probe(q, f"probe-{u}")
    # an agent with gpu=2 registers its capacity, then stops: submit checks against it
    with agent([q], f"val-agent-{u}", "cpu=4,memory=8Gi,gpu=2", tmp):
        pass
    return {"queue": q, "job": job, "tmp": tmp}


def _run_count(job: str) -> int:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        return client.count_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[job.split("/")[1]])))


def _rejected(setup, *args: str, expect: str, job: str | None = None) -> None:
    before = _run_count(setup["job"])
    proc = cli("submit", job or setup["job"], *args, "--param", f"record_dir={setup['tmp']}", check=False)
    assert proc.returncode != 0, proc.stdout
    assert expect in proc.stderr, proc.stderr
    assert _run_count(setup["job"]) == before, "a rejected submission enqueued a run"


def test_unknown_queue(setup):
    _rejected(setup, "--queue", "no-such-queue", expect="unknown queue 'no-such-queue'")


def test_unknown_job(setup):
    _rejected(setup, "--queue", setup["queue"], expect="unknown job 'probe/nope'", job="probe/nope")


def test_unknown_preset(setup):
    _rejected(setup, "--queue", setup["queue"], "--preset", "huge", expect="unknown preset 'huge'")


def test_cpu_above_bounds(setup):
    _rejected(setup, "--cpu", "16", expect="cpu=16 is above the queue maximum 4")


def test_cpu_below_bounds(setup):
    _rejected(setup, "--cpu", "0.25", expect="cpu=0.25 is below the queue minimum 0.5")


def test_memory_above_bounds(setup):
    _rejected(setup, "--memory", "64Gi", expect="memory=64Gi is above the queue maximum 8Gi")


def test_beyond_any_agent_capacity(setup):
    _rejected(setup, "--gpu", "3", expect="beyond any agent's total capacity")


def test_malformed_memory(setup):
    _rejected(setup, "--memory", "lots", expect="malformed memory 'lots'")


def test_malformed_shm_size(setup):
    _rejected(setup, "--shm-size", "1 gigabyte", expect="malformed shm_size")


def test_shm_size_above_memory(setup):
    _rejected(setup, "--memory", "1Gi", "--shm-size", "2Gi", expect="shm_size")


def test_duplicate_env(setup):
    _rejected(setup, "--env", "JOB_A=1", "--env", "JOB_A=2", expect="'JOB_A' is given twice")


def test_invalid_env_name(setup):
    _rejected(setup, "--env", "1BAD=x", expect="invalid environment variable name '1BAD'")


def test_bad_parameter_type(setup):
    _rejected(setup, "--param", "seconds=soon", expect="bad parameter value")


def test_unknown_parameter(setup):
    _rejected(setup, "--param", "epochs=3", expect="unknown parameter(s) ['epochs']")


def test_unknown_priority(setup):
    _rejected(setup, "--priority", "urgent", expect="unknown priority 'urgent'")


def test_unknown_agent(setup):
    _rejected(setup, "--agent", "ghost", expect="unknown agent 'ghost'")


def test_wrong_queue_for_job(setup, tmp_path: Path, unique_name: str):
    other = apply_queue(tmp_path, {"name": f"other-{unique_name}", "presets": {"s": {"cpu": 1, "memory": "1Gi"}},
                                   "default_preset": "s"})
    _rejected(setup, "--queue", other, expect=f"is deployed to queue '{setup['queue']}'")


def test_valid_submission_is_enqueued_with_resolved_resources(setup):
    before = _run_count(setup["job"])
    proc = cli("submit", setup["job"], "--queue", setup["queue"], "--preset", "big", "--cpu", "3",
               "--param", f"record_dir={setup['tmp']}", "--env", "JOB_X=1", "--count", "2", "--json")
    import json

    out = json.loads(proc.stdout)
    assert len(out["run_ids"]) == 2 and out["preset"] == "big"
    assert out["resources"].startswith("cpu=3,memory=4Gi,gpu=2")
    assert _run_count(setup["job"]) == before + 2
    # clean up so the queue holds nothing for other tests
    from prefect import get_client

    with get_client(sync_client=True) as client:
        for rid in out["run_ids"]:
            client.delete_flow_run(rid)


def test_bad_queue_file_is_rejected(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("queues:\n  - name: x\n    presets: {a: {cpu: 1, memory: 1Gi}}\n    default_preset: b\n")
    proc = cli("queue", "apply", str(bad), check=False)
    assert proc.returncode != 0
    assert "default_preset 'b' is not one of ['a']" in proc.stderr


def test_pool_template_is_a_valid_prefect_form_that_enforces_presets_and_bounds(setup):
    """What the Prefect UI's job-variables form is built from also guards deployments on the server."""
    import httpx
    from prefect import get_client

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(setup["queue"])
        props = pool.base_job_template["variables"]["properties"]
        assert props["preset"]["enum"] == ["big", "small"] and props["gpu"]["maximum"] == 4
        flow_id = client.create_flow_from_name("probe")
        for bad in ({"preset": "huge"}, {"gpu": 9}, {"gpu": "two"}):
            with pytest.raises(httpx.HTTPStatusError) as err:
                client.create_deployment(flow_id=flow_id, name=f"bad-{len(str(bad))}", work_pool_name=setup["queue"],
                                         entrypoint="probe.py:probe", job_variables=bad)
            assert err.value.response.status_code == 422


def test_a_waiting_launch_run_stays_queued_where_prefect_marks_a_stock_run_late(setup):
    """Prefect's late-runs service marks overdue runs named Scheduled Late every few seconds; a launch
    run waits for hardware by design and stays "Queued" (type SCHEDULED, what every query reads)."""
    import time
    from datetime import datetime, timedelta, timezone

    from prefect import get_client
    from prefect.states import Scheduled

    from prefect_launch.deployments.submit import SubmitRequest, submit

    due = datetime.now(timezone.utc) - timedelta(minutes=10)  # overdue at once (Late after 15 s)
    with get_client(sync_client=True) as client:
        ours = submit(client, SubmitRequest(job=setup["job"], queue=setup["queue"], scheduled_time=due,
                                            params={"record_dir": str(setup["tmp"])})).run_ids[0]
        dep = client.read_deployment_by_name(setup["job"])
        stock = client.create_flow_run_from_deployment(dep.id, state=Scheduled(scheduled_time=due),
                                                       parameters={"record_dir": str(setup["tmp"])}).id
        try:
            deadline = time.time() + 60
            while client.read_flow_run(stock).state_name != "Late" and time.time() < deadline:
                time.sleep(1)
            assert client.read_flow_run(stock).state_name == "Late", "Prefect's late-runs service did not run"
            run = client.read_flow_run(ours)
            assert (run.state_type.value, run.state_name) == ("SCHEDULED", "Queued")
            assert abs((run.next_scheduled_start_time - due).total_seconds()) < 1
        finally:
            for rid in (ours, stock):
                client.delete_flow_run(rid)
