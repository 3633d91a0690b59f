"""The agents' read of due runs matches what the worker poll would give (pure parts, and on a real server)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace as NS
from uuid import uuid4

import anyio
import pytest

from prefect_launch.workers.agent.scheduled_runs import due_runs, needs_server_limits, read_due_runs, runnable_queues


def _q(name: str, paused: bool = False, limit=None):
    return NS(id=uuid4(), name=name, is_paused=paused, concurrency_limit=limit)


@pytest.mark.parametrize("pool_limit,queues,limited", [
    pytest.param(None, [_q("a"), _q("b")], False, id="no-limit"),
    pytest.param(3, [_q("a")], True, id="pool-limit"),
    pytest.param(None, [_q("a"), _q("b", limit=1)], True, id="queue-limit"),
])
def test_limits_send_the_agent_to_the_worker_poll(pool_limit, queues, limited):
    assert bool(needs_server_limits(NS(concurrency_limit=pool_limit), queues)) is limited


def test_paused_and_unwanted_queues_are_skipped_and_in_process_retries_too():
    qs = [_q("high"), _q("low", paused=True), _q("medium")]
    assert set(runnable_queues(qs)) == {"high", "medium"}
    assert set(runnable_queues(qs, ["medium", "low"])) == {"medium"}
    from prefect.client.schemas.objects import FlowRun

    def run(queue: str, retry_type=None) -> FlowRun:
        fr = FlowRun(flow_id=uuid4(), work_queue_name=queue)
        fr.empirical_policy.retry_type = retry_type
        return fr

    runnable = runnable_queues(qs)
    got = due_runs([run("high"), run("low"), run("medium", "in_process"), run("medium")], uuid4(), runnable)
    assert [g.flow_run.work_queue_name for g in got] == ["high", "medium"]
    assert got[0].work_queue_id == runnable["high"].id


def test_read_matches_the_worker_poll_on_a_real_server(prefect_server, unique_name):
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Scheduled

    async def main():
        async with get_client() as client:
            pool = await client.create_work_pool(WorkPoolCreate(name=f"due-{unique_name}", type="process"))
            await client.create_work_queue(name="high", work_pool_name=pool.name, priority=1)

            fid = await client.create_flow_from_name(f"due-{unique_name}")
            dep = await client.create_deployment(flow_id=fid, name="d", work_pool_name=pool.name)
            now = datetime.now(timezone.utc)
            due = await client.create_flow_run_from_deployment(dep, work_queue_name="high")
            later = await client.create_flow_run_from_deployment(
                dep, work_queue_name="high", state=Scheduled(scheduled_time=now + timedelta(hours=1)))
            before = now + timedelta(seconds=10)
            ours = await read_due_runs(client, pool, None, before)
            theirs = await client.get_scheduled_flow_runs_for_work_pool(pool.name, scheduled_before=before)
            # the agent passes the work queues it read lately (one read, not two, per wake-up)
            queues = await client.read_work_queues(work_pool_name=pool.name)
            cached = await read_due_runs(client, pool, None, before, queues=queues)
            paused = await read_due_runs(client, pool, None, before,
                                         queues=[q.model_copy(update={"is_paused": True}) for q in queues])
            assert paused == []
            return due.id, later.id, [r.flow_run.id for r in ours], [r.flow_run.id for r in theirs], \
                [r.flow_run.id for r in cached]

    due, later, ours, theirs, cached = anyio.run(main)
    assert ours == theirs == cached == [due]
    assert later not in ours


def test_the_window_is_per_priority_so_a_late_urgent_run_is_seen(prefect_server, unique_name):
    """With room for 2 runs per level, 4 older `low` runs do not hide a newer `high` one."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    async def main():
        async with get_client() as client:
            pool = await client.create_work_pool(WorkPoolCreate(name=f"win-{unique_name}", type="process"))
            await client.create_work_queue(name="high", work_pool_name=pool.name, priority=1)
            await client.create_work_queue(name="low", work_pool_name=pool.name, priority=2)
            fid = await client.create_flow_from_name(f"win-{unique_name}")
            dep = await client.create_deployment(flow_id=fid, name="d", work_pool_name=pool.name)
            lows = [await client.create_flow_run_from_deployment(dep, work_queue_name="low") for _ in range(4)]
            high = await client.create_flow_run_from_deployment(dep, work_queue_name="high")
            got = await read_due_runs(client, pool, None, datetime.now(timezone.utc) + timedelta(seconds=10), limit=2)
            return [r.id for r in lows], high.id, [r.flow_run.id for r in got]

    lows, high, got = anyio.run(main)
    assert high in got  # the newest run, but the only one of its level
    assert [r for r in got if r != high] == lows[:2]  # the oldest two of the deep level, in order


def test_one_read_serves_every_level_until_the_window_fills(prefect_server, unique_name):
    """Below the window one read of all levels is the whole answer; at it, each level is read on its own
    (and the answer is what reading each level gives, either way)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName, WorkQueueFilter, WorkQueueFilterName

    async def main():
        async with get_client() as client:
            pool = await client.create_work_pool(WorkPoolCreate(name=f"one-{unique_name}", type="process"))
            for prio, name in enumerate(("critical", "high", "low"), start=1):
                await client.create_work_queue(name=name, work_pool_name=pool.name, priority=prio)
            fid = await client.create_flow_from_name(f"one-{unique_name}")
            dep = await client.create_deployment(flow_id=fid, name="d", work_pool_name=pool.name)
            made = [await client.create_flow_run_from_deployment(dep, work_queue_name=q) for q in ("low", "high", "low")]
            reads = []
            real = client.read_flow_runs

            async def counted(**kw):
                reads.append(kw["work_queue_filter"].name.any_)
                return await real(**kw)

            client.read_flow_runs = counted
            before = datetime.now(timezone.utc) + timedelta(seconds=10)
            below = await read_due_runs(client, pool, None, before, limit=4)
            below_reads = list(reads)
            reads.clear()
            at = await read_due_runs(client, pool, None, before, limit=2)
            at_reads = list(reads)
            client.read_flow_runs = real
            per_level = []
            for q in ("critical", "default", "high", "low"):
                per_level += await real(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool.name])),
                                        work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(any_=[q])))
            per_level.sort(key=lambda fr: (fr.next_scheduled_start_time, str(fr.id)))
            return [m.id for m in made], [r.flow_run.id for r in below], below_reads, [r.flow_run.id for r in at], \
                at_reads, [r.id for r in per_level]

    made, below, below_reads, at, at_reads, per_level = anyio.run(main)
    levels = ["critical", "default", "high", "low"]  # the pool's own "default" queue is a level too
    assert below_reads == [levels]  # one read of every level
    assert below == per_level and set(below) == set(made)
    assert sorted(at_reads) == sorted([levels, *([q] for q in levels)])  # the window filled: then one per level
    assert at == [made[0], made[1], made[2]]  # low's oldest two and high's one: every run here, oldest first


def test_the_poll_backs_off_only_while_nothing_is_due():
    from prefect_launch.workers.agent.scheduled_runs import next_poll_s

    assert [next_poll_s(2, k) for k in range(6)] == [2, 4, 8, 8, 8, 8]  # doubling after each empty look, capped
    assert next_poll_s(2, 0, cap_s=8) == 2  # runs due: the short poll
    assert next_poll_s(0.5, 3, cap_s=10) == 4
    assert next_poll_s(12, 5, cap_s=8) == 12  # never below the configured poll
    assert next_poll_s(2, 10_000) == 8  # no overflow after a long idle time
