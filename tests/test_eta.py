"""Start-time prediction, pure parts: overheads, claimed runs, job shapes, learning from past runs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from prefect_launch.deployments.eta import (AgentCap, Overhead, PastRun, Running, Waiting, expected_runtime,
                                            job_shape, learn_overhead, predict)
from prefect_launch.workers.scheduling.resources import Resources

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
ONE = Resources(cpu=1, memory=2**30)


def at(s: float) -> datetime:
    return NOW + timedelta(seconds=s)


def agents(n: int = 1, cpu: int = 1) -> list[AgentCap]:
    return [AgentCap(name=f"a{k}", queues=["q"], capacity=Resources(cpu=cpu, memory=8 * 2**30)) for k in range(n)]


def test_overheads_stretch_every_hold_and_delay_every_start():
    oh = {"q": Overhead(claim_s=1, start_s=2, release_s=3)}
    running = [Running(run_id="r", agent="a0", queue="q", resources=ONE, started=at(-10), expected_s=30)]
    waiting = [Waiting(run_id="w1", queue="q", resources=ONE, submitted=at(0), expected_s=10),
               Waiting(run_id="w2", queue="q", resources=ONE, submitted=at(1), expected_s=10)]
    got = predict(NOW, agents(), running, waiting, overhead=oh)
    # r holds until -10 + 30 + 3 (release) = 23; w1 claimed then, starts 2 s later
    assert got["w1"] == at(25)
    # w1 holds 25 + 10 + 3 = 38; w2 claimed at 38, starts at 40
    assert got["w2"] == at(40)
    assert got["r"] == at(-10), "a running run's prediction is its start"
    # without overheads: the old replay (capacity back at the end of the run time)
    plain = predict(NOW, agents(), running, waiting)
    assert plain["w1"] == at(20) and plain["w2"] == at(30)


def test_room_now_means_the_next_poll_then_the_start_overhead():
    got = predict(NOW, agents(), [], [Waiting(run_id="w", queue="q", resources=ONE, submitted=NOW, expected_s=5)],
                  overhead={"q": Overhead(claim_s=1.5, start_s=2)})
    assert got["w"] == at(3.5)


def test_a_pending_run_is_placed_and_predicted_from_its_claim():
    oh = {"q": Overhead(start_s=4, release_s=1)}
    pend = Running(run_id="p", agent="a0", queue="q", resources=ONE, claimed=at(-1), expected_s=10)
    late = Running(run_id="p2", agent="a1", queue="q", resources=ONE, claimed=at(-9), expected_s=10)
    waiting = [Waiting(run_id="w", queue="q", resources=ONE, submitted=at(0), expected_s=10)]
    got = predict(NOW, agents(2), [pend, late], waiting, overhead=oh)
    assert got["p"] == at(3), "claimed a second ago: starts after the start overhead"
    assert got["p2"] == NOW, "claimed long ago: starts now"
    # p2 holds from now: 0 + 10 + 1 = 11; p: 3 + 10 + 1 = 14 -> w claimed at 11, starts at 15
    assert got["w"] == at(15)


def test_a_claimed_run_with_no_known_agent_still_holds_capacity():
    unknown = Running(run_id="u", agent=None, queue="q", resources=ONE, started=at(-1), expected_s=20)
    got = predict(NOW, agents(2), [unknown], [
        Waiting(run_id="w1", queue="q", resources=ONE, submitted=at(0), expected_s=5),
        Waiting(run_id="w2", queue="q", resources=ONE, submitted=at(1), expected_s=5)])
    assert got["w1"] == NOW and got["w2"] == at(5), "one of the two agents is taken by the unplaced run"


def test_no_prediction_behind_an_end_that_cannot_be_estimated():
    oh = {"q": Overhead(claim_s=1, start_s=2, release_s=3)}
    stuck = Running(run_id="r", agent="a0", queue="q", resources=ONE, started=at(-5), expected_s=None)
    waiting = [Waiting(run_id="w1", queue="q", resources=ONE, submitted=at(0), expected_s=10),
               Waiting(run_id="w2", queue="q", resources=ONE, submitted=at(1), expected_s=10)]
    got = predict(NOW, agents(), [stuck], waiting, overhead=oh)
    assert got["w1"] is None and got["w2"] is None
    # a waiting run with no estimate is placed, but nothing behind it on that capacity is predicted
    got = predict(NOW, agents(), [], [w.model_copy(update={"expected_s": None}) if w.run_id == "w1" else w
                                      for w in waiting], overhead=oh)
    assert got["w1"] == at(3) and got["w2"] is None
    # pending with an unknown end: it is placed (start told), the one behind it is not
    pend = Running(run_id="p", agent="a0", queue="q", resources=ONE, claimed=NOW, expected_s=None)
    got = predict(NOW, agents(), [pend], waiting[:1], overhead=oh)
    assert got["p"] == at(2) and got["w1"] is None


def test_an_overdue_run_frees_its_capacity_any_moment():
    late = Running(run_id="r", agent="a0", queue="q", resources=ONE, started=at(-100), expected_s=10)
    got = predict(NOW, agents(), [late], [Waiting(run_id="w", queue="q", resources=ONE, submitted=NOW, expected_s=1)],
                  overhead={"q": Overhead(start_s=2, release_s=3)})
    assert got["w"] == at(1 + 2)


def test_job_shape_is_the_deployment_and_its_parameters_but_not_a_port():
    a = job_shape("d", {"session_type": "batch", "startup_command": "sleep 2", "ports": []})
    assert a == job_shape("d", {"ports": [9000], "startup_command": "sleep 2", "session_type": "batch"})
    assert a != job_shape("d", {"session_type": "batch", "startup_command": "sleep 8", "ports": []})
    assert a != job_shape("e", {"session_type": "batch", "startup_command": "sleep 2", "ports": []})


def test_expected_runtime_by_shape_then_deployment_then_timeout_capped_by_timeout():
    s2, s8 = job_shape("d", {"cmd": "sleep 2"}), job_shape("d", {"cmd": "sleep 8"})
    past = [PastRun(deployment_id="d", shape=s2, run_s=2.2), PastRun(deployment_id="d", shape=s8, run_s=8.1),
            PastRun(deployment_id="d", shape=s2, run_s=2.0), PastRun(deployment_id="d", shape=s8, run_s=7.9),
            PastRun(deployment_id="d", shape=s2, run_s=None)]
    assert expected_runtime(s2, "d", past, None) == 2.1
    assert expected_runtime(s8, "d", past, None) == 8.0
    assert expected_runtime(s8, "d", past, 5.0) == 5.0, "never above the timeout"
    new = job_shape("d", {"cmd": "sleep 4"})
    assert expected_runtime(new, "d", past, None) == (2.2 + 7.9) / 2, "no past run of its own: the deployment's"
    assert expected_runtime(job_shape("x", {}), "x", past, 30.0) == 30.0, "nothing at all: the timeout"
    assert expected_runtime(job_shape("x", {}), "x", past, None) is None
    many = [PastRun(deployment_id="d", shape=s2, run_s=float(k)) for k in range(1, 41)]  # newest first
    assert expected_runtime(s2, "d", many, None) == 10.5, "the newest 20 only"


def test_learn_overhead_from_claims_starts_and_ends_on_the_same_agent():
    runs = [
        # a: ran from 0 to 10 on agent x; b waited for it (created at 1), claimed at 12 -> release 2
        PastRun(agent="x", created=at(-1), claimed=at(0), started=at(3), ended=at(10)),
        PastRun(agent="x", created=at(1), claimed=at(12), started=at(16), ended=at(20)),
        # c on agent y found room at once: claimed 0.5 s after it was submitted; d waited for c: release 4
        PastRun(agent="y", created=at(30), claimed=at(30.5), started=at(32.5), ended=at(40)),
        PastRun(agent="y", created=at(31), claimed=at(44), started=at(47), ended=at(50)),
        # e was submitted after y's last end: it did not wait for an end (no release sample)
        PastRun(agent="y", created=at(60), claimed=at(61), started=at(63), ended=at(70)),
        PastRun(agent="z", created=None, claimed=None, started=None, ended=at(5)),  # ends only
    ]
    oh = learn_overhead(runs)
    assert oh.start_s == 3.0  # median of 3, 4, 2, 3, 2
    assert oh.release_s == 3.0  # median of 2 and 4
    assert oh.claim_s == 1.0  # median of 1 (a), 0.5 (c), 1 (e): those that found room; b and d waited for ends
    assert learn_overhead([]) == Overhead()


def test_learn_overhead_replays_the_agents_ledger_when_capacity_and_resources_are_known():
    two = Resources(cpu=2, memory=2**30)

    def run(res, created, claimed, ended):
        return PastRun(agent="x", resources=res, created=at(created), claimed=at(claimed),
                       started=at(claimed + 1), ended=at(ended))

    runs = [run(ONE, -21, -20, -5),  # the oldest end: the replay starts there with the agent idle
            run(ONE, -1, 0, 10), run(ONE, -1, 0, 12),  # found room: claimed 1 s after submit
            run(ONE, 2, 13, 30),  # its room came from the end at 10 (not the later one at 12): 3 s
            run(ONE, 3, 16, 31)]  # from the end at 12: 4 s
    cap = {"x": Resources(cpu=2, memory=8 * 2**30)}
    oh = learn_overhead(runs, cap)
    assert (oh.release_s, oh.claim_s, oh.start_s) == (3.5, 1.0, 1.0)
    assert learn_overhead(runs).release_s == 2.5, "without the ledger: last end before the claim (1 and 4 s)"
    # a two-CPU run needs both ends (30 and 31): its room is the later one
    assert learn_overhead(runs + [run(two, 5, 36, 40)], cap).release_s == 4.0  # 3, 4 and 5 s
    # a run still holding capacity (no end; claimed about start - start_s = 32) takes the room freed at 30,
    # so the next claims get the rooms freed at 31 and 40
    held = PastRun(agent="x", resources=ONE, created=at(20), claimed=None, started=at(33), ended=None)
    later = [run(ONE, 5, 32.5, 40), run(ONE, 6, 41, 50)]
    assert learn_overhead(runs + [held] + later, cap).release_s == 2.25  # 3, 4, 1.5 and 1 s
    assert learn_overhead(runs + later, cap).release_s == 3.5  # without it: 3, 4, 2.5 and 10 s


def test_more_claimed_than_an_agent_holds_does_not_break_the_replay():
    # Prefect may still show a run as running after its agent has let its capacity go
    running = [Running(run_id=f"r{k}", agent="a0", queue="q", resources=ONE, started=at(-k), expected_s=10)
               for k in range(3)]
    got = predict(NOW, agents(), running, [Waiting(run_id="w", queue="q", resources=ONE, submitted=NOW,
                                                   expected_s=1)])
    assert got["w"] is not None and got["w"] >= NOW


def test_claim_is_the_first_pending_after_the_last_scheduled_not_prefects_submitting_state():
    from prefect_launch.deployments.eta_reader import claim_and_start

    t = at
    # claimed at 2, handed to its process ("Submitting", also Pending) at 8, running at 9
    assert claim_and_start([("SCHEDULED", t(0)), ("PENDING", t(2)), ("PENDING", t(8)), ("RUNNING", t(9)),
                            ("COMPLETED", t(20))]) == (t(2), t(9))
    # put back in its queue (preempted), claimed again: the latest claim counts; history order need not be sorted
    assert claim_and_start([("RUNNING", t(9)), ("SCHEDULED", t(0)), ("PENDING", t(2)), ("SCHEDULED", t(30)),
                            ("PENDING", t(40)), ("PENDING", t(41)), ("RUNNING", t(43))]) == (t(40), t(43))
    assert claim_and_start([("SCHEDULED", t(0)), ("PENDING", t(2))]) == (t(2), None)
    assert claim_and_start([("SCHEDULED", t(0))]) == (None, None)
