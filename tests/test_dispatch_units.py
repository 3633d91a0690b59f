"""The back-end-neutral dispatch cycle and the docker back end's container settings, without servers.

dispatch_cycle is driven with fake runs and recording hooks; container_kwargs is pure.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from uuid import uuid4

import pytest

from prefect_launch.workers.scheduling.dispatch import OTHER_QUEUE_TOOK_IT, DispatchHooks, dispatch_cycle
from prefect_launch.workers.scheduling.wait_notes import WaitNotes
from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.queue_spec import Preset, QueueSpec
from prefect_launch.workers.scheduling.resources import Resources
from prefect_launch.workers.agent.tags import RUN_ID_LABEL, WAIT_LABEL

SPEC = QueueSpec(name="q", presets={"one": Preset(cpu=1, memory="1Gi", gpu=1, shm_size="256Mi"),
                                    "two": Preset(cpu=2, memory="2Gi", gpu=2)}, default_preset="one")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def run(i: int, **job_vars):
    return SimpleNamespace(id=uuid4(), name=f"r{i}", deployment_id=None, job_variables=job_vars,
                           expected_start_time=T0 + timedelta(seconds=i), work_queue_name="default", labels={})


class Recorder:
    def __init__(self, fail_start: bool = False):
        self.started, self.waiting, self.rejected, self.booked = [], {}, {}, []
        self.fail_start = fail_start

    def hooks(self) -> DispatchHooks:
        async def deployment_vars(_):
            return {}

        async def pinned():
            return {"gone": "offline since 10:00"}, {"gone"}

        async def wait(fr, reason):
            self.waiting[fr.name] = reason

        async def reject(fr, reason):
            self.rejected[fr.name] = reason

        def start(fr, alloc, req):
            if self.fail_start:
                raise RuntimeError("back end refused")
            self.started.append((fr.name, alloc.gpu_indices, req.preset))

        return DispatchHooks(deployment_vars=deployment_vars, pinned_agents=pinned, start=start, wait=wait,
                             reject=reject, booked=self.booked.append)


def cycle(runs, ledger, rec, spec=SPEC):
    return asyncio.run(dispatch_cycle(runs, spec, ledger, "q", "a1", {"default": 1}, rec.hooks()))


def test_cycle_starts_what_fits_and_labels_the_rest_with_why():
    ledger = Ledger(Resources(cpu=4, memory=8 << 30, gpu=2))
    rec = Recorder()
    runs = [run(0), run(1, preset="two"), run(2, preset="nope"), run(3, agent="gone")]
    out = cycle(runs, ledger, rec)
    assert rec.started == [("r0", [0], "one")]
    assert [a.run_id for a in rec.booked] == [str(runs[0].id)]  # journaled before the back end saw it
    assert "needs gpu=2" in rec.waiting["r1"] and "has 1 free" in rec.waiting["r1"]
    assert "unknown preset 'nope'" in rec.rejected["r2"]
    assert rec.waiting["r3"] == "waiting: pinned to agent gone, which is offline since 10:00"
    assert [fr.name for fr in out.started] == ["r0"] and ledger.get(str(runs[0].id)) is not None


def test_cycle_waits_when_another_queue_took_the_room_and_releases_on_failed_start():
    class Taken(Ledger):
        def try_allocate(self, *a, **k):
            return None

    rec = Recorder()
    r = run(0)
    cycle([r], Taken(Resources(cpu=4, memory=8 << 30, gpu=2)), rec)
    assert rec.waiting == {"r0": OTHER_QUEUE_TOOK_IT} and not rec.started

    ledger = Ledger(Resources(cpu=4, memory=8 << 30, gpu=2))
    with pytest.raises(RuntimeError):
        cycle([run(1)], ledger, Recorder(fail_start=True))
    assert ledger.allocations() == []  # nothing held by a run that never reached its back end


def test_wait_notes_write_a_reason_only_when_it_changes():
    notes = WaitNotes(hold_s=0)  # "waiting: x" was not written by this agent: no hold (see test_placement_units)
    fr = SimpleNamespace(id=1, labels={WAIT_LABEL: "waiting: x"})
    assert not notes.changed(fr, "waiting: x")  # already on the run
    assert notes.changed(fr, "waiting: y") and not notes.changed(fr, "waiting: y")
    notes.forget(1)
    assert notes.changed(SimpleNamespace(id=1, labels={}), "waiting: y")


def test_container_kwargs_carry_the_allocation():
    from prefect_launch.workers.backends.docker import container_kwargs
    from prefect_launch.workers.scheduling.ledger import Allocation

    res = Resources(cpu=1.5, memory=512 << 20, gpu=2, shm_size=64 << 20)
    alloc = Allocation(run_id="r", resources=res, gpu_indices=[1, 3], cpu_cores=[0, 1])
    kw = container_kwargs(res, alloc, "r", "a1", "q", send_gpus=False)
    assert kw["nano_cpus"] == 1_500_000_000 and kw["mem_limit"] == kw["memswap_limit"] == str(512 << 20)
    assert kw["shm_size"] == str(64 << 20) and kw["cpuset_cpus"]
    assert kw["labels"][RUN_ID_LABEL] == "r"
    assert "device_requests" not in kw  # GPU-less host: rendered, not sent
    assert kw["rendered_device_requests"] == [{"Driver": "nvidia", "Count": 0, "DeviceIDs": ["1", "3"],
                                               "Capabilities": [["gpu"]], "Options": {}}]
    sent = container_kwargs(res, alloc, "r", "a1", "q", send_gpus=True)
    assert sent["device_requests"] == kw["rendered_device_requests"]
    import docker.types

    dr = docker.types.DeviceRequest(driver="nvidia", device_ids=["1", "3"], capabilities=[["gpu"]])
    assert dict(dr)["DeviceIDs"] == ["1", "3"] and dict(dr)["Capabilities"] == [["gpu"]]
