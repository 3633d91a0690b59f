"""The environment each member of a cluster run gets, so members find each other (pure).

Backend.AI-style names (``LAUNCH_CLUSTER_*``) and the torch.distributed ones (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``torchrun``-style code and
``torch.distributed.init_process_group("gloo")`` work unchanged. Each member is pinned to its
own GPUs and cores: its ``CUDA_VISIBLE_DEVICES`` (NVML indices, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), thread
counts and ``LAUNCH_CPU*`` are its own.
"""

from __future__ import annotations

import socket
from typing import Optional

from prefect_launch.workers.scheduling.ledger import Allocation, MemberAlloc
from prefect_launch.workers.agent.limits import run_environment

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now, for the main's rendezvous (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def member_env(alloc: Allocation, member: MemberAlloc, agent: str, mode: str, master_port: int,
               main_addr: str = LOOPBACK, addrs: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Pinning of ``member`` (as a run of its own) plus who the cluster is and where its main listens.

    ``alloc`` holds the members on this agent; ``alloc.cluster_size`` counts all of them (multi-node:
    the others are on other agents, perhaps other hosts). ``addrs``: member name -> its host's address
    (multi-node: each member's agent's published address; ``main_addr`` is main1's); without it every
    member is on this host at ``main_addr`` (single-node: the loopback)."""
    from prefect_launch.workers.cluster.fit import member_names

    own = alloc.model_copy(update={"resources": member.resources, "gpu_indices": member.gpu_indices,
                                   "cpu_cores": member.cpu_cores, "members": [], "remote_members": {}})
    env = run_environment(own, agent)
    size = alloc.cluster_size or len(alloc.members)
    names = member_names(size)
    local = sorted(m.rank for m in alloc.members)
    env.update(cluster_variables(size=size, rank=member.rank, member=member.name, mode=mode, hosts=names,
                                 addrs=[(addrs or {}).get(n, main_addr) for n in names],
                                 main_addr=main_addr, port=master_port, local_rank=local.index(member.rank),
                                 local_size=len(local)))
    return env


def cluster_variables(*, size: int, rank: int | str, member: str, mode: str, hosts: list[str], addrs: list[str],
                      main_addr: str, port: int, local_rank: int = 0, local_size: int = 1) -> dict[str, str]:
    """Who the cluster is and where its main listens, by the names every back end sets (pure).

    Shared by the process back end (`member_env`) and the Kubernetes one (`kubernetes_cluster`), so the
    variable names cannot drift apart between them."""
    return {
        "LAUNCH_CLUSTER_SIZE": str(size),
        "LAUNCH_CLUSTER_RANK": str(rank),
        "LAUNCH_CLUSTER_MEMBER": member,
        "LAUNCH_CLUSTER_MODE": mode,
        "LAUNCH_CLUSTER_HOSTS": ",".join(hosts),
        "LAUNCH_CLUSTER_ADDRS": ",".join(addrs),
        "LAUNCH_CLUSTER_MAIN_ADDR": main_addr,
        "LAUNCH_CLUSTER_PORT": str(port),
        "WORLD_SIZE": str(size),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": main_addr,
        "MASTER_PORT": str(port),
    }
