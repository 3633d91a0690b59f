"""Pure functions: sizes, preset resolution, placement, the ledger, templates. No server."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.placement import Candidate, plan
from prefect_launch.workers.scheduling.queue_spec import QueueSpec
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources, format_size, parse_capacity, parse_size
from prefect_launch.workers.scheduling.template import build_base_job_template

GI = 1024**3

SPEC = QueueSpec.model_validate({
    "name": "q",
    "presets": {"small": {"cpu": 1, "memory": "1Gi"}, "gpu": {"cpu": 2, "memory": "4Gi", "gpu": 1, "shm_size": "1Gi"}},
    "default_preset": "small",
    "bounds": {"cpu": {"min": 0.5, "max": 8}, "gpu": {"max": 2}, "memory": {"max": "16Gi"}},
})


@pytest.mark.parametrize("text,expected", [("512Mi", 512 * 1024**2), ("4Gi", 4 * GI), ("1G", 10**9), ("1500", 1500),
                                           ("1.5Gi", int(1.5 * GI))])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage_and_format_roundtrip():
    with pytest.raises(LaunchValidationError, match="malformed"):
        parse_size("four gigs")
    assert format_size(4 * GI) == "4Gi" and format_size(1536 * 1024**2) == "1.5Gi"


def test_capacity_parsing():
    assert parse_capacity("cpu=8,memory=32Gi,gpu=2") == {"cpu": 8.0, "memory": 32 * GI, "gpu": 2}
    with pytest.raises(LaunchValidationError, match="unknown capacity key"):
        parse_capacity("tpu=1")


def test_resolution_layers_run_over_deployment_over_queue():
    assert resolve_request(SPEC).resources == Resources(cpu=1, memory=GI, gpu=0)
    r = resolve_request(SPEC, {"preset": "gpu", "cpu": 4}, {})
    assert (r.preset, r.resources.cpu, r.resources.gpu) == ("gpu", 4, 1)
    # a run-level preset replaces the deployment's choice, explicit run values overlay it
    r = resolve_request(SPEC, {"preset": "gpu", "cpu": 4}, {"preset": "small", "memory": "2Gi"})
    assert (r.preset, r.resources.cpu, r.resources.memory, r.resources.gpu) == ("small", 1, 2 * GI, 0)
    assert resolve_request(SPEC, {}, {"agent": "w2"}).agent == "w2"


def test_resolution_errors_say_what_to_change():
    with pytest.raises(LaunchValidationError, match="choose one of: gpu, small"):
        resolve_request(SPEC, {}, {"preset": "nope"})
    with pytest.raises(LaunchValidationError, match="gpu=3 is above the queue maximum 2"):
        resolve_request(SPEC, {}, {"gpu": 3})
    with pytest.raises(LaunchValidationError, match="shm_size"):
        resolve_request(SPEC, {}, {"shm_size": "2Gi"})


def test_queue_spec_rejects_preset_outside_bounds():
    with pytest.raises(ValueError, match="preset 'big' is out of bounds"):
        QueueSpec.model_validate({"name": "x", "presets": {"big": {"cpu": 64}}, "default_preset": "big",
                                  "bounds": {"cpu": {"max": 8}}})


def _cand(i: int, gpu: int, prio: int = 3, agent: str | None = None) -> Candidate:
    t0 = datetime(2026, 1, 1)
    return Candidate(run_id=f"r{i}", name=f"r{i}", priority_rank=prio, submitted=t0 + timedelta(seconds=i),
                     request=ResolvedRequest(preset="p", resources=Resources(cpu=1, memory=GI, gpu=gpu), agent=agent))


def _owned(i: int, owner: str, gpu: int = 1, prio: int = 3, pre: bool = False) -> Candidate:
    c = _cand(i, gpu, prio)
    return c.model_copy(update={"owner": owner, "request": c.request.model_copy(update={"preemptible": pre})})


TOTAL = Resources(cpu=4, memory=8 * GI, gpu=2)


def test_strict_fifo_head_blocks_and_explains():
    free = Resources(cpu=4, memory=8 * GI, gpu=1)
    d = {x.run_id: x for x in plan([_cand(1, 2), _cand(2, 1)], free, TOTAL, "w1")}
    assert d["r1"].action == "wait" and d["r1"].reason == "waiting: needs gpu=2, agent w1 has 1 free"
    assert d["r2"].action == "wait" and "queued behind r1" in d["r2"].reason


def test_deep_fifo_reasons_do_not_change_with_the_head():
    from prefect_launch.workers.scheduling.placement import FIFO_NAMED

    free = Resources(cpu=4, memory=8 * GI, gpu=0)
    runs = [_cand(i, 1) for i in range(1, 20)]
    first = {x.run_id: x.reason for x in plan(runs, free, TOTAL, "w1")}
    later = {x.run_id: x.reason for x in plan(runs[1:], free, TOTAL, "w1")}  # r1 started: r2 is the head now
    assert first["r2"] == "waiting: queued behind r1 (FIFO)"
    assert later["r3"] == "waiting: queued behind r2 (FIFO)"
    deep = f"r{FIFO_NAMED + 3}"  # behind the named ones in both plans
    assert first[deep] == later[deep] == "waiting: queued behind earlier runs (FIFO)"
    changed = [r for r in later if later[r] != first[r]]
    assert len(changed) <= FIFO_NAMED + 1  # a new head re-labels a handful of runs, not the whole queue


def test_a_waiting_label_is_written_only_when_no_agent_wrote_it_yet():
    from types import SimpleNamespace

    from prefect_launch.workers.scheduling.wait_notes import WaitNotes
    from prefect_launch.workers.agent.tags import WAIT_LABEL

    notes = WaitNotes()
    fresh = SimpleNamespace(id="r1", labels={})
    assert notes.changed(fresh, "waiting: x") is True
    assert notes.changed(fresh, "waiting: x") is False  # this agent wrote it already
    by_other = SimpleNamespace(id="r2", labels={WAIT_LABEL: "waiting: y"})
    assert WaitNotes().changed(by_other, "waiting: y") is False  # another agent of the queue wrote the same
    assert notes.changed(SimpleNamespace(id="r1", labels={WAIT_LABEL: "waiting: x"}), "waiting: z") is True


def test_agents_of_one_queue_do_not_overwrite_each_others_waiting_labels_every_cycle():
    """Three agents explain the same waiting run each from its own side ("agent wN has 1 free"): a label
    another agent wrote stands for hold_s before this agent writes its own words; its own earlier words it
    replaces at once (one agent's label follows its decisions as before)."""
    from types import SimpleNamespace

    from prefect_launch.workers.scheduling.wait_notes import WaitNotes
    from prefect_launch.workers.agent.tags import WAIT_LABEL

    now = [100.0]
    notes = WaitNotes(hold_s=10, clock=lambda: now[0])
    by_w2 = SimpleNamespace(id="r1", labels={WAIT_LABEL: "waiting: needs gpu=2, agent w2 has 1 free"})
    mine = "waiting: needs gpu=2, agent w1 has 0 free"
    assert notes.changed(by_w2, mine) is False  # w2's words are fresh
    now[0] += 9
    assert notes.changed(by_w2, mine) is False
    now[0] += 1.5
    assert notes.changed(by_w2, mine) is True  # stood 10.5 s: w1 writes its own
    ours = SimpleNamespace(id="r1", labels={WAIT_LABEL: mine})
    assert notes.changed(ours, mine) is False
    assert notes.changed(ours, "waiting: queued behind r0 (FIFO)") is True  # its own words: changed at once
    # w3 overwrites: the hold starts again from when w1 first reads w3's words
    by_w3 = SimpleNamespace(id="r1", labels={WAIT_LABEL: "waiting: needs gpu=2, agent w3 has 1 free"})
    now[0] += 30
    assert notes.changed(by_w3, mine) is False
    now[0] += 10
    assert notes.changed(by_w3, mine) is True
    # a label cleared (the run was placed and came back) is written at once
    assert notes.changed(SimpleNamespace(id="r2", labels={WAIT_LABEL: ""}), "waiting: x") is True


def test_an_agents_own_waiting_label_moves_at_once_in_kind_and_once_per_hold_in_details():
    """A new FIFO head or a new free amount does not re-label the run every cycle (one agent, runs starting
    every second); FIFO -> short of capacity -> quota is written at once."""
    from types import SimpleNamespace

    from prefect_launch.workers.scheduling.wait_notes import WaitNotes, reason_kind
    from prefect_launch.workers.agent.tags import WAIT_LABEL

    assert reason_kind("waiting: queued behind r1 (FIFO)") == reason_kind("waiting: queued behind earlier runs (FIFO)")
    assert reason_kind("waiting: needs gpu=1, agent w1 has 0 free") == reason_kind("waiting: needs cpu=1, agent w1 has 0.5 free")
    now = [0.0]
    notes = WaitNotes(hold_s=10, clock=lambda: now[0])

    def run(label):
        return SimpleNamespace(id="r", labels={WAIT_LABEL: label} if label else {})

    assert notes.changed(run(None), "waiting: queued behind r1 (FIFO)")
    now[0] += 2
    assert not notes.changed(run("waiting: queued behind r1 (FIFO)"), "waiting: queued behind r2 (FIFO)")
    assert notes.changed(run("waiting: queued behind r1 (FIFO)"), "waiting: needs gpu=1, agent w1 has 0 free")
    now[0] += 2
    assert not notes.changed(run("waiting: needs gpu=1, agent w1 has 0 free"), "waiting: needs gpu=1, agent w1 has 0.5 free")
    assert notes.changed(run("waiting: needs gpu=1, agent w1 has 0 free"), "waiting: owner alice is at its quota")
    now[0] += 2
    assert notes.changed(run("waiting: owner alice is at its quota"), "waiting: needs gpu=1, agent w1 has 0 free")
    now[0] += 10.5
    assert notes.changed(run("waiting: needs gpu=1, agent w1 has 0 free"), "waiting: needs gpu=1, agent w1 has 1 free")


def test_waiting_label_writes_per_cycle_are_budgeted_front_first():
    from types import SimpleNamespace

    from prefect_launch.workers.scheduling.wait_notes import WaitNotes

    notes = WaitNotes(budget=3)
    runs = [SimpleNamespace(id=f"r{i}", labels={}) for i in range(5)]
    notes.new_cycle([r.id for r in runs])
    assert [notes.changed(r, "waiting: queued behind earlier runs (FIFO)") for r in runs] == [True] * 3 + [False] * 2
    notes.new_cycle([r.id for r in runs])  # the next cycle writes the rest (the first three read as written)
    written = [SimpleNamespace(id=r.id, labels={"launch.waiting": "waiting: queued behind earlier runs (FIFO)"})
               for r in runs[:3]] + runs[3:]
    assert [notes.changed(r, "waiting: queued behind earlier runs (FIFO)") for r in written] == [False] * 3 + [True] * 2
    # runs no longer planned are forgotten
    notes.new_cycle(["r4"])
    assert set(notes._written) == {"r4"} and set(notes._seen) == {"r4"}
    # without cycles (the Kubernetes agent's pod reasons) there is no budget
    free = WaitNotes(budget=0)
    assert free.changed(SimpleNamespace(id="x", labels={}), "waiting: y") is True


@pytest.mark.parametrize("runs,kw,actions", [
    pytest.param([_cand(1, 2), _cand(2, 1), _cand(3, 1)], {"backfill": True}, {"r1": "wait", "r2": "start", "r3": "wait"},
                 id="backfill-lets-smaller-runs-pass"),
    pytest.param([_cand(1, 1, prio=3), _cand(2, 1, prio=1)], {}, {"r2": "start", "r1": "wait"},
                 id="priority-then-submit-time"),
    pytest.param([_owned(1, "a", pre=True), _owned(2, "b")], {}, {"r2": "start", "r1": "wait"},
                 id="regular-runs-go-before-preemptible-ones-of-the-same-level"),
])
def test_who_gets_the_one_free_gpu(runs, kw, actions):
    free = Resources(cpu=4, memory=8 * GI, gpu=1)
    assert {x.run_id: x.action for x in plan(runs, free, TOTAL, "w1", **kw)} == actions


def test_runs_this_agent_can_never_take_do_not_block():
    d = {x.run_id: x for x in plan([_cand(1, 4), _cand(2, 1, agent="w9"), _cand(3, 1)], TOTAL, TOTAL, "w1")}
    assert d["r1"].action == "skip" and "gpu=4, agent w1 has 2 in total" in d["r1"].reason
    assert d["r2"].action == "skip" and "pinned to agent w9" in d["r2"].reason
    assert d["r3"].action == "start"


def test_placement_never_oversubscribes_within_a_round():
    d = [x.action for x in plan([_cand(i, 1) for i in range(5)], TOTAL, TOTAL, "w1", backfill=True)]
    assert d.count("start") == 2


def test_ledger_gives_disjoint_gpus_and_releases_idempotently():
    ledger = Ledger(TOTAL)
    a = ledger.try_allocate("a", Resources(cpu=1, memory=GI, gpu=1))
    b = ledger.try_allocate("b", Resources(cpu=1, memory=GI, gpu=1))
    assert a and b and set(a.gpu_indices).isdisjoint(b.gpu_indices)
    assert ledger.try_allocate("c", Resources(cpu=1, memory=GI, gpu=1)) is None
    assert ledger.release("a") is not None and ledger.release("a") is None
    c = ledger.try_allocate("c", Resources(cpu=1, memory=GI, gpu=1))
    assert c.gpu_indices == a.gpu_indices
    assert ledger.free() == Resources(cpu=2, memory=6 * GI, gpu=0)
    assert set(b.cpu_cores).isdisjoint(c.cpu_cores)


def test_template_carries_presets_bounds_and_spec():
    t = build_base_job_template(SPEC)
    props = t["variables"]["properties"]
    assert props["preset"]["enum"] == ["gpu", "small"] and props["preset"]["default"] == "small"
    assert props["gpu"]["maximum"] == 2 and props["cpu"]["maximum"] == 8
    assert t["job_configuration"]["gpu"] == "{{ gpu }}"
    assert QueueSpec.model_validate(t["job_configuration"]["launch"]) == SPEC


def test_cli_params_decode_against_the_job_schema():
    from prefect_launch.deployments.submit import _coerce_to_schema, parse_params

    schema = {"properties": {"note": {"type": "string"}, "epochs": {"type": "integer"},
                             "tag": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "xs": {"type": "array"}}}
    raw = parse_params(["note=750e50", "epochs=3", "tag=123", "xs=[1,2]"])
    assert _coerce_to_schema(raw, schema) == {"note": "750e50", "epochs": 3, "tag": "123", "xs": [1, 2]}


def test_one_priority_order_across_an_agents_queues():
    """A low run of this queue never takes the last GPU a critical run of another queue waits for."""
    free = Resources(cpu=4, memory=8 * GI, gpu=1)
    low = _cand(1, 1, prio=4)  # submitted first, but low priority
    critical = _cand(2, 1, prio=1).model_copy(update={"name": "r2 (queue other)"})
    d = {x.run_id: x for x in plan([low], free, TOTAL, "w1", foreign=[critical])}
    assert set(d) == {"r1"}  # no decision for the other queue's run: its own queue starts it
    assert d["r1"].action == "wait" and "r2 (queue other)" in d["r1"].reason
    # the other way round: the foreign run is the lower one, ours starts
    d = {x.run_id: x.action for x in plan([_cand(3, 1, prio=1)], free, TOTAL, "w1", foreign=[_cand(4, 1, prio=4)])}
    assert d == {"r3": "start"}
    # room for both: both go (the foreign one keeps its share, ours takes the rest)
    d = {x.run_id: x.action for x in plan([low], TOTAL, TOTAL, "w1", foreign=[critical])}
    assert d == {"r1": "start"}
    # a foreign head that does not fit blocks lower runs under FIFO, not under backfill
    big = _cand(5, 2, prio=1).model_copy(update={"name": "big"})
    assert plan([low], free, TOTAL, "w1", foreign=[big])[0].reason == "waiting: queued behind big (FIFO)"
    assert plan([low], free, TOTAL, "w1", backfill=True, foreign=[big])[0].action == "start"


def test_quota_makes_an_owner_wait_without_holding_the_queue():
    from prefect_launch.workers.scheduling.fair_share import Quota
    from prefect_launch.workers.scheduling.placement import Quotas

    q = Quotas(default=Quota(gpu=1), held={"alice": Resources(gpu=1)})
    d = {x.run_id: x for x in plan([_owned(1, "alice"), _owned(2, "bob")], TOTAL, TOTAL, "w1", quotas=q)}
    assert d["r1"].action == "wait" and "owner alice is at its quota" in d["r1"].reason
    assert d["r2"].action == "start"  # FIFO is not held by a run over its owner's quota
    # a run started in this round counts against the quota of the next one
    d = [x.action for x in plan([_owned(1, "bob"), _owned(2, "bob")], TOTAL, TOTAL, "w1", quotas=Quotas(default=Quota(gpu=1)))]
    assert d == ["start", "wait"]


def test_fair_share_interleaves_owners_in_a_priority_level():
    from prefect_launch.workers.scheduling.placement import FairShare

    flood = [_owned(i, "alice") for i in range(4)] + [_owned(10, "bob")]  # bob submitted last
    fair = FairShare(capacity=TOTAL, held={"alice": Resources(gpu=1)})
    free = Resources(cpu=4, memory=8 * GI, gpu=1)
    d = {x.run_id: x.action for x in plan(flood, free, TOTAL, "w1", backfill=True, fair=fair)}
    assert d["r10"] == "start" and all(d[f"r{i}"] == "wait" for i in range(4))
    d = {x.run_id: x.action for x in plan(flood, free, TOTAL, "w1", backfill=True)}
    assert d["r0"] == "start" and d["r10"] == "wait"  # without fair share: FIFO, alice first


def test_each_waiting_runs_reason_has_one_writer_among_the_queues_agents():
    """Rendezvous hashing: every agent names the same writer whatever order it read the agents in, the runs
    spread over the agents, and an agent leaving moves only its own runs to another writer."""
    from prefect_launch.workers.scheduling.wait_notes import reason_writer

    agents = ["host0", "host1", "host2", "host3"]
    runs = [f"run-{i}" for i in range(400)]
    writers = {r: reason_writer(r, agents) for r in runs}
    assert all(reason_writer(r, list(reversed(agents))) == writers[r] for r in runs)
    counts = {a: sum(w == a for w in writers.values()) for a in agents}
    assert all(60 <= n <= 140 for n in counts.values()), counts  # ~100 each
    after = {r: reason_writer(r, ["host0", "host1", "host3"]) for r in runs}
    moved = {r for r in runs if after[r] != writers[r]}
    assert moved == {r for r in runs if writers[r] == "host2"}
    assert reason_writer("r", []) is None and reason_writer("r", ["solo"]) == "solo"


def test_an_agent_that_is_not_a_runs_writer_only_fills_a_label_left_empty():
    """Not the writer: nothing over another agent's words however old, nothing over a fresh empty label;
    an empty label left for orphan_s (3 x hold_s: its writer gone) is filled. The writer keeps the rules above."""
    from types import SimpleNamespace

    from prefect_launch.workers.agent.tags import WAIT_LABEL
    from prefect_launch.workers.scheduling.wait_notes import WaitNotes

    now = [0.0]
    notes = WaitNotes(hold_s=10, clock=lambda: now[0])
    assert notes.orphan_s == 30
    empty = SimpleNamespace(id="r1", labels={})
    assert notes.changed(empty, "waiting: queued behind r0 (FIFO)", writer=False) is False
    now[0] += 29
    assert notes.changed(empty, "waiting: queued behind r0 (FIFO)", writer=False) is False
    now[0] += 2
    assert notes.changed(empty, "waiting: queued behind r0 (FIFO)", writer=False) is True
    worded = SimpleNamespace(id="r2", labels={WAIT_LABEL: "waiting: needs gpu=2, agent w2 has 1 free"})
    assert notes.changed(worded, "waiting: needs gpu=2, agent w1 has 0 free", writer=False) is False
    now[0] += 300
    assert notes.changed(worded, "waiting: needs gpu=2, agent w1 has 0 free", writer=False) is False
    writer = WaitNotes(hold_s=10, clock=lambda: now[0])
    assert writer.changed(SimpleNamespace(id="r3", labels={}), "waiting: x", writer=True) is True
