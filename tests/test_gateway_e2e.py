"""The gateway in front of a real Prefect server (issue 40 section 2): `prefect-launch gateway` in its own
process on a free loopback port, and Prefect's own client talking to it with PREFECT_API_URL = the gateway
and PREFECT_API_KEY = a user's key. The rules' decisions alone: test_gateway_units.py."""

from __future__ import annotations

import os
from contextlib import contextmanager

import httpx
import pytest

from launch_helpers import CLI, wait_for
from prefect_launch.blocks.identity_repository import IdentityRepository
from prefect_launch.local_server import background_process, free_port


@pytest.fixture(scope="module")
def gw(prefect_server, tmp_path_factory):
    """Users alice (project vision), bob and root (admin); an open and a closed queue with a deployment each;
    the gateway serving them."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    tmp = tmp_path_factory.mktemp("gateway")
    url = f"sqlite:///{tmp / 'identity.db'}"
    repo = IdentityRepository(url)
    repo.add_project("vision")
    repo.add_project("secret")
    keys = {name: repo.add_user(name, role=role, projects=projects)[1]
            for name, role, projects in [("alice", "user", ["vision"]), ("bob", "user", []), ("root", "admin", [])]}
    suffix = os.urandom(4).hex()
    deployments = {}
    with get_client(sync_client=True) as client:  # straight to the server
        flow_id = client.create_flow_from_name(f"gw-flow-{suffix}")
        for kind in ("open", "closed"):
            pool = f"gw-{kind}-{suffix}"
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            deployments[kind] = client.create_deployment(flow_id=flow_id, name=f"gw-{kind}", work_pool_name=pool)
    repo.set_queue_access(f"gw-closed-{suffix}", projects=["secret"])
    port = free_port()
    env = {**os.environ, "LAUNCH_METRICS_URL": url, "PREFECT_API_URL": prefect_server}
    env.pop("PREFECT_API_KEY", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    log = tmp / "gateway.log"
    with background_process([*CLI, "gateway", "--port", str(port), "--upstream", prefect_server], log, env=env):
        base = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(f"{base}/api/health", timeout=2).status_code == 401
            except httpx.HTTPError:
                return False

        wait_for(up, 30, lambda: f"the gateway did not start:\n{log.read_text()[-3000:]}")
        yield {"api": f"{base}/api", "keys": keys, "flow_id": flow_id, "closed_pool": f"gw-closed-{suffix}", "deployments": deployments, "repo": repo, "log": log}


@contextmanager
def client_as(gw, key):
    """Prefect's sync client with PREFECT_API_URL at the gateway and PREFECT_API_KEY = ``key``."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: gw["api"], PREFECT_API_KEY: key}):
        with get_client(sync_client=True) as client:
            yield client


def direct():
    from prefect import get_client

    return get_client(sync_client=True)


def test_a_valid_key_reads_and_launches_as_its_user(gw):
    with client_as(gw, gw["keys"]["alice"]) as client:
        names = {d.name for d in client.read_deployments()}
        assert {"gw-open", "gw-closed"} <= names
        run = client.create_flow_run_from_deployment(gw["deployments"]["open"], tags=["owner:bob", "keep"])
    with direct() as client:
        tags = set(client.read_flow_run(run.id).tags)
    assert {"owner:alice", "project:vision", "keep"} <= tags and "owner:bob" not in tags


def test_a_wrong_or_missing_key_gets_401_and_failures_are_limited(gw):
    from prefect.exceptions import PrefectHTTPStatusError

    wrong = gw["keys"]["alice"][:-2] + ("xy" if not gw["keys"]["alice"].endswith("xy") else "zz")
    with client_as(gw, wrong) as client:
        with pytest.raises(PrefectHTTPStatusError) as exc:
            client.read_deployments()
    assert exc.value.response.status_code == 401
    r = httpx.post(f"{gw['api']}/deployments/filter", json={})
    assert r.status_code == 401 and "API key is required" in r.json()["detail"]
    basic = httpx.post(f"{gw['api']}/deployments/filter", json={}, auth=("bob", gw["keys"]["alice"]))
    assert basic.status_code == 401  # alice's key is not bob's
    assert httpx.post(f"{gw['api']}/deployments/filter", json={}, auth=("alice", gw["keys"]["alice"])).status_code == 200
    assert gw["keys"]["alice"] not in gw["log"].read_text()


def test_a_queue_not_open_to_the_user_is_refused_and_an_admin_launches_on_behalf(gw):
    from prefect.exceptions import PrefectHTTPStatusError

    dep = gw["deployments"]["closed"]
    with client_as(gw, gw["keys"]["alice"]) as client:
        with pytest.raises(PrefectHTTPStatusError) as exc:
            client.create_flow_run_from_deployment(dep)
    assert exc.value.response.status_code == 403
    assert "is not open to user 'alice'" in exc.value.response.json()["detail"]
    # a run made directly (POST /flow_runs/) on the closed queue, by its name or its deployment
    flow_id = str(gw["flow_id"])
    for extra in ({"work_pool_name": gw["closed_pool"]}, {"deployment_id": str(dep)}):
        r = httpx.post(f"{gw['api']}/flow_runs/", json={"flow_id": flow_id, "name": "sneaky", **extra},
                       headers={"Authorization": f"Bearer {gw['keys']['alice']}"})
        assert r.status_code == 403 and "is not open to user 'alice'" in r.json()["detail"], r.text
    with client_as(gw, gw["keys"]["root"]) as client:
        run = client.create_flow_run_from_deployment(dep, tags=["owner:alice"])
    with direct() as client:
        assert {"owner:alice", "launched_by:root"} <= set(client.read_flow_run(run.id).tags)


def test_another_users_run_cannot_be_cancelled_or_renamed(gw):
    from prefect.client.schemas.actions import FlowRunUpdate
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.states import Cancelled, Cancelling

    with client_as(gw, gw["keys"]["alice"]) as client:
        run = client.create_flow_run_from_deployment(gw["deployments"]["open"])
    with client_as(gw, gw["keys"]["bob"]) as client:
        with pytest.raises(PrefectHTTPStatusError) as exc:
            client.set_flow_run_state(run.id, Cancelling())
        assert exc.value.response.status_code == 403
        assert "user 'bob' may not cancel 'alice''s run" in exc.value.response.json()["detail"]
        with pytest.raises(PrefectHTTPStatusError) as exc:
            client.update_flow_run(run.id, name="mine-now")
        assert exc.value.response.status_code == 403
    with direct() as client:
        unchanged = client.read_flow_run(run.id)
    assert unchanged.state.type.value == "SCHEDULED" and unchanged.name == run.name
    with client_as(gw, gw["keys"]["alice"]) as client:  # the owner may (a scheduled run is cancelled at once)
        assert client.set_flow_run_state(run.id, Cancelled()).status.value == "ACCEPT"
    with direct() as client:
        assert client.read_flow_run(run.id).state.type.value == "CANCELLED"


def test_events_websockets_go_through_with_prefects_auth_message(gw):
    """A subscriber on /api/events/out and an emitter on /api/events/in, both through the gateway with
    PREFECT_API_AUTH_STRING=user:key (the token of Prefect's auth message); a wrong token is closed."""
    import asyncio

    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient, PrefectEventSubscriber
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    name = f"gw.test.{os.urandom(4).hex()}"

    async def roundtrip():
        flt = EventFilter(event=EventNameFilter(name=[name]))
        async with PrefectEventSubscriber(api_url=gw["api"], filter=flt) as sub:
            async with PrefectEventsClient(api_url=gw["api"]) as emitter:
                await emitter.emit(Event(event=name, resource={"prefect.resource.id": "gw.test"}))
            return await asyncio.wait_for(sub.__anext__(), 20)

    async def wrong_token():
        ws_url = gw["api"].replace("http://", "ws://") + "/events/in"
        async with connect(ws_url, subprotocols=["prefect"]) as ws:
            await ws.send('{"type": "auth", "token": "bob:plk_000000000000_wrongwrongwrongwrongwrong"}')
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
        return closed.value.rcvd.code

    with temporary_settings(updates={PREFECT_API_URL: gw["api"],
                                     PREFECT_API_AUTH_STRING: f"alice:{gw['keys']['alice']}"}):
        got = asyncio.run(roundtrip())
    assert got.event == name
    assert asyncio.run(wrong_token()) == 1008
