"""Issue 12 on a real server and agent: preemptible runs give their GPU back to a regular run and
come back later; one priority order across an agent's queues; owner quotas.

Ground truth is the runs' own state histories (Running / Scheduled timestamps and messages)."""

from __future__ import annotations

import time

import pytest

from launch_helpers import agent, apply_queue, cli_json, deploy_probe, wait_final, wait_running

GPU_PRESETS = {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}}


def _states(run_id: str) -> list:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)


def _submit(job: str, *extra: str, seconds: float = 1.0, tmp=None) -> str:
    args = ["submit", job, "--param", f"record_dir={tmp}", "--param", f"seconds={seconds}", *extra]
    return cli_json(*args)["run_ids"][0]


def _running_times(run_id: str) -> list[float]:
    return [s.timestamp.timestamp() for s in _states(run_id) if s.type.value == "RUNNING"]


def _placed_times(run_id: str) -> list[float]:
    """When the agent placed the run (Scheduled -> Pending): the decision itself, before the engine's
    start-up, which on a loaded box can take longer than a short run lasts."""
    return [s.timestamp.timestamp() for s in _states(run_id) if s.type.value == "PENDING"]


@pytest.mark.timeout(400)
def test_preemption_frees_the_gpu_and_the_preempted_run_completes_later(prefect_server, tmp_path, unique_name):
    q = apply_queue(tmp_path, {"name": f"pre-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                               "preempt_grace": "3s"})
    job = deploy_probe(q, f"pre-{unique_name}")
    rec = tmp_path / "rec"
    with agent([q], f"pre-{unique_name}", "cpu=2,memory=4Gi,gpu=1", tmp_path):
        sweep = _submit(job, "--preemptible", seconds=25, tmp=rec)
        wait_running(sweep)
        other_sweep = _submit(job, "--preemptible", seconds=1, tmp=rec)  # never preempts a preemptible run
        time.sleep(5)
        assert not any("preempted" in (s.message or "") for s in _states(sweep))
        regular = _submit(job, seconds=1, tmp=rec)
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
    # the regular run did not wait behind the 25-s sweep: about the grace period, not the sweep's length
    created = runs[regular].created.timestamp()
    assert reg_start - created < 20, reg_start - created
    # the other sweep ran after the regular run (regular before preemptible), and completed
    assert _running_times(other_sweep)[0] >= reg_start
    assert (rec / f"{sweep}.json").exists()  # its second life completed the job


@pytest.mark.timeout(400)
def test_one_priority_order_across_queues_and_owner_quota(prefect_server, tmp_path, unique_name):
    qa = apply_queue(tmp_path, {"name": f"pa-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1"})
    qb = apply_queue(tmp_path, {"name": f"pb-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                                "owner_quota": {"gpu": 1}})
    ja, jb = deploy_probe(qa, f"pa-{unique_name}"), deploy_probe(qb, f"pb-{unique_name}")
    rec = tmp_path / "rec"
    with agent([qa, qb], f"prio-{unique_name}", "cpu=2,memory=4Gi,gpu=1", tmp_path):
        holder = _submit(ja, seconds=8, tmp=rec)
        wait_running(holder)
        low = _submit(ja, "--priority", "low", seconds=1, tmp=rec)  # submitted first, on queue A
        time.sleep(1)
        critical = _submit(jb, "--priority", "critical", seconds=1, tmp=rec)  # later, on queue B
        wait_final([holder, low, critical], timeout=200)
        assert _placed_times(critical)[0] < _placed_times(low)[0]
    # owner quota on queue B (1 GPU per owner): alice's two runs never overlap though the agent has 2 GPUs
    with agent([qb], f"quota-{unique_name}", "cpu=4,memory=4Gi,gpu=2", tmp_path, log_name="quota.log"):
        a1 = _submit(jb, "--owner", "alice", seconds=4, tmp=rec)
        a2 = _submit(jb, "--owner", "alice", seconds=4, tmp=rec)
        b1 = _submit(jb, "--owner", "bob", seconds=4, tmp=rec)
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

    from prefect_launch.workers.run_tags import WAIT_LABEL

    q = apply_queue(tmp_path, {"name": f"qx-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                               "owner_quota": {"gpu": 1}})
    job = deploy_probe(q, f"qx-{unique_name}")
    rec = tmp_path / "rec"
    with agent([q], f"qx1-{unique_name}", "cpu=2,memory=4Gi,gpu=2", tmp_path):
        # long enough to still hold its GPU when `queue ls` is read below, after the second agent started
        # and a2's label was written (each takes seconds on a loaded 2-core CI box)
        a1 = _submit(job, "--owner", "alice", seconds=30, tmp=rec)
        wait_running(a1)
        time.sleep(1.5)  # a1's placement label is on the run (written a moment after its start)
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
    smaller), not after all of hers; without fair share the same submissions run in submit order. Truth: the runs'
    Pending times."""
    orders = {}
    for fair in (True, False):
        tag = "fs" if fair else "ff"
        q = apply_queue(tmp_path, {"name": f"{tag}-{unique_name}", "presets": GPU_PRESETS, "default_preset": "g1",
                                   "fair_share": fair})
        job = deploy_probe(q, f"{tag}-{unique_name}")
        rec = tmp_path / f"rec-{tag}"
        alice = [_submit(job, "--owner", "alice", seconds=2, tmp=rec) for _ in range(4)]
        bob = _submit(job, "--owner", "bob", seconds=2, tmp=rec)
        with agent([q], f"{tag}-{unique_name}", "cpu=2,memory=4Gi,gpu=2", tmp_path):
            wait_final([*alice, bob], timeout=240)
        placed = {rid: _placed_times(rid)[0] for rid in [*alice, bob]}
        orders[fair] = sorted(placed, key=placed.get).index(bob) + 1  # bob's place in the start order
    assert orders[True] <= 2, orders  # in the first pair placed, beside alice's first run (same cycle)
    assert orders[False] == 5, orders  # submit order: behind all of alice's
