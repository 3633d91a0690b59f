"""End to end through the CLI: a real server, real agents, real job processes.

Assertions come from the jobs' own records (env, affinity, times) and from
Prefect's state histories, never from what the agent says about itself.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_helpers import (agent, apply_queue, cli_json, deploy_probe, read_runs, records, wait_agent_free,
                            wait_final, wait_running)

pytestmark = pytest.mark.usefixtures("prefect_server")

GPU_PRESETS = {
    "cpu1": {"cpu": 1, "memory": "512Mi", "gpu": 0},
    "gpu1": {"cpu": 0.5, "memory": "512Mi", "gpu": 1},
    "gpu2": {"cpu": 1, "memory": "512Mi", "gpu": 2},
}


def _claim_times(run_ids: list[str]) -> dict[str, float]:
    """When Prefect accepted each run's Pending claim, from its own state history."""
    from prefect import get_client

    out = {}
    with get_client(sync_client=True) as client:
        for rid in run_ids:
            states = client.read_flow_run_states(rid)
            # the claim is the Pending state; the worker's later "Submitting" is also of type PENDING
            pend = [s.timestamp for s in states if s.type.value == "PENDING" and s.name == "Pending"]
            assert len(pend) == 1, f"run {rid} was claimed {len(pend)} times"
            out[rid] = pend[0].timestamp()
    return out


def test_mixed_presets_respect_capacity_priority_and_fifo(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"mix-{unique_name}", "presets": GPU_PRESETS, "default_preset": "cpu1"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    plan = [  # (tag, preset, priority, seconds): submitted in this order before the agent starts
        ("blocker", "gpu2", "medium", 2),
        ("low-a", "gpu1", "low", 2),
        ("low-b", "gpu1", "low", 2),
        ("med-c", "cpu1", "medium", 2),
        ("med-d", "gpu1", "medium", 2),
        ("high-e", "gpu2", "high", 2),
    ]
    ids: dict[str, str] = {}
    for tag, preset, prio, secs in plan:
        out = cli_json("submit", job, "--queue", q, "--preset", preset, "--priority", prio,
                       "--param", f"record_dir={rec}", "--param", f"seconds={secs}", "--param", f"tag={tag}")
        ids[tag] = out["run_ids"][0]

    # While no agent runs, every run is queued and `queue ls` counts them.
    status = cli_json("queue", "ls", q)[0]
    assert status["queued"] == len(plan) and status["running"] == 0

    with agent([q], f"mix-{unique_name}", "cpu=2,memory=4Gi,gpu=2", tmp_path):
        runs = wait_final(list(ids.values()))
    assert all(r.state.is_completed() for r in runs), {r.name: r.state_name for r in runs}

    recs = {r["tag"]: r for r in records(rec).values()}
    assert set(recs) == {p[0] for p in plan}
    # GPU sets of runs that overlap in time are disjoint; totals never exceed capacity.
    for a, b in itertools.combinations(recs.values(), 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            ga = set(filter(None, a["cuda_visible_devices"].split(",")))
            gb = set(filter(None, b["cuda_visible_devices"].split(",")))
            assert not (ga & gb), f"{a['tag']} and {b['tag']} shared GPUs {ga & gb}"
    for r in recs.values():
        t = r["start"]
        active = [x for x in recs.values() if x["start"] <= t < x["end"]]
        assert sum(int(x["launch_gpu"]) for x in active) <= 2
        assert sum(float(x["launch_cpu"]) for x in active) <= 2
        want = GPU_PRESETS[next(p[1] for p in plan if p[0] == r["tag"])]
        assert len(list(filter(None, r["cuda_visible_devices"].split(",")))) == want["gpu"]
        assert r["cuda_device_order"] == "PCI_BUS_ID"
        assert r["omp_num_threads"] == str(max(1, int(want["cpu"])))
        assert len(r["affinity"]) >= 1 and len(r["affinity"]) <= max(1, int(want["cpu"] + 0.99))

    # Order: priority first, then submit time; strict FIFO means nothing passes a waiting head.
    claims = _claim_times(list(ids.values()))
    rank = {"high": 0, "medium": 1, "low": 2}
    key = {tag: (rank[prio], i) for i, (tag, _, prio, _) in enumerate(plan)}
    expected = sorted(key, key=key.get)
    assert expected[0] == "high-e"
    for earlier, later in itertools.combinations(expected, 2):
        # runs claimed in one placement round may reach Pending a few ms apart
        assert claims[ids[earlier]] <= claims[ids[later]] + 0.5, f"{later} was claimed before {earlier}"
    # the blocker (gpu2) held the queue: low runs were claimed only after it finished
    assert claims[ids["low-a"]] >= recs["blocker"]["end"] - 0.5


def test_two_agents_one_queue_run_each_run_once(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"pair-{unique_name}", "presets": {"tiny": {"cpu": 0.5, "memory": "256Mi"}},
                               "default_preset": "tiny"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    with agent([q], f"a1-{unique_name}", "cpu=2,memory=4Gi", tmp_path), \
            agent([q], f"a2-{unique_name}", "cpu=2,memory=4Gi", tmp_path):
        out = cli_json("submit", job, "--queue", q, "--count", "12",
                       "--param", f"record_dir={rec}", "--param", "seconds=0.2")
        ids = out["run_ids"]
        assert len(set(ids)) == 12
        # Backend.AI's "select agent": a pinned run only ever runs on the agent it names
        pinned = cli_json("submit", job, "--queue", q, "--agent", f"a2-{unique_name}", "--count", "3",
                          "--param", f"record_dir={rec}", "--param", "seconds=0.2")["run_ids"]
        runs = wait_final(ids + pinned, timeout=300)
        got = records(rec)
        # Prefect's worker labels are written with the placement labels, in one write once the run's
        # process is up (lifecycle._label_placement), a second after it starts: these runs last 0.2 s
        deadline = time.time() + 30
        while True:
            labels = {str(r.id): r.labels or {} for r in read_runs(ids + pinned)}
            if all("launch.placement" in x and "prefect.worker.name" in x for x in labels.values()) or time.time() > deadline:
                break
            time.sleep(1)
    for rid, x in labels.items():
        by = got[rid]["launch_agent"]
        assert x.get("prefect.worker.name") == by and x.get("prefect.work-pool.name") == q, (rid, x)
        assert x.get("launch.placement", "").startswith(f"agent {by}:") and x.get("launch.waiting", "") == "", (rid, x)
    assert all(r.state.is_completed() for r in runs)
    assert sorted(got) == sorted(ids + pinned), "every run recorded exactly once"
    assert {got[p]["launch_agent"] for p in pinned} == {f"a2-{unique_name}"}
    assert all(r.run_count == 1 for r in runs)
    _claim_times(ids + pinned)  # asserts exactly one Pending claim per run
    assert {r["launch_agent"] for r in got.values()} <= {f"a1-{unique_name}", f"a2-{unique_name}"}


def test_killed_job_releases_capacity_and_memory_limit_is_enforced(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"kill-{unique_name}", "default_preset": "g",
                               "presets": {"g": {"cpu": 1, "memory": "1Gi", "gpu": 1},
                                           "small-mem": {"cpu": 1, "memory": "400Mi", "gpu": 1}}})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    name = f"k-{unique_name}"
    with agent([q], name, "cpu=2,memory=4Gi,gpu=1", tmp_path):
        long_id = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                           "--param", "seconds=300")["run_ids"][0]
        next_id = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                           "--param", "seconds=0.1", "--param", "tag=after-kill")["run_ids"][0]
        # the second run waits for the only GPU and says so
        pid = wait_running(long_id)
        want = f"needs gpu=1, agent {name} has 0 free"
        deadline = time.time() + 30  # labels are written by the agent shortly after it decides
        while True:
            listed = {r["run_id"]: r for r in cli_json("runs", "ls", "--queue", q)}
            waiting, running = listed[next_id], listed[long_id]
            if (want in (waiting["note"] or "") and "gpus 0" in (running["note"] or "")) or time.time() > deadline:
                break
            time.sleep(1)
        assert waiting["state"] == "Queued"  # not "Late": Prefect's late-runs service leaves launch runs alone
        assert want in (waiting["note"] or ""), waiting
        assert f"agent {name}" in (running["note"] or "") and "gpus 0" in running["note"], running
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # the job dies under the agent
        runs = {str(r.id): r for r in wait_final([long_id, next_id])}
        assert runs[long_id].state.is_crashed()
        assert runs[next_id].state.is_completed(), "capacity came back after the kill"

        # over its memory limit a run is stopped and marked with why; a run within it completes
        hog = cli_json("submit", job, "--queue", q, "--preset", "small-mem", "--param", f"record_dir={rec}",
                       "--param", "alloc_mb=700", "--param", "seconds=5")["run_ids"][0]
        ok = cli_json("submit", job, "--queue", q, "--preset", "small-mem", "--param", f"record_dir={rec}",
                      "--param", "alloc_mb=20", "--param", "seconds=0.1")["run_ids"][0]
        runs = {str(r.id): r for r in wait_final([hog, ok])}
        assert runs[hog].state.is_crashed()
        assert "memory limit exceeded" in runs[hog].state.message
        assert runs[ok].state.is_completed()
        wait_agent_free(name, gpu=1)


def test_prefect_worker_start_finds_launch_process_type(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"plain-{unique_name}", "presets": {"one": {"cpu": 1, "memory": "512Mi", "gpu": 1}},
                               "default_preset": "one"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    rid = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}", "--param", "seconds=0.1")["run_ids"][0]
    # also covers the cold-start path (no pre-imported engine)
    env = dict(os.environ, LAUNCH_WORKER_CAPACITY="cpu=1,memory=2Gi,gpu=1", LAUNCH_WARM_ENGINES="0")
    proc = subprocess.run([sys.executable, "-m", "prefect", "worker", "start", "--pool", q, "--type", "launch-process",
                           "--name", f"pw-{unique_name}", "--run-once"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = wait_final([rid], timeout=60)[0]
    assert run.state.is_completed()
    r = records(rec)[rid]
    assert r["cuda_visible_devices"] == "0" and r["launch_agent"] == f"pw-{unique_name}"
    assert r["cuda_device_order"] == "PCI_BUS_ID"  # the ledger's indices are NVML's, i.e. bus order (issue 38)


def test_cancel_and_failure_release_capacity_and_metrics_are_recorded(tmp_path: Path, unique_name: str):
    from prefect import get_client
    from prefect.states import Cancelling

    q = apply_queue(tmp_path, {"name": f"cx-{unique_name}", "presets": {"g": {"cpu": 1, "memory": "1Gi", "gpu": 1}},
                               "default_preset": "g"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    name = f"cx-{unique_name}"
    with agent([q], name, "cpu=2,memory=4Gi,gpu=1", tmp_path):
        long_id = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                           "--param", "seconds=300")["run_ids"][0]
        wait_running(long_id)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(long_id, Cancelling(), force=True)
        # a run that fails (bad record_dir: a file, not a folder) also gives its GPU back
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("x")
        failing = cli_json("submit", job, "--queue", q, "--param", f"record_dir={blocker}",
                           "--param", "seconds=0.1")["run_ids"][0]
        ok = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}", "--param", "alloc_mb=150",
                      "--param", "seconds=3")["run_ids"][0]
        runs = {str(r.id): r for r in wait_final([long_id, failing, ok])}
        assert runs[long_id].state.is_cancelled(), runs[long_id].state
        assert runs[failing].state.is_failed(), runs[failing].state
        assert runs[ok].state.is_completed()
        wait_agent_free(name, gpu=1)

    # measured from outside the job: no instrumentation in flows/probe.py
    report = cli_json("runs", "show", ok)
    s = report["summary"]
    assert s["exit_state"] == "COMPLETED" and s["samples"] >= 2
    assert s["peak_rss_bytes"] >= 150 * 1024 * 1024
    assert s["allocated_gpus"] == 1 and s["allocated_memory_bytes"] == 1024**3
    assert len(report["series"]) >= 2
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[ok])))
    assert any(a.type == "table" and "memory" in str(a.data) for a in arts)


def test_one_agent_two_queues_share_one_ledger(tmp_path: Path, unique_name: str):
    presets = {"g": {"cpu": 0.5, "memory": "512Mi", "gpu": 1}}
    qa = apply_queue(tmp_path, {"name": f"qa-{unique_name}", "presets": presets, "default_preset": "g"})
    qb = apply_queue(tmp_path, {"name": f"qb-{unique_name}", "presets": presets, "default_preset": "g"})
    ja, jb = deploy_probe(qa, f"pa-{unique_name}"), deploy_probe(qb, f"pb-{unique_name}")
    rec = tmp_path / "records"
    ids = []
    for job, q in ((ja, qa), (jb, qb)):
        ids += cli_json("submit", job, "--queue", q, "--count", "2", "--param", f"record_dir={rec}",
                        "--param", "seconds=1.5")["run_ids"]
    with agent([qa, qb], f"two-{unique_name}", "cpu=2,memory=4Gi,gpu=1", tmp_path):
        runs = wait_final(ids)
    assert all(r.state.is_completed() for r in runs)
    recs = list(records(rec).values())
    assert len(recs) == 4 and all(r["cuda_visible_devices"] == "0" for r in recs)
    for a, b in itertools.combinations(recs, 2):  # one GPU: no two runs of either queue overlap
        assert a["end"] <= b["start"] or b["end"] <= a["start"], "the GPU was given twice"
