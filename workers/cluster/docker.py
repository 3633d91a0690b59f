"""The sub members of a cluster run on a docker queue: one container per member, on host networking.

main1 is the run's own container (started by the worker as for any run, limited to main1's cores
and GPUs); sub1.. are containers of the same image, volumes and shape that the agent starts first,
each limited to its member's share (cores, CPUs, memory, GPUs) and running
`prefect_launch.workers.cluster.member` for the run. Host networking gives every member the
rendezvous address and port the process back end gives (`cluster_env.member_env`), so
torch.distributed-style launchers work unchanged.

`ClusterContainers` keeps `ClusterProcesses`' watch/wait/first-failure logic and replaces what is
Docker's own: starting (docker-py), the exit status (the container's state, which also survives an
agent restart: no exit file is needed), stopping (SIGTERM to the container, then SIGKILL) and
removal. A member's output is copied from its container's log into the member log the worker
quotes when it fails the run.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from prefect_launch.workers.cluster.process import NO_EXIT_STATUS, MEMBER_MODULE, ClusterProcesses, SubMember
from prefect_launch.workers.scheduling.ledger import MemberAlloc
from prefect_launch.workers.agent.limits import container_gpu_env, gpu_device_ids, physical_cores
from prefect_launch.workers.metrics.nvml import gpu_uuids
from prefect_launch.workers.agent.tags import RUN_ID_LABEL

MEMBER_LABEL = "io.prefect-launch.member"
ENDED = ("exited", "dead")


def member_settings(main: dict[str, Any], member: MemberAlloc, env: dict[str, str], run_id: str,
                    send_gpus: bool, uuids: Optional[dict[int, str]] = None) -> dict[str, Any]:
    """docker-py ``containers.create`` arguments for a sub member, from main1's container settings (pure).

    Same image, volumes, network, shm and memory as main1 (each member has the run's preset); its own
    cores, GPUs, environment, name and member label; the member module as its command.
    """
    cores = physical_cores(member.cpu_cores) if member.cpu_cores else []
    kw = {k: v for k, v in main.items() if k not in ("command", "environment", "name", "labels", "cpuset_cpus",
                                                     "device_requests", "auto_remove")}
    kw.update({
        "command": ["python", "-m", MEMBER_MODULE, run_id],
        "environment": env,
        "name": f"launch-{run_id}-{member.name}",
        "labels": {**(main.get("labels") or {}), RUN_ID_LABEL: run_id, MEMBER_LABEL: member.name},
        "auto_remove": False,
    })
    if cores:
        kw["cpuset_cpus"] = ",".join(map(str, cores))
    if member.gpu_indices and send_gpus:  # by UUID (NVML's, unless ``uuids`` is given); named so inside too
        import docker.types

        ids = gpu_device_ids(member.gpu_indices, gpu_uuids() if uuids is None else uuids)
        kw["device_requests"] = [docker.types.DeviceRequest(driver="nvidia", capabilities=[["gpu"]], device_ids=ids)]
        kw["environment"] = {**env, **container_gpu_env(ids)}
    return kw


class ContainerMember:
    """A member's container with the surface `ClusterProcesses` reads from a process: pid, poll(), kill()."""

    def __init__(self, docker: Any, container_id: str, log_path: Path):
        self.docker = docker
        self.id = container_id
        self.log_path = log_path
        self.returncode: Optional[int] = None
        self.pid = 0
        try:
            self.pid = int(docker.containers.get(container_id).attrs["State"].get("Pid") or 0)
        except Exception:
            pass

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        try:
            c = self.docker.containers.get(self.id)
        except Exception:  # removed under us: no status to read
            self.returncode = NO_EXIT_STATUS
            return self.returncode
        if c.status not in ENDED:
            return None
        state = c.attrs.get("State") or {}
        self.returncode = int(state.get("ExitCode") or 0) or (137 if state.get("OOMKilled") else 0)
        try:
            self.log_path.write_bytes(c.logs())
        except Exception:
            pass
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            self.docker.containers.get(self.id).kill(signal=int(sig))
        except Exception:
            pass


@dataclass
class ClusterContainers(ClusterProcesses):
    """A docker run's sub members (see the module docstring)."""

    docker: Any = None
    main_settings: dict[str, Any] = field(default_factory=dict)
    send_gpus: bool = False
    keep: bool = False

    def start(self, member: MemberAlloc, env: dict[str, str], log_path: Path) -> SubMember:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        c = self.docker.containers.create(**member_settings(self.main_settings, member, env, self.run_id,
                                                            self.send_gpus))
        c.start()
        sub = SubMember(member=member, proc=ContainerMember(self.docker, c.id, log_path),  # type: ignore[arg-type]
                        log_path=log_path)
        self.subs.append(sub)
        return sub

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM each live member's container, then SIGKILL what is left after ``grace_s``."""
        self.stopping = True
        for s in self.alive():
            s.proc.kill(signal.SIGTERM)  # type: ignore[call-arg]
        if not await self.wait(grace_s):
            for s in self.alive():
                s.proc.kill(signal.SIGKILL)  # type: ignore[call-arg]
            await self.wait(5.0)

    def remove(self) -> None:
        """Remove the members' containers once their ends are read (unless the queue keeps them): the docker
        worker calls it once on every end, after `ClusterRuns.end` (which only drops the member logs)."""
        if self.keep:
            return
        for s in self.subs:
            try:
                self.docker.containers.get(s.proc.id).remove(force=True)  # type: ignore[union-attr]
            except Exception:
                pass


def adopt_member_containers(docker: Any, run_id: str, members: list[MemberAlloc], log_of) -> ClusterContainers:
    """A restarted agent's hold on a run's sub member containers, found by their labels."""
    procs = ClusterContainers(run_id=run_id, docker=docker)
    found = {c.labels.get(MEMBER_LABEL): c for c in
             docker.containers.list(all=True, filters={"label": [f"{RUN_ID_LABEL}={run_id}", MEMBER_LABEL]})}
    for m in members:
        c = found.get(m.name)
        if c is None:
            continue
        procs.subs.append(SubMember(member=m, proc=ContainerMember(docker, c.id, log_of(m.name)),  # type: ignore
                                    log_path=log_of(m.name)))
    return procs
