"""GPUs pinned by bus order (issue 38 section 2), against a fake NVML whose index order is not CUDA's.

NVML numbers a host's GPUs in PCI bus order; CUDA numbers them fastest first unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``. The fake host here has a slow GPU at NVML index 0 and a fast one
at index 1, so "fastest first" swaps them. ``cuda_sees`` is CUDA's documented enumeration (the
order, then ``CUDA_VISIBLE_DEVICES`` by ordinal or UUID, stopping at the first entry that names
nothing): each run's environment, read through it, must give the run exactly the devices the
ledger holds for it - for a process, for each cluster member, and inside a container (which sees
only the devices its device request names, renumbered from 0). Pure: no server, no Docker.
"""

from __future__ import annotations

from typing import Optional

import pytest

from prefect_launch.workers.agent.limits import container_gpu_env, gpu_device_ids, run_environment
from prefect_launch.workers.backends.docker import container_kwargs
from prefect_launch.workers.cluster.docker import member_settings
from prefect_launch.workers.cluster.env import member_env
from prefect_launch.workers.metrics.nvml import FakeNVML, Nvml, detect_gpus, gpu_uuids
from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.resources import Resources

# NVML index order = bus order: T4 (slow), A100 (fast), T4 (slow), H100 (fastest)
HOST = [{"name": "Fake T4", "uuid": "GPU-1111-t4a", "memory_total": 16 << 30, "speed": 1},
        {"name": "Fake A100", "uuid": "GPU-2222-a100", "memory_total": 40 << 30, "speed": 3},
        {"name": "Fake T4", "uuid": "GPU-3333-t4b", "memory_total": 16 << 30, "speed": 1},
        {"name": "Fake H100", "uuid": "GPU-4444-h100", "memory_total": 80 << 30, "speed": 4}]


def cuda_sees(env: dict[str, str], devices: list[dict]) -> list[str]:
    """The UUIDs a CUDA process started with ``env`` uses, in its own device order.

    ``devices`` in bus order (NVML's). Default order: fastest first (ties in bus order);
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: bus order. ``CUDA_VISIBLE_DEVICES`` entries are ordinals in that
    order or UUID prefixes; the first invalid or repeated one ends the list; unset: every device."""
    order = list(devices) if env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" else \
        sorted(devices, key=lambda d: -d["speed"])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [d["uuid"] for d in order]
    seen: list[str] = []
    for entry in (e.strip() for e in visible.split(",") if e.strip()):
        dev: Optional[dict] = None
        if entry.startswith(("GPU-", "MIG-")):
            hits = [d for d in order if d["uuid"].startswith(entry)]
            dev = hits[0] if len(hits) == 1 else None
        elif entry.isdigit() and int(entry) < len(order):
            dev = order[int(entry)]
        if dev is None or dev["uuid"] in seen:
            break
        seen.append(dev["uuid"])
    return seen


def in_container(device_ids: list[str], devices: list[dict]) -> list[dict]:
    """The devices a container gets from a device request (NVIDIA runtime: index = NVML's, or UUID)."""
    return [d for i, d in enumerate(devices) if str(i) in device_ids or d["uuid"] in device_ids]


@pytest.fixture
def fake():
    return Nvml(FakeNVML(gpus=HOST))


@pytest.fixture
def ledger(fake):
    return Ledger(Resources(cpu=8, memory=32 << 30, gpu=len(HOST)), gpu_indices=[g.index for g in detect_gpus(fake)])


def test_the_fake_host_is_one_where_fastest_first_is_not_bus_order():
    assert cuda_sees({}, HOST) != [d["uuid"] for d in HOST]
    assert cuda_sees({"CUDA_VISIBLE_DEVICES": "0"}, HOST) == ["GPU-4444-h100"]  # not NVML's index 0
    assert cuda_sees({"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, HOST) == ["GPU-1111-t4a"]


def test_a_process_run_computes_on_the_gpus_the_ledger_holds(fake, ledger):
    uuids = gpu_uuids(fake)
    assert uuids == {i: d["uuid"] for i, d in enumerate(HOST)}
    runs = [ledger.try_allocate(f"r{k}", Resources(cpu=1, memory=1 << 30, gpu=g)) for k, g in enumerate([1, 2, 1])]
    used: list[str] = []
    for alloc in runs:
        env = run_environment(alloc, "agent-1")
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        held = [uuids[i] for i in alloc.gpu_indices]
        assert cuda_sees(env, HOST) == held, alloc.gpu_indices
        used += held
        without = {k: v for k, v in env.items() if k != "CUDA_DEVICE_ORDER"}
        if held != ["GPU-4444-h100"]:  # the check has teeth: CUDA's default order gives other devices
            assert cuda_sees(without, HOST) != held
    assert sorted(used) == sorted(uuids.values())  # disjoint, every GPU once


def test_a_run_without_gpus_sees_none(ledger):
    env = run_environment(ledger.try_allocate("cpu", Resources(cpu=1, memory=1 << 30, gpu=0)), "agent-1")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and cuda_sees(env, HOST) == []


def test_each_cluster_member_computes_on_its_own_gpus(fake, ledger):
    uuids = gpu_uuids(fake)
    alloc = ledger.try_allocate_cluster("c", Resources(cpu=1, memory=1 << 30, gpu=2), size=2)
    seen = {}
    for m in alloc.members:
        env = member_env(alloc, m, "agent-1", "single-node", 29500)
        seen[m.name] = cuda_sees(env, HOST)
        assert seen[m.name] == [uuids[i] for i in m.gpu_indices], m.name
    assert not set(seen["main1"]) & set(seen["sub1"])


def test_a_container_is_given_the_ledgers_gpus_by_uuid(fake, ledger):
    uuids = gpu_uuids(fake)
    allocs = [ledger.try_allocate(f"d{k}", Resources(cpu=1, memory=1 << 30, gpu=g)) for k, g in enumerate([1, 1, 2])]
    assert [a.gpu_indices for a in allocs] == [[0], [1], [2, 3]]
    for a in allocs:
        held = [uuids[i] for i in a.gpu_indices]
        kw = container_kwargs(a.resources, a, a.run_id, "agent-1", "q", send_gpus=True, uuids=uuids)
        (req,) = kw["device_requests"]
        assert req["DeviceIDs"] == held
        inside = in_container(req["DeviceIDs"], HOST)
        env = {**run_environment(a, "agent-1"), **container_gpu_env(req["DeviceIDs"])}
        assert cuda_sees(env, inside) == held
        if a.gpu_indices != [0]:  # the host's indices inside the container would name other devices, or none
            assert cuda_sees(run_environment(a, "agent-1"), inside) != held


def test_without_uuids_a_container_is_pinned_by_index_and_its_own_ordinals():
    assert gpu_device_ids([3, 1], {1: "GPU-b"}) == ["3", "1"]  # one unknown: all by index
    assert gpu_device_ids([3, 1], {1: "GPU-b", 3: "GPU-d"}) == ["GPU-d", "GPU-b"]
    assert gpu_device_ids([], {1: "GPU-b"}) == []
    assert container_gpu_env(["1", "3"]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert container_gpu_env(["GPU-d", "MIG-x"])["CUDA_VISIBLE_DEVICES"] == "GPU-d,MIG-x"
    inside = in_container(["1", "3"], HOST)
    assert cuda_sees(container_gpu_env(["1", "3"]), inside) == ["GPU-2222-a100", "GPU-4444-h100"]


def test_a_cluster_member_container_is_given_its_gpus_by_uuid(fake, ledger):
    uuids = gpu_uuids(fake)
    alloc = ledger.try_allocate_cluster("g", Resources(cpu=1, memory=1 << 30, gpu=1), size=3)
    main = {"image": "img", "environment": {}, "device_requests": ["main1's"], "labels": {}}
    for m in alloc.members[1:]:
        env = member_env(alloc, m, "agent-1", "single-node", 29500)
        kw = member_settings(main, m, env, "g", send_gpus=True, uuids=uuids)
        (req,) = kw["device_requests"]
        held = [uuids[i] for i in m.gpu_indices]
        assert req["DeviceIDs"] == held
        assert cuda_sees(kw["environment"], in_container(held, HOST)) == held
        assert kw["environment"]["LAUNCH_CLUSTER_MEMBER"] == m.name
        assert "device_requests" not in member_settings(main, m, env, "g", send_gpus=False)


def test_the_docker_worker_names_sent_gpus_inside_the_container(monkeypatch):
    """`_build_container_settings` rewrites the container's CUDA_VISIBLE_DEVICES from its device request."""
    import docker.types
    from prefect_docker.worker import DockerWorker

    from prefect_launch.workers.backends.docker import LaunchDockerWorker

    base = {"image": "img", "environment": {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "X": "y"},
            "device_requests": [docker.types.DeviceRequest(driver="nvidia", device_ids=["GPU-2222-a100"],
                                                           capabilities=[["gpu"]])]}
    monkeypatch.setattr(DockerWorker, "_build_container_settings", lambda self, client, cfg: dict(base))
    worker = object.__new__(LaunchDockerWorker)
    env = LaunchDockerWorker._build_container_settings(worker, None, None)["environment"]
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-2222-a100", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "X": "y"}
    monkeypatch.setattr(DockerWorker, "_build_container_settings",
                        lambda self, client, cfg: {"image": "img", "environment": {"CUDA_VISIBLE_DEVICES": "1"}})
    assert LaunchDockerWorker._build_container_settings(worker, None, None)["environment"] == \
        {"CUDA_VISIBLE_DEVICES": "1"}  # GPUs not sent (a GPU-less host's virtual GPUs): left as they are


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"])
def test_a_secret_env_cannot_move_the_runs_gpus(name):
    """The pins are the agent's: --secret-env may not override what selects the devices."""
    from prefect_launch.workers.agent.secrets import SecretEnvError, _check_name

    with pytest.raises(SecretEnvError, match=f"cannot set '{name}'"):
        _check_name(name)
