"""Run one agent: a launch-process worker per queue, all sharing one capacity ledger."""

from __future__ import annotations

import signal
import socket
from typing import Optional

import anyio

from prefect_launch.workers.agent_context import AgentContext
from prefect_launch.workers.resources import detect_capacity


async def _serve(queues: list[str], name: str, capacity: Optional[str], use_cgroups: bool) -> None:
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from prefect_launch.workers.worker import LaunchProcessWorker

    async with get_client() as client:
        for q in queues:
            try:
                pool = await client.read_work_pool(q)
            except ObjectNotFound:
                raise LookupError(f"unknown queue {q!r}; create it with `prefect-launch queue apply FILE`") from None
            if pool.type != LaunchProcessWorker.type:
                raise LookupError(
                    f"queue {q!r} has target type {pool.type!r}; a process agent serves 'launch-process' queues"
                )
    agent = AgentContext.detect(capacity)
    print(f"agent {name!r}: queues {', '.join(queues)}; capacity {agent.ledger.capacity.describe()}", flush=True)
    workers = [
        LaunchProcessWorker(work_pool_name=q, name=name, agent=agent, create_pool_if_not_found=False,
                            use_cgroups=use_cgroups)
        for q in queues
    ]
    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                print(f"agent {name!r}: stopping ({signal.Signals(signum).name}); running jobs are left to finish "
                      "under Prefect's crash detection", flush=True)
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signal, tg.cancel_scope)
        for w in workers:
            tg.start_soon(w.start)
    print(f"agent {name!r}: stopped", flush=True)


def run_agent(queues: list[str], name: Optional[str] = None, capacity: Optional[str] = None,
              use_cgroups: bool = True) -> None:
    """Block serving ``queues`` until interrupted (Ctrl-C stops cleanly)."""
    detect_capacity(capacity)  # fail fast on a malformed --capacity
    try:
        anyio.run(_serve, queues, name or socket.gethostname(), capacity, use_cgroups)
    except KeyboardInterrupt:
        pass
