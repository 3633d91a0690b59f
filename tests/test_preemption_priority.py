"""Issue 12 on a real server and agent: preemptible runs give their GPU back to a regular run and
come back later; one priority order across an agent's queues; owner quotas.

Ground truth is the runs' own state histories (Running / Scheduled timestamps and messages)."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from launch_helpers import agent, apply_queue, cli_json, deploy_probe, read_runs, wait_final, wait_running

from prefect_launch.workers.agent.tags import ALLOC_LABEL, WAIT_LABEL

GPU_PRESETS = {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}}


def _states(run_id: str) -> list:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)


def _submit(job: str, *extra: str, seconds: float = 1.0, tmp=None, release=None) -> str:
    """With ``release`` (a path), the job runs until that file exists, ``seconds`` at most."""
    args = ["submit", job, "--param", f"record_dir={tmp}", "--param", f"seconds={seconds}", *extra]
    if release is not None:
        args += ["--param", f"release_file={release}"]
    return cli_json(*args)["run_ids"][0]


def _until(condition, timeout: float) -> None:
    """Poll ``condition`` for at most ``timeout`` s before a test releases its held runs. Not a check: the
    test's assertions judge what happened, whether or not the condition came true in time."""
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        time.sleep(0.3)


def _labelled(run_ids: list[str], key: str) -> bool:
    runs = read_runs(run_ids)
    return len(runs) == len(run_ids) and all((r.labels or {}).get(key) for r in runs)


def _placed_count(run_ids: list[str]) -> int:
    return sum(1 for r in read_runs(run_ids) if r.state and r.state.type.value != "SCHEDULED")


def _running_times(run_id: str) -> list[float]:
    return [s.timestamp.timestamp() for s in _states(run_id) if s.type.value == "RUNNING"]


def _placed_times(run_id: str) -> list[float]:
    """When the agent placed the run (Scheduled -> Pending): the decision itself, before the engine's
    start-up, which on a loaded box can take longer than a short run lasts."""
    return [s.timestamp.timestamp() for s in _states(run_id) if s.type.value == "PENDING"]


def _placement(run_id: str) -> tuple[datetime, int]:
    """Where the agent placed the run, from its scheduling history (`launch history RUN`): the time of the
    plan (one dispatch cycle) that started it and its position in that plan. Runs started in one cycle are
    handed to Prefect together and claim Pending concurrently, so among them the Pending times come in any
    order (alice's 1st and 2nd swapped in 1 of 3 runs here); the plan's order is the decision itself."""
    placed = []
    for rec in cli_json("history", run_id):
        if rec["phase"] == "schedule" and rec["result"] == "SUCCESS" and rec.get("to_state") == "PENDING":
            seq = next(s for s in rec["sub_steps"] if s["step"] == "sequencing")
            placed.append((datetime.fromisoformat(seq["started"]), int(seq["position"])))
    assert placed, f"no placement of run {run_id} in the agent's scheduling history"
    return min(placed)


@pytest.mark.timeout(400)
def test_preemption_frees_the_gpu_and_the_preempted_run_completes_later(prefect_server, tmp_path, unique_name):
    q = apply_queue(tmp_path, {"name": f"pre-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                               "preempt_grace": "3s"})
    job = deploy_probe(q, f"pre-{unique_name}")
    rec = tmp_path / "rec"
    with agent([q], f"pre-{unique_name}", "cpu=2,memory=4Gi,gpu=1", tmp_path):
        # the sweep's first life lasts until released (once the regular run has taken its GPU), 120 s at most;
        # its second life, which starts after that, ends at once
        release = tmp_path / "release"
        sweep = _submit(job, "--preemptible", seconds=120, tmp=rec, release=release)
        wait_running(sweep)
        other_sweep = _submit(job, "--preemptible", seconds=1, tmp=rec)  # never preempts a preemptible run
        time.sleep(5)
        assert not any("preempted" in (s.message or "") for s in _states(sweep))
        regular = _submit(job, seconds=1, tmp=rec)
        _until(lambda: _running_times(regular), 120)
        release.touch()
        runs = {str(r.id): r for r in wait_final([sweep, other_sweep, regular], timeout=300)}
    assert all(r.state_name == "Completed" for r in runs.values()), {k: r.state_name for k, r in runs.items()}
    hist = _states(sweep)
    back = [s for s in hist if s.type.value == "SCHEDULED" and "preempted by" in (s.message or "")]
    assert len(back) == 1, [(s.name, s.message) for s in hist]  # preempted once, not twice
    assert runs[regular].name in back[0].message
    # it kept its submit time: the Scheduled state it went back to is scheduled at its original start
    assert abs(back[0].state_details.scheduled_time.timestamp() - runs[sweep].expected_start_time.timestamp()) < 1
    # the GPU was never shared: the regular run ran between the sweep's two lives, which each ran once
    sweep_runs = _running_times(sweep)
    assert len(sweep_runs) == 2
    reg_start = _running_times(regular)[0]
    reg_end = runs[regular].end_time.timestamp()
    assert back[0].timestamp.timestamp() <= reg_start and reg_end <= sweep_runs[1]
    # the regular run did not wait behind the sweep (alive until the regular run ran): about the grace period
    created = runs[regular].created.timestamp()
    assert reg_start - created < 20, reg_start - created
    # the other sweep ran after the regular run (regular before preemptible), and completed
    assert _running_times(other_sweep)[0] >= reg_start
    assert (rec / f"{sweep}.json").exists()  # its second life completed the job
    # one Prefect executor context served every run of the worker, a preempted life among them
    # (backends/executor_context.py): the runs' control channel is one listener, not one per run
    ports = {json.loads((rec / f"{r}.json").read_text())["control_port"] for r in (sweep, other_sweep, regular)}
    assert len(ports) == 1 and None not in ports, ports


@pytest.mark.timeout(400)
def test_one_priority_order_across_queues_and_owner_quota(prefect_server, tmp_path, unique_name):
    qa = apply_queue(tmp_path, {"name": f"pa-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1"})
    qb = apply_queue(tmp_path, {"name": f"pb-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                                "owner_quota": {"gpu": 1}})
    ja, jb = deploy_probe(qa, f"pa-{unique_name}"), deploy_probe(qb, f"pb-{unique_name}")
    rec = tmp_path / "rec"
    with agent([qa, qb], f"prio-{unique_name}", "cpu=2,memory=4Gi,gpu=1", tmp_path):
        hold = tmp_path / "release-holder"  # the holder keeps the GPU until the agent has seen both waiting
        holder = _submit(ja, seconds=60, tmp=rec, release=hold)
        wait_running(holder)
        low = _submit(ja, "--priority", "low", seconds=1, tmp=rec)  # submitted first, on queue A
        time.sleep(1)
        critical = _submit(jb, "--priority", "critical", seconds=1, tmp=rec)  # later, on queue B
        _until(lambda: _labelled([low, critical], WAIT_LABEL), 60)
        hold.touch()
        wait_final([holder, low, critical], timeout=200)
        assert _placed_times(critical)[0] < _placed_times(low)[0]
    # owner quota on queue B (1 GPU per owner): alice's two runs never overlap though the agent has 2 GPUs
    with agent([qb], f"quota-{unique_name}", "cpu=4,memory=4Gi,gpu=2", tmp_path, log_name="quota.log"):
        # each runs until released (once bob's run is placed and alice's second waits), 60 s at most
        quota = tmp_path / "release-quota"
        a1 = _submit(jb, "--owner", "alice", seconds=60, tmp=rec, release=quota)
        a2 = _submit(jb, "--owner", "alice", seconds=60, tmp=rec, release=quota)
        b1 = _submit(jb, "--owner", "bob", seconds=60, tmp=rec, release=quota)
        _until(lambda: _placed_count([b1]) == 1 and _placed_count([a1, a2]) == 1
               and any((r.labels or {}).get(WAIT_LABEL) for r in read_runs([a1, a2])), 60)
        quota.touch()
        runs_q = wait_final([a1, a2, b1], timeout=200)
    ends = {str(r.id): r.end_time.timestamp() for r in runs_q}
    starts = {rid: _placed_times(rid)[0] for rid in (a1, a2, b1)}  # placement, not engine start-up
    first, second = sorted([a1, a2], key=lambda r: starts[r])
    assert starts[second] >= ends[first] - 0.5  # alice held at most one GPU at a time
    assert starts[b1] < ends[first]  # bob was not held up by alice's quota


@pytest.mark.timeout(300)
def test_owner_quota_holds_across_the_queues_agents(prefect_server, tmp_path, unique_name):
    """Two agents serve one queue with a 1-GPU owner quota: alice's second run waits for her first, on
    either agent, though both have GPUs free; bob's run is not held up. Truth: the runs' own states."""
    from prefect import get_client

    q = apply_queue(tmp_path, {"name": f"qx-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                               "owner_quota": {"gpu": 1}})
    job = deploy_probe(q, f"qx-{unique_name}")
    rec = tmp_path / "rec"
    with agent([q], f"qx1-{unique_name}", "cpu=2,memory=4Gi,gpu=2", tmp_path):
        # holds its GPU until released, once `queue ls` has been read below, after the second agent started
        # and a2's label was written (each takes seconds on a loaded 2-core CI box); 120 s at most
        release = tmp_path / "release"
        a1 = _submit(job, "--owner", "alice", seconds=120, tmp=rec, release=release)
        wait_running(a1)
        _until(lambda: _labelled([a1], ALLOC_LABEL), 15)  # a1's placement label (a moment after its start)
        with agent([q], f"qx2-{unique_name}", "cpu=2,memory=4Gi,gpu=2", tmp_path):
            a2 = _submit(job, "--owner", "alice", seconds=1, tmp=rec)
            b1 = _submit(job, "--owner", "bob", seconds=1, tmp=rec)
            deadline = time.time() + 60
            reason = ""
            while time.time() < deadline and "at its quota" not in reason:
                with get_client(sync_client=True) as client:
                    reason = (client.read_flow_run(a2).labels or {}).get(WAIT_LABEL, "")
                time.sleep(0.5)
            [listed] = cli_json("queue", "ls", q)  # what the user reads: the policy and who holds what
            _until(lambda: _placed_count([b1]) == 1, 60)  # bob's run was placed while a1 ran (checked below)
            release.touch()
            runs = {str(r.id): r for r in wait_final([a1, a2, b1], timeout=200)}
    assert "owner alice is at its quota" in reason, reason
    assert listed["sharing"] == "owner quota gpu=1"
    alice = next(o for o in listed["owners"] if o["owner"] == "alice")
    assert alice["runs"] == 1 and alice["held"]["gpu"] == 1 and alice["at_quota"] is True, listed["owners"]
    assert all(r.state.is_completed() for r in runs.values())
    a1_end = runs[a1].end_time.timestamp()
    assert _placed_times(a2)[0] >= a1_end - 0.5, "alice held two GPUs at once across the two agents"
    assert _placed_times(b1)[0] < a1_end, "bob waited for alice's quota"


@pytest.mark.timeout(300)
def test_fair_share_lets_a_second_owner_past_a_flooding_one(prefect_server, tmp_path, unique_name):
    """Two GPUs, fair share on: alice floods the queue with 4 runs, then bob submits one. Bob's run is
    placed with alice's first, in the first cycle (once she holds half the GPUs, bob's share of 0 is
    smaller), not after all of hers; without fair share the same submissions run in submit order. Truth: the
    agent's placement decisions (the cycle, then the position in its plan), not the Pending times, which come in
    any order among the runs placed in one cycle."""
    orders = {}
    for fair in (True, False):
        tag = "fs" if fair else "ff"
        q = apply_queue(tmp_path, {"name": f"{tag}-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                                   "fair_share": fair})
        job = deploy_probe(q, f"{tag}-{unique_name}")
        rec = tmp_path / f"rec-{tag}"
        # the first pair placed holds both GPUs until the agent has placed it (then every run ends at once:
        # the later placements follow the GPUs freed, as before)
        release = tmp_path / f"release-{tag}"
        alice = [_submit(job, "--owner", "alice", seconds=30, tmp=rec, release=release) for _ in range(4)]
        bob = _submit(job, "--owner", "bob", seconds=30, tmp=rec, release=release)
        with agent([q], f"{tag}-{unique_name}", "cpu=2,memory=4Gi,gpu=2", tmp_path):
            _until(lambda: _placed_count([*alice, bob]) >= 2, 120)
            release.touch()
            wait_final([*alice, bob], timeout=240)
        placed = {rid: _placement(rid) for rid in [*alice, bob]}  # the agent has stopped: its history is stored
        orders[fair] = sorted(placed, key=placed.get).index(bob) + 1  # bob's place in the start order
    assert orders[True] <= 2, orders  # in the first pair placed, beside alice's first run (same cycle)
    assert orders[False] == 5, orders  # submit order: behind all of alice's
