"""The gateway's cost (issue 40 section 4): our path (through `prefect-launch gateway`, with a user's key) and
stock Prefect (straight to the server), in one run, on one throw-away server.

- submit: ``create_flow_run_from_deployment`` with Prefect's client, direct and through the gateway taking
  turns (the gateway checks the key, reads the deployment's queue and its access rows, rewrites the tags);
  the runs land on a pool no worker serves, so nothing else runs meanwhile;
- dispatch: a launch agent straight on the server with runs submitted there, then one through the gateway
  with an agent key (PREFECT_API_AUTH_STRING=box:key) and runs a user submits through the gateway; each
  run's server-side start time minus its creation;
- events: one emitter and one subscriber on the events websockets, direct and through the gateway; events
  per second from the first emit to the last event received.

    .venv/bin/python bench/gateway.py [--submits 60] [--runs 10] [--gap 1.0] [--events 1000]

Last line: one JSON object with submit_p50_direct_s, submit_p50_gateway_s, overhead_p50_ms,
dispatch_p50_gateway_s, events_per_s_direct, events_per_s_gateway (and the ratios). Goals: overhead <= 20 ms,
dispatch <= 1 s at p50, events through the gateway >= 80 % of direct. SIGTERM, SIGHUP or Ctrl-C stop the
server, the gateway and the agent it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stack import (LAUNCH_QUEUE, ROOT, STOCK_POOL, background, percentile, prefect_server, stop_on_signals,  # noqa: E402
                    stock_and_launch_pools)


def deploy(pool: str, name: str) -> str:
    from prefect import flow

    flow.from_source(source=str(ROOT / "bench"), entrypoint="trivial_flow.py:trivial").deploy(
        name=name, work_pool_name=pool, build=False, push=False, print_next_steps=False)
    return f"trivial/{name}"


def gateway(upstream: str, store_url: str, logs: Path):
    """`prefect-launch gateway` on a free loopback port (a context manager yielding its API URL)."""
    import contextlib

    import httpx

    from prefect_launch.local_server import free_port

    @contextlib.contextmanager
    def run():
        port = free_port()
        env = {**os.environ, "LAUNCH_METRICS_URL": store_url}
        env.pop("PREFECT_API_KEY", None)
        args = [sys.executable, "-m", "prefect_launch.cli", "gateway", "--port", str(port), "--upstream", upstream]
        with background(args, logs / "gateway.log", env=env):
            api = f"http://127.0.0.1:{port}/api"
            deadline = time.time() + 60
            while True:
                try:
                    if httpx.get(f"{api}/health", timeout=2).status_code == 401:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"the gateway did not start; see {logs / 'gateway.log'}")
                time.sleep(0.3)
            yield api
    return run()


def measure_submits(direct_api: str, gw_api: str, key: str, deployment: str, n: int) -> tuple[list[float], list[float]]:
    """Seconds per ``create_flow_run_from_deployment``, direct and through the gateway, taking turns."""
    from prefect.client.orchestration import SyncPrefectClient

    direct_s, gw_s = [], []
    with SyncPrefectClient(direct_api) as direct, SyncPrefectClient(gw_api, api_key=key) as through:
        dep = direct.read_deployment_by_name(deployment).id
        for client in (direct, through):  # warm: connections, the gateway's key cache
            for _ in range(3):
                client.create_flow_run_from_deployment(dep)
        for i in range(n):
            for client, out in ((direct, direct_s), (through, gw_s)) if i % 2 == 0 else ((through, gw_s), (direct, direct_s)):
                t = time.perf_counter()
                client.create_flow_run_from_deployment(dep, parameters={"i": i})
                out.append(time.perf_counter() - t)
    return direct_s, gw_s


def wait_agent_online(direct_api: str, name: str, timeout: float = 180) -> None:
    from prefect.client.orchestration import SyncPrefectClient

    from prefect_launch.workers.agent.registry import read_agents_sync

    deadline = time.time() + timeout
    with SyncPrefectClient(direct_api) as client:
        while time.time() < deadline:
            if any(a.name == name and a.online() for a in read_agents_sync(client)):
                return
            time.sleep(0.5)
    raise RuntimeError(f"agent {name} did not come online in {timeout:.0f} s")


def measure_dispatch(api: str, key: str | None, direct_api: str, deployment: str, runs: int,
                     gap: float) -> tuple[list[float], list[float]]:
    """Submit -> Running, and submit -> claimed (Pending; the agent's pickup, apart from the job's start-up):
    submitted on ``api`` (with the user's ``key`` through the gateway), run by the agent serving the queue;
    read straight from the server."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api, api_key=key) as through, SyncPrefectClient(direct_api) as direct:
        dep = through.read_deployment_by_name(deployment).id
        ids = []
        for i in range(runs):
            ids.append(through.create_flow_run_from_deployment(dep, parameters={"i": i}).id)
            time.sleep(gap)
        deadline = time.time() + 120 + runs * 5
        while time.time() < deadline:
            frs = [direct.read_flow_run(i) for i in ids]
            if all(fr.start_time for fr in frs):
                break
            time.sleep(0.5)
        out = [(fr.start_time - fr.created).total_seconds() for fr in frs if fr.start_time]
        claims = []
        for fr in frs:
            pend = [st.timestamp for st in direct.read_flow_run_states(fr.id) if st.name == "Pending"]
            if pend:
                claims.append((pend[0] - fr.created).total_seconds())
    if len(out) < runs:
        print(f"warning: {runs - len(out)} runs submitted on {api} never started", file=sys.stderr)
    return out, claims


def dispatch(api: str, auth_string: str | None, user_key: str | None, direct_api: str, deployment: str,
             runs: int, gap: float, logs: Path, name: str) -> tuple[list[float], list[float]]:
    """A launch agent on ``api`` (with an agent key's auth string through the gateway) and its runs' dispatch."""
    env = {**os.environ, "PREFECT_API_URL": api}
    env.pop("PREFECT_API_KEY", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    if auth_string:
        env["PREFECT_API_AUTH_STRING"] = auth_string
    agent = [sys.executable, "-m", "prefect_launch.cli", "agent", "--queue", LAUNCH_QUEUE, "--name", name,
             "--capacity", "cpu=2,memory=8Gi"]
    with background(agent, logs / f"agent-{name}.log", env=env):
        wait_agent_online(direct_api, name)
        time.sleep(2)
        return measure_dispatch(api, user_key, direct_api, deployment, runs, gap)


WINDOW = 100  # events in flight at most: the server drops a subscriber's events past a backlog of 256


async def _events_rate(api_url: str, n: int) -> tuple[float, int]:
    """Events per second from the first emit to the last receipt, ``WINDOW`` emitted then waited for."""
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient, PrefectEventSubscriber
    from prefect.events.filters import EventFilter, EventNameFilter

    name = f"bench.gateway.{uuid.uuid4().hex[:8]}"
    got = 0
    async with PrefectEventSubscriber(api_url=api_url, filter=EventFilter(event=EventNameFilter(name=[name]))) as sub:
        async with PrefectEventsClient(api_url=api_url) as emitter:

            async def receive(upto: int) -> None:
                nonlocal got
                while got < upto:
                    await sub.__anext__()
                    got += 1

            t = time.perf_counter()
            sent = 0
            try:
                while sent < n:
                    batch = min(WINDOW, n - sent)
                    for i in range(batch):
                        await emitter.emit(Event(event=name, resource={"prefect.resource.id": f"bench.{sent + i}"}))
                    sent += batch
                    await asyncio.wait_for(receive(sent), 30)
            except asyncio.TimeoutError:
                print(f"warning: {sent - got} of {sent} events not received on {api_url}", file=sys.stderr)
            dt = time.perf_counter() - t
    return got / dt, got


def events_rate(api_url: str, n: int, auth_string: str | None) -> float:
    import contextlib

    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

    with (temporary_settings(updates={PREFECT_API_AUTH_STRING: auth_string}) if auth_string
          else contextlib.nullcontext()):
        rate, _ = asyncio.run(_events_rate(api_url, n))
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--submits", type=int, default=60, help="submissions per path")
    ap.add_argument("--runs", type=int, default=10, help="runs dispatched through the gateway")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between dispatched submissions")
    ap.add_argument("--events", type=int, default=1000, help="events per path")
    args = ap.parse_args()
    stop_on_signals()
    from prefect_launch.blocks.identity_repository import IdentityRepository

    logs = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    store_url = f"sqlite:///{logs / 'identity.db'}"
    repo = IdentityRepository(store_url)
    _, user_key = repo.add_user("alice")
    _, agent_key = repo.add_user("box", role="agent")
    with prefect_server() as direct_api:
        stock_and_launch_pools(logs)
        idle_dep = deploy(STOCK_POOL, "idle")  # no worker serves it: the submit runs just wait
        ours_dep = deploy(LAUNCH_QUEUE, "ours")
        with gateway(direct_api, store_url, logs) as gw_api:
            direct_s, gw_s = measure_submits(direct_api, gw_api, user_key, idle_dep, args.submits)
            ev_direct = events_rate(direct_api, args.events, None)
            ev_gw = events_rate(gw_api, args.events, f"alice:{user_key}")
            dispatch_direct, claim_direct = dispatch(direct_api, None, None, direct_api, ours_dep, args.runs,
                                                     args.gap, logs, "bench-direct")
            dispatch_gw, claim_gw = dispatch(gw_api, f"box:{agent_key}", user_key, direct_api, ours_dep, args.runs,
                                             args.gap, logs, "bench-gateway")

    p50_direct, p50_gw = statistics.median(direct_s), statistics.median(gw_s)
    figures = {
        "submits": args.submits,
        "submit_p50_direct_s": round(p50_direct, 4),
        "submit_p50_gateway_s": round(p50_gw, 4),
        "submit_p95_direct_s": round(percentile(direct_s, 0.95), 4),
        "submit_p95_gateway_s": round(percentile(gw_s, 0.95), 4),
        "overhead_p50_ms": round((p50_gw - p50_direct) * 1000, 1),
        "submit_ratio_p50": round(p50_gw / p50_direct, 2),
        "runs": args.runs,
        "dispatch_p50_direct_s": round(statistics.median(dispatch_direct), 3) if dispatch_direct else None,
        "dispatch_p50_gateway_s": round(statistics.median(dispatch_gw), 3) if dispatch_gw else None,
        "dispatch_p95_gateway_s": round(percentile(dispatch_gw, 0.95), 3) if dispatch_gw else None,
        "claim_p50_direct_s": round(statistics.median(claim_direct), 3) if claim_direct else None,
        "claim_p50_gateway_s": round(statistics.median(claim_gw), 3) if claim_gw else None,
        "events": args.events,
        "events_per_s_direct": round(ev_direct, 1),
        "events_per_s_gateway": round(ev_gw, 1),
        "events_ratio": round(ev_gw / ev_direct, 2) if ev_direct else None,
    }
    print(f"gateway vs direct on one server (logs in {logs}); load average at the end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"  submit (create_flow_run_from_deployment), {args.submits} each, taking turns:")
    print(f"    direct  : p50 {p50_direct * 1000:.1f} ms  p95 {figures['submit_p95_direct_s'] * 1000:.1f} ms")
    print(f"    gateway : p50 {p50_gw * 1000:.1f} ms  p95 {figures['submit_p95_gateway_s'] * 1000:.1f} ms"
          f"  (overhead p50 {figures['overhead_p50_ms']:.1f} ms, ratio {figures['submit_ratio_p50']:.2f}x; goal <= 20 ms)")
    if dispatch_gw and dispatch_direct:
        print(f"  dispatch (submit -> Running), {args.runs} runs each, one every {args.gap:g} s:")
        print(f"    direct  : p50 {figures['dispatch_p50_direct_s']:.2f} s  (claimed after p50 "
              f"{figures['claim_p50_direct_s']} s)")
        print(f"    gateway : p50 {figures['dispatch_p50_gateway_s']:.2f} s  p95 {figures['dispatch_p95_gateway_s']:.2f} s"
              f"  (claimed after p50 {figures['claim_p50_gateway_s']} s; goal <= 1 s at p50)")
    print(f"  events, {args.events} emitted and received: direct {ev_direct:.0f}/s, gateway {ev_gw:.0f}/s"
          f"  (ratio {figures['events_ratio']}; goal >= 0.8)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
