"""Run one agent: a launch worker per queue (process, docker or kubernetes back end).

Process and docker queues share one capacity ledger (the box's CPUs, memory, GPUs);
kubernetes queues book nothing locally: the cluster places their pods.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Optional

import anyio

from prefect_launch.workers.agent.address import agent_address, check_address
from prefect_launch.workers.agent.context import AgentContext
from prefect_launch.settings import env_seconds
from prefect_launch.workers.scheduling.resources import detect_capacity

PROBE_EVERY_S = 2.0
DELIVER_S = 5.0  # at exit: how long Prefect's event and log workers get to deliver what they hold


def worker_types() -> dict[str, type]:
    """Pool type -> launch worker class, for every back end an agent can serve (kubernetes: see `worker_for`)."""
    from prefect_launch.workers.backends.docker import LaunchDockerWorker
    from prefect_launch.workers.backends.process import LaunchProcessWorker

    return {w.type: w for w in (LaunchProcessWorker, LaunchDockerWorker)}


def kubernetes_worker() -> type:
    """The launch-kubernetes worker, imported only for an agent that serves a kubernetes queue."""
    try:
        from prefect_launch.workers.backends.kubernetes.worker import LaunchKubernetesWorker
    except ImportError as exc:
        raise LookupError(f"kubernetes queues need prefect-kubernetes ({exc}); install the extra: "
                          "pip install 'prefect-launch[kubernetes]'") from None
    return LaunchKubernetesWorker


def worker_for(queue: str, pool: object, backends: dict[str, type]) -> type:
    """The worker class that serves ``pool``: its type's, or launch-kubernetes for a kubernetes pool that
    carries a launch queue declaration (a plain prefect-kubernetes pool is left to its own worker)."""
    from prefect_launch.workers.scheduling.queue_spec import queue_spec_of

    kind = getattr(pool, "type", None)
    if kind in backends:
        return backends[kind]
    if kind == "launch-kubernetes" or (kind == "kubernetes" and queue_spec_of(pool) is not None):
        return kubernetes_worker()
    raise LookupError(
        f"queue {queue!r} has target type {kind!r}; an agent serves "
        f"{', '.join(sorted([*backends, 'launch-kubernetes']))} queues (re-apply the queue file to move a docker "
        "queue to launch-docker)"
    )


async def _serve(queues: list[str], name: str, capacity: Optional[str], use_cgroups: bool,
                 on_exit: str = "drain", started: Optional[dict] = None,
                 advertise_address: Optional[str] = None) -> None:
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    backends = worker_types()
    kinds: dict[str, type] = {}
    await _wait_for_server()
    async with get_client() as client:
        for q in queues:
            try:
                pool = await client.read_work_pool(q)
            except ObjectNotFound:
                raise LookupError(f"unknown queue {q!r}; create it with `prefect-launch queue apply FILE`") from None
            kinds[q] = worker_for(q, pool, backends)
    agent = AgentContext.detect(capacity)
    agent.address = agent_address(advertise_address)
    if started is not None:
        started["agent"] = agent
    cluster = [q for q in queues if kinds[q].type == "launch-kubernetes"]
    print(f"agent {name!r}: queues {', '.join(queues)}; capacity {agent.ledger.capacity.describe()}; "
          f"address {agent.address}"
          + (f" (kubernetes queues {', '.join(cluster)}: placed by the cluster)" if cluster else ""), flush=True)
    workers = [
        kinds[q](work_pool_name=q, name=name, agent=agent, create_pool_if_not_found=False, use_cgroups=use_cgroups)
        for q in queues
    ]
    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        """First signal: drain (claim nothing, let runs finish). Second, or --on-exit cancel: cancel them."""
        received = 0
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                received += 1
                agent.draining = True
                running = sum([await _live(w) for w in workers])
                signame = signal.Signals(signum).name
                if received == 1 and on_exit == "drain" and running:
                    gone = "" if await _server_answers() else (
                        f" (the Prefect server at {os.environ.get('PREFECT_API_URL')} does not answer: a run that has "
                        "finished its work may still be waiting to report its end to it)")
                    print(f"agent {name!r}: {signame}: draining - claiming no new runs and waiting for {running} "
                          f"running run(s) to finish{gone}; send the signal again (Ctrl-C) to cancel them", flush=True)
                    scope_tg.start_soon(stop_when_drained, scope)
                    continue
                drain.cancel()  # a drain under way gives way to this stop
                if running:
                    reason = (f"cancelled: agent {name} was stopped ({signame}"
                              f"{', --on-exit cancel' if on_exit == 'cancel' and received == 1 else ''})")
                    print(f"agent {name!r}: {signame}: cancelling {running} running run(s)", flush=True)
                    with anyio.CancelScope(shield=True):
                        for w in workers:
                            await w.cancel_running(reason)
                else:
                    print(f"agent {name!r}: {signame}: no runs running; stopping", flush=True)
                await settle_ends()
                scope.cancel()
                return

    drain = anyio.CancelScope()

    async def stop_when_drained(scope: anyio.CancelScope) -> None:
        with drain:
            while sum([await _live(w) for w in workers]) or not_started():
                await anyio.sleep(0.3)
            print(f"agent {name!r}: drained - every run it held has finished", flush=True)
            await settle_ends()
            scope.cancel()

    async def settle_ends() -> None:
        """Runs that ended have their end recorded on the server before the agent goes, however slow the
        server is while it answers; a server that does not answer (an outage) must not keep a stopping
        agent alive, so the agent then says so and goes at once."""
        # how long ends may take to be recorded while the server answers (a slow server is not cut)
        ending_wait_s = env_seconds("LAUNCH_ENDING_WAIT_SECONDS", 120)
        deadline = time.monotonic() + ending_wait_s
        answers = True
        while held() and time.monotonic() < deadline:
            answers = await _server_answers()
            if not answers:
                break
            probe_again = time.monotonic() + PROBE_EVERY_S
            while held() and time.monotonic() < probe_again:
                await anyio.sleep(0.2)
        pending = held()
        if not pending:
            return
        if started is not None and not answers:
            started["server_gone"] = True
        why = "does not answer" if not answers else f"answers but did not take them within {ending_wait_s:g} s"
        print(f"agent {name!r}: the end of {len(pending)} run(s) ({', '.join(pending)}) is not recorded: the "
              f"Prefect server at {os.environ.get('PREFECT_API_URL')} {why}; stopping anyway "
              "(their capacity is free and their metrics are kept; a run the server still shows running is marked "
              "crashed by the next start of this agent)", flush=True)
        for w in workers:
            getattr(w, "cut_ending", lambda: None)()

    def held() -> list[str]:
        return [r for w in workers for r in getattr(w, "held", lambda: [])()]

    def not_started() -> list[str]:
        """Booked runs whose process is not up yet (a run that started and ended is in `held` until recorded)."""
        up = set(held())
        return [a.run_id for a in agent.ledger.allocations() if a.run_id not in up]

    async with anyio.create_task_group() as tg:
        scope_tg = tg
        tg.start_soon(stop_on_signal, tg.cancel_scope)
        for w in workers:
            tg.start_soon(w.start)
    print(f"agent {name!r}: stopped", flush=True)


async def _live(worker: object) -> int:
    """Runs whose process is alive (launch workers), else what the worker counts as running (kubernetes)."""
    live = getattr(worker, "live", None)
    return await live() if live is not None else worker.running()  # type: ignore[attr-defined]


async def _server_problem(timeout_s: Optional[float] = None) -> Optional[Exception]:
    """Why the Prefect server does not answer its hello (None: it answers)."""
    from prefect import get_client

    try:
        with anyio.fail_after(timeout_s):
            async with get_client() as client:
                await client.hello()
        return None
    except Exception as exc:
        return exc


async def _server_answers(timeout_s: float = 2.0) -> bool:
    """For a stopping agent: Prefect's client would retry a refused connection for a minute."""
    return await _server_problem(timeout_s) is None


async def _wait_for_server(retry_s: float = 3.0) -> None:
    """An agent started before its server (or during an outage) waits for it instead of exiting."""
    told = False
    while (exc := await _server_problem()) is not None:
        if not told:
            print(f"agent: waiting for the Prefect server at {os.environ.get('PREFECT_API_URL')} "
                  f"({type(exc).__name__}); retrying every {retry_s:g} s - Ctrl-C to give up", flush=True)
            told = True
        await anyio.sleep(retry_s)
    if told:
        print("agent: the Prefect server answers; starting", flush=True)


def run_agent(queues: list[str], name: Optional[str] = None, capacity: Optional[str] = None,
              use_cgroups: bool = True, on_exit: str = "drain", advertise_address: Optional[str] = None) -> None:
    """Block serving ``queues`` until interrupted.

    The first SIGINT/SIGTERM drains (``on_exit="drain"``, the default) or cancels (``"cancel"``)
    the running runs; a second one cancels them. A SIGKILLed agent leaves its runs running:
    the next start re-adopts them from its journal and Prefect.
    """
    detect_capacity(capacity)  # fail fast on a malformed --capacity
    if advertise_address:
        try:
            advertise_address = check_address(advertise_address)  # and on a malformed --advertise-address
        except ValueError as exc:
            raise LookupError(str(exc)) from None
    if on_exit not in ("drain", "cancel"):
        raise LookupError(f"--on-exit must be 'drain' or 'cancel', got {on_exit!r}")
    started: dict = {}
    try:
        anyio.run(_serve, queues, name or socket.gethostname(), capacity, use_cgroups, on_exit, started,
                  advertise_address)
    except KeyboardInterrupt:
        pass
    finally:
        _deliver_and_exit(started.get("agent"), 1.0 if started.get("server_gone") else DELIVER_S)


def _deliver_and_exit(agent: Optional[AgentContext], within_s: float = DELIVER_S) -> None:
    """What the agent holds for its stores goes out before the process ends, each part bounded.

    The scheduling history goes to the metrics store. Prefect's event and log workers would otherwise
    drain at interpreter exit without a time limit, retrying a server that is gone: an agent stopped
    during an outage then hung until killed. Undeliverable events and logs are dropped with a line
    saying so, and the process ends at once.
    """
    history = getattr(agent, "history", None)
    if history is not None:
        history.close(DELIVER_S)  # a local store: the full bound even when the server is gone
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    undelivered = []
    for service in (EventsWorker, APILogWorker):
        try:
            _, pending = service.drain_all(timeout=within_s)  # type: ignore[misc]
        except Exception:  # pragma: no cover - a Prefect without these services: its own exit applies
            continue
        if pending:
            undelivered.append("events" if service is EventsWorker else "logs")
    if undelivered:
        print(f"agent: {' and '.join(undelivered)} not delivered to the Prefect server at "
              f"{os.environ.get('PREFECT_API_URL')} within {within_s:g} s (it does not answer); dropped", flush=True)
        sys.stderr.flush()
        os._exit(0)
