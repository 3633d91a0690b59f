"""The gateway in front of a real Prefect server (issue 40 section 2): `prefect-launch gateway` in its own
process on a free loopback port, and Prefect's own client talking to it with PREFECT_API_URL = the gateway
and PREFECT_API_KEY = a user's key. The rules' decisions alone: test_gateway_units.py."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from launch_helpers import CLI, wait_for
from prefect_launch.blocks.identity_repository import IdentityRepository
from prefect_launch.local_server import background_process, free_port


MAX_BODY = 2 << 20


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
            for name, role, projects in [("alice", "user", ["vision"]), ("bob", "user", []), ("root", "admin", []),
                                         ("carol", "user", []), ("dave", "user", []), ("box-1", "agent", [])]}
    keys["carol-old"] = keys["carol"]
    keys["carol"] = repo.rotate_key("carol")  # the old key is revoked
    repo.set_disabled("dave")
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
    env = {**os.environ, "LAUNCH_METRICS_URL": url, "PREFECT_API_URL": prefect_server,
           "LAUNCH_GATEWAY_MAX_BODY_BYTES": str(MAX_BODY)}
    env.pop("PREFECT_API_KEY", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    log = tmp / "gateway.log"
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(f"{base}/api/health", timeout=2).status_code == 401
        except httpx.HTTPError:
            return False

    with ExitStack() as stack:
        procs = []

        def start() -> Path:
            """Start the gateway on its port (again); returns its log."""
            path = log if not procs else tmp / f"gateway-{len(procs) + 1}.log"
            procs.append(stack.enter_context(background_process(
                [*CLI, "gateway", "--port", str(port), "--upstream", prefect_server], path, env=env)))
            wait_for(up, 30, lambda: f"the gateway did not start:\n{path.read_text()[-3000:]}")
            return path

        def kill() -> None:
            """SIGKILL the gateway, as a crash or an out-of-memory kill would: no goodbye to its clients."""
            os.killpg(procs[-1].pid, signal.SIGKILL)
            procs[-1].wait(10)
            assert not up()

        start()
        yield {"api": f"{base}/api", "keys": keys, "flow_id": flow_id, "closed_pool": f"gw-closed-{suffix}", "deployments": deployments, "repo": repo, "log": log,
               "store_url": url, "start": start, "kill": kill}


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
    assert raw_request("POST", f"{gw['api']}/deployments/filter", json={},
                       auth=("alice", gw["keys"]["alice"])).status_code == 200
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
    with direct() as client:
        open_pool = client.read_deployment(gw["deployments"]["open"]).work_pool_name
    for extra in ({"work_pool_name": gw["closed_pool"]}, {"deployment_id": str(dep)},
                  {"deployment_id": str(dep), "work_pool_name": open_pool}):  # an open pool, a closed deployment
        r = httpx.post(f"{gw['api']}/flow_runs/", json={"flow_id": flow_id, "name": "sneaky", **extra},
                       headers={"Authorization": f"Bearer {gw['keys']['alice']}"})
        assert r.status_code == 403 and "is not open to user 'alice'" in r.json()["detail"], r.text
    with client_as(gw, gw["keys"]["root"]) as client:
        run = client.create_flow_run_from_deployment(dep, tags=["owner:alice"])
    with direct() as client:
        assert {"owner:alice", "launched_by:root"} <= set(client.read_flow_run(run.id).tags)


def test_another_users_run_cannot_be_cancelled_or_renamed(gw):
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


# ---------------------------------------------------------------------------------------------------------
# Bad input and attacks (issue 40 section 3): each request through the gateway gets its status and a message
# naming what is missing, and changes nothing (read back from the server directly).

ATTACK = "gw-attack"


@pytest.fixture(scope="module")
def scene(gw):
    """alice's scheduled run, a Secret block, alice's session token (a Secret named for her run)."""
    from prefect.blocks.system import Secret

    sfx = os.urandom(4).hex()
    with client_as(gw, gw["keys"]["alice"]) as client:
        run = client.create_flow_run_from_deployment(gw["deployments"]["open"], name=f"alice-run-{sfx}")
    secret_value, token_value = f"s3cret-{sfx}", f"tok-{sfx}"
    secret_id = Secret(value=secret_value).save(f"gw-secret-{sfx}")  # straight to the server
    Secret(value=token_value).save(f"session-token-{run.id}")
    with direct() as client:
        pool = client.read_deployment(gw["deployments"]["open"]).work_pool_name
    return {"run": str(run.id), "run_name": run.name, "secret": f"gw-secret-{sfx}", "secret_id": str(secret_id),
            "secret_value": secret_value, "token": f"session-token-{run.id}", "token_value": token_value,
            "pool": pool, "deployment": str(gw["deployments"]["open"]), "flow_id": str(gw["flow_id"])}


def raw_request(method: str, url: str, **kw) -> httpx.Response:
    """A raw httpx request, with the one retry Prefect's own client makes here: a 503. The session's
    server runs on SQLite, and a write that finds the database locked (busy under load) is answered 503
    {"exception_message": "Service Unavailable"} by Prefect itself, which the gateway passes on as is;
    Prefect's client retries it with backoff, and so does this, 4 times at most (0.5 to 4 s apart),
    then the last answer stands. Any other status (the gateway's 401/403/429 included) is returned at once."""
    for attempt in range(4):
        r = httpx.request(method, url, **kw)
        if r.status_code != 503:
            return r
        time.sleep(0.5 * 2 ** attempt)
    return httpx.request(method, url, **kw)


def call(gw, who, method, path, **kw):
    headers = {"Authorization": f"Bearer {gw['keys'][who]}"} if who else {}
    return raw_request(method, gw["api"] + path, headers=headers, timeout=30, **kw)


def run_unchanged(scene):
    with direct() as client:
        run = client.read_flow_run(scene["run"])
    assert run.state.type.value == "SCHEDULED" and run.name == scene["run_name"]
    assert "owner:alice" in run.tags and not any(k.startswith("launch.alloc") for k in (run.labels or {}))


def nothing_made(scene):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.exceptions import ObjectNotFound

    with direct() as client:
        with pytest.raises(ObjectNotFound):
            client.read_work_pool(ATTACK)
        with pytest.raises(ObjectNotFound):
            client.read_block_document_by_name(ATTACK, block_type_slug="secret")
        assert client.read_variable_by_name(ATTACK) is None
        assert not client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[ATTACK])))


def pool_unchanged(scene):
    with direct() as client:
        pool = client.read_work_pool(scene["pool"])
    assert pool.description != ATTACK and not pool.is_paused


def secret_unchanged(scene):
    from prefect.blocks.system import Secret

    assert Secret.load(scene["secret"]).get() == scene["secret_value"]


def deployment_unchanged(scene):
    with direct() as client:
        assert client.read_deployment(scene["deployment"]).description != ATTACK


def _secret_body(scene):
    return {"block_document": {"name": ATTACK, "data": {"value": "x"}}}


# who, method, path, request (json/params), status, words in the message, what must be unchanged
ATTACKS = {
    "no key": (None, "POST", "/flow_runs/", {"json": {"flow_id": "{flow_id}", "name": ATTACK}}, 401,
               "API key is required", nothing_made),
    "wrong key": ("wrong", "POST", "/flow_runs/", {"json": {"flow_id": "{flow_id}", "name": ATTACK}}, 401,
                  "not valid", nothing_made),
    "revoked key": ("carol-old", "POST", "/flow_runs/", {"json": {"flow_id": "{flow_id}", "name": ATTACK}}, 401,
                    "not valid", nothing_made),
    "disabled user": ("dave", "POST", "/flow_runs/", {"json": {"flow_id": "{flow_id}", "name": ATTACK}}, 401,
                      "not valid", nothing_made),
    "project not theirs": ("bob", "POST", "/flow_runs/",
                           {"json": {"flow_id": "{flow_id}", "name": ATTACK, "tags": ["project:vision"]}}, 403,
                           "not a member of project 'vision'", nothing_made),
    "cancel another's run": ("bob", "POST", "/flow_runs/{run}/set_state",
                             {"json": {"state": {"type": "CANCELLING"}, "force": True}}, 403,
                             "may not cancel 'alice''s run", run_unchanged),
    "rename another's run": ("bob", "PATCH", "/flow_runs/{run}", {"json": {"name": ATTACK}}, 403,
                             "may not rename or change 'alice''s run", run_unchanged),
    "relabel another's run": ("bob", "PATCH", "/flow_runs/{run}/labels", {"json": {"x": "y"}}, 403,
                              "may not relabel 'alice''s run", run_unchanged),
    "delete another's run": ("bob", "DELETE", "/flow_runs/{run}", {}, 403, "may not delete 'alice''s run",
                             run_unchanged),
    "bulk cancel": ("bob", "POST", "/flow_runs/bulk_set_state",
                    {"json": {"flow_run_ids": ["{run}"], "state": {"type": "CANCELLING"}, "force": True}}, 403,
                    "only admins", run_unchanged),
    "bulk delete": ("bob", "POST", "/flow_runs/bulk_delete", {"json": {"flow_runs": {"id": {"any_": ["{run}"]}}}},
                    403, "only admins", run_unchanged),
    "bulk create as another owner": ("bob", "POST", "/deployments/{deployment}/create_flow_run/bulk",
                                     {"json": [{"name": ATTACK, "tags": ["owner:alice"]}]}, 403, "only admins",
                                     nothing_made),
    "agent label on own run": ("alice", "PATCH", "/flow_runs/{run}/labels", {"json": {"launch.alloc": "gpu=8"}},
                               403, "may not set the label 'launch.alloc'", run_unchanged),
    "agent label at creation": ("alice", "POST", "/flow_runs/",
                                {"json": {"flow_id": "{flow_id}", "name": ATTACK,
                                          "labels": {"launch.placement": "box-9"}}}, 403,
                                "may not set the label 'launch.placement'", nothing_made),
    "create a queue": ("alice", "POST", "/work_pools/", {"json": {"name": ATTACK, "type": "process"}}, 403,
                       "may not create, change or delete queues", nothing_made),
    "change queue config": ("alice", "PATCH", "/work_pools/{pool}",
                            {"json": {"description": ATTACK, "base_job_template": {}}}, 403,
                            "may not create, change or delete queues", pool_unchanged),
    "pause a queue": ("alice", "PATCH", "/work_pools/{pool}", {"json": {"is_paused": True}}, 403,
                      "only admins", pool_unchanged),
    "delete a queue": ("alice", "DELETE", "/work_pools/{pool}", {}, 403, "only admins", pool_unchanged),
    "pose as a worker": ("alice", "POST", "/work_pools/{pool}/workers/heartbeat", {"json": {"name": ATTACK}}, 403,
                         "only admins (and agents)", pool_unchanged),
    "change a deployment": ("alice", "PATCH", "/deployments/{deployment}", {"json": {"description": ATTACK}}, 403,
                            "may not create, change or delete deployments", deployment_unchanged),
    "create a block": ("alice", "POST", "/block_documents/",
                       {"json": {"name": ATTACK, "data": {"value": "x"}, "block_type_id": "{flow_id}",
                                 "block_schema_id": "{flow_id}"}}, 403, "may not create, change or delete blocks",
                       nothing_made),
    "overwrite a Secret": ("alice", "PATCH", "/block_documents/{secret_id}", {"json": {"data": {"value": "x"}}}, 403,
                           "only admins", secret_unchanged),
    "delete a Secret": ("alice", "DELETE", "/block_documents/{secret_id}", {}, 403, "only admins", secret_unchanged),
    "create an automation": ("alice", "POST", "/automations/", {"json": {"name": ATTACK}}, 403,
                             "may not create, change or delete automations", nothing_made),
    "another's variable": ("alice", "POST", "/variables/", {"json": {"name": ATTACK, "value": 1}}, 403,
                           "may not create, change or delete variable 'gw-attack'", nothing_made),
    "read server settings": ("alice", "GET", "/admin/settings", {}, 403, "only admins", None),
    "read a Secret's value": ("bob", "GET", "/block_types/slug/secret/block_documents/name/{secret}",
                              {"params": {"include_secrets": "true"}}, 403,
                              "may not read the value of Secret block", secret_unchanged),
    "read another's session token": ("bob", "GET", "/block_types/slug/secret/block_documents/name/{token}",
                                     {"params": {"include_secrets": "true"}}, 403,
                                     "(the session of 'alice')", secret_unchanged),
    "create a run over the size limit": ("alice", "POST", "/flow_runs/",
                                         {"json": {"flow_id": "{flow_id}", "name": ATTACK,
                                                   "parameters": {"x": "y" * (1 << 20)}}}, 413,
                                         "over 1048576 bytes", nothing_made),
    "a body over the gateway's limit": ("root", "POST", "/logs/", {"content": b"[" + b" " * MAX_BODY + b"]"}, 413,
                                        "LAUNCH_GATEWAY_MAX_BODY_BYTES", None),
    "a streamed body over the gateway's limit": ("root", "POST", "/logs/",
                                                 {"content": (b" " * (1 << 20) for _ in range(3))}, 413,
                                                 "LAUNCH_GATEWAY_MAX_BODY_BYTES", None),
}


def _fill(value, scene):
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.format(**scene) if "{" in value else value
    if isinstance(value, list):
        return [_fill(v, scene) for v in value]
    if isinstance(value, dict):
        return {_fill(k, scene): _fill(v, scene) for k, v in value.items()}
    return value


@pytest.mark.parametrize("case", list(ATTACKS), ids=list(ATTACKS))
def test_an_attack_is_refused_with_its_reason_and_changes_nothing(gw, scene, case):
    who, method, path, req, status, words, unchanged = ATTACKS[case]
    keys = {**gw["keys"], "wrong": gw["keys"]["alice"][:-4] + "abcd"}
    r = call({**gw, "keys": keys}, who, method, _fill(path, scene), **_fill(req, scene))
    assert r.status_code == status, r.text[:500]
    assert words in r.json()["detail"], r.json()["detail"]
    if unchanged is not None:
        unchanged(scene)


def test_secret_values_reach_only_admins_agents_and_a_tokens_owner(gw, scene):
    """A plain user's block reads come back masked; the owner reads their session's token; admins and agents
    read any value. Values and keys never reach the gateway's log."""
    by_name = "/block_types/slug/secret/block_documents/name/{}"
    secret = scene["secret_value"]
    masked = [("bob", "GET", f"/block_documents/{scene['secret_id']}", {"params": {"include_secrets": "true"}}),
              ("bob", "POST", "/block_documents/filter", {"json": {"include_secrets": True}}),
              ("bob", "GET", "/block_types/slug/secret/block_documents", {"params": {"include_secrets": "true"}})]
    for who, method, path, req in masked:
        r = call(gw, who, method, path, **req)
        assert r.status_code == 200 and secret not in r.text and scene["token_value"] not in r.text, (path, r.text[:300])
    assert call(gw, "bob", "GET", f"/block_documents/{scene['secret_id']}").json()["name"] == scene["secret"]
    mine = call(gw, "alice", "GET", by_name.format(scene["token"]), params={"include_secrets": "true"})
    assert mine.status_code == 200 and mine.json()["data"]["value"] == scene["token_value"]
    for who in ("root", "box-1"):
        r = call(gw, who, "GET", by_name.format(scene["secret"]), params={"include_secrets": "true"})
        assert r.status_code == 200 and r.json()["data"]["value"] == secret
    with client_as(gw, gw["keys"]["bob"]) as client:  # Prefect's own client: Secret.load gets the mask
        doc = client.read_block_document_by_name(scene["secret"], "secret", include_secrets=False)
        assert doc.name == scene["secret"]
    text = gw["log"].read_text()
    assert secret not in text and scene["token_value"] not in text
    assert not any(k in text for k in gw["keys"].values())


def test_spoofed_owner_tags_are_replaced_and_an_agent_may_change_any_run(gw, scene):
    r = call(gw, "bob", "POST", "/flow_runs/", json={"flow_id": scene["flow_id"], "name": "bob-direct",
                                                      "tags": ["owner:alice", "launched_by:root", "x"],
                                                      "parameters": {"owner": "alice"}})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    with direct() as client:
        tags = set(client.read_flow_run(run_id).tags)
    assert {"owner:bob", "x"} <= tags and not {"owner:alice", "launched_by:root"} & tags
    assert call(gw, "bob", "PATCH", f"/flow_runs/{run_id}", json={"tags": ["owner:alice"]}).status_code == 204
    with direct() as client:
        tags = set(client.read_flow_run(run_id).tags)
    assert "owner:bob" in tags and "owner:alice" not in tags
    r = call(gw, "box-1", "POST", f"/flow_runs/{run_id}/set_state", json={"state": {"type": "CANCELLED"}})
    assert r.status_code in (200, 201) and r.json()["status"] == "ACCEPT", r.text
    assert call(gw, "bob", "POST", "/flow_runs/filter", json={"limit": 1}).status_code == 200  # reads stay open


def test_paths_that_try_to_leave_the_api_get_400(gw):
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(gw["api"])
    for path in ("/api/../api/health", "/api/%2e%2e/admin/settings", "/api/flow_runs/./filter", "/api/..%5c.."):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request("GET", path, headers={"Authorization": f"Bearer {gw['keys']['alice']}"})
        resp = conn.getresponse()
        body = resp.read().decode()
        conn.close()
        assert resp.status == 400 and "'.' or '..'" in body, (path, resp.status, body)


def test_a_websocket_without_prefects_auth_message_is_closed(gw):
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def first(message):
        async with connect(gw["api"].replace("http://", "ws://") + "/events/in", subprotocols=["prefect"]) as ws:
            await ws.send(message)
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
        return closed.value.rcvd

    for message in ('{"type": "event", "event": {}}', "not json", '{"type": "auth"}'):
        rcvd = asyncio.run(first(message))
        assert rcvd.code == 1008 and ("auth message" in rcvd.reason), (message, rcvd)


def test_failed_sign_ins_are_rate_limited_per_address(gw):
    """Another loopback source address (127.0.0.2) fails past the limit and gets 429; 127.0.0.1 still passes."""
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, base_url=gw["api"], timeout=10) as other:
        codes = [other.get("/deployments/", headers={"Authorization": "Bearer plk_nope_nope"}).status_code
                 for _ in range(21)]
        blocked = other.get("/health", headers={"Authorization": f"Bearer {gw['keys']['alice']}"})
    assert codes[:20] == [401] * 20 and codes[20] == 429
    assert blocked.status_code == 429 and "too many failed sign-ins from 127.0.0.2" in blocked.json()["detail"]
    assert int(blocked.headers["retry-after"]) > 0
    assert call(gw, "alice", "GET", "/health").status_code == 200


# ---------------------------------------------------------------------------------------------------------
# The CLI and an agent through the gateway (issue 40 section 2): an admin applies a queue and deploys a job
# with the CLI, an agent with an agent key runs it, a user submits and lists with the CLI, all with keys.

@contextmanager
def cli_env(gw, **values):
    """os.environ pointed at the gateway with these PREFECT_* values (the in-process CLI re-reads it)."""
    from launch_helpers import restored_env

    with restored_env("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING"):
        os.environ.pop("PREFECT_API_AUTH_STRING", None)
        os.environ.pop("PREFECT_API_KEY", None)
        os.environ.update({"PREFECT_API_URL": gw["api"], **values})
        import prefect.context

        prefect.context.refresh_global_settings_context()
        yield


def job_credentials_are_its_runs_own(gw, scene, run_id, env_file):
    """What bob's job finds in its environment: a key of its own run acting as bob, not the agent's key; with it,
    alice's session token, a Secret's value, cancelling alice's run and minting run keys are refused (403), its
    own run reads, and it writes its own session's token only. Returns a caller with those credentials."""
    import json

    wait_for(env_file.exists, 60, "the job did not write its environment")
    found = json.loads(env_file.read_text())
    agent_key = gw["keys"]["box-1"]
    assert not any(agent_key in v for v in found["environ"].values()) and agent_key not in found["proc_environ"]
    user, _, key = found["environ"]["PREFECT_API_AUTH_STRING"].partition(":")
    assert user == "bob" and key.startswith("plk_") and key not in gw["keys"].values()

    def as_job(method, path, **kw):
        return raw_request(method, gw["api"] + path, auth=(user, key), timeout=30, **kw)

    secret = "/block_types/slug/secret/block_documents/name/{}"
    for method, path, kw, words in [
        ("GET", secret.format(scene["token"]), {"params": {"include_secrets": "true"}}, "(the session of 'alice')"),
        ("GET", secret.format(scene["secret"]), {"params": {"include_secrets": "true"}}, "may not read the value"),
        ("POST", f"/flow_runs/{scene['run']}/set_state", {"json": {"state": {"type": "CANCELLING"}, "force": True}},
         "may not cancel 'alice''s run"),
        ("POST", "/launch/run-keys", {"json": {"flow_run_id": scene["run"]}}, "only agents"),
    ]:
        r = as_job(method, path, **kw)
        assert r.status_code == 403 and words in r.json()["detail"], (path, r.status_code, r.text)
    run_unchanged(scene)
    assert as_job("GET", f"/flow_runs/{run_id}").json()["id"] == run_id
    # a session's job stores its token (flows/session.py) and drops it: its own only
    with direct() as client:
        block_type = client.read_block_type_by_slug("secret")
        schema = client.get_most_recent_block_schema_for_block_type(block_type.id)

    def token(name):
        return {"json": {"name": name, "block_type_id": str(block_type.id), "block_schema_id": str(schema.id),
                         "data": {"value": "t"}}}

    theirs = as_job("POST", "/block_documents/", **token(f"session-token-{scene['run']}"))
    assert theirs.status_code == 403 and "only its own session's token" in theirs.json()["detail"], theirs.text
    mine = as_job("POST", "/block_documents/", **token(f"session-token-{run_id}"))
    assert mine.status_code == 201, mine.text
    assert as_job("DELETE", f"/block_documents/{scene['secret_id']}").status_code == 403
    secret_unchanged(scene)
    assert as_job("DELETE", f"/block_documents/{mine.json()['id']}").status_code == 204
    return as_job


def test_the_cli_and_an_agent_work_through_the_gateway_with_keys(gw, scene, tmp_path):
    """An admin's CLI sets up, a user's CLI submits, an agent on an agent key runs the runs, each with a key of its
    own run (not the agent's: a job that tries another user's session token or run is refused, and the key ends
    with its run); then the gateway is killed (SIGKILL) and started again on its port under a running run."""
    from launch_helpers import (apply_queue, cli, cli_json, deploy_probe, records, wait_agent_online, wait_final,
                                wait_running)

    sfx = os.urandom(3).hex()
    with cli_env(gw, PREFECT_API_KEY=gw["keys"]["root"]):  # an admin's CLI sets up the queue and the job
        q = apply_queue(tmp_path, {"name": f"gw-q-{sfx}", "presets": {"tiny": {"cpu": 0.5, "memory": "256Mi"}},
                                   "default_preset": "tiny"})
        job = deploy_probe(q, f"probe-{sfx}")
    with cli_env(gw, PREFECT_API_KEY=gw["keys"]["bob"]):  # a user may not
        refused = cli("queue", "apply", str(tmp_path / f"queues-{q}.yaml"), check=False)
    assert refused.returncode != 0 and "only admins" in refused.stdout + refused.stderr
    agent_env = {**os.environ, "PREFECT_API_URL": gw["api"], "PREFECT_API_AUTH_STRING": f"box-1:{gw['keys']['box-1']}"}
    agent_env.pop("PREFECT_API_KEY", None)
    rec = tmp_path / "records"
    args = [*CLI, "agent", "--name", f"gw-agent-{sfx}", "--capacity", "cpu=2,memory=4Gi", "--queue", q]
    agent_log = tmp_path / "agent.log"
    with background_process(args, agent_log, env=agent_env) as agent:
        wait_agent_online(f"gw-agent-{sfx}", [q], timeout=120)  # an agent starts slowly on a loaded box
        with cli_env(gw, PREFECT_API_KEY=gw["keys"]["alice"]):
            out = cli_json("submit", job, "--queue", q, "--owner", "bob", "--count", "2",
                           "--param", f"record_dir={rec}", "--param", "seconds=0.2")
            listed = {x["name"]: x for x in cli_json("queue", "ls")}
        with cli_env(gw, PREFECT_API_KEY=gw["keys"]["root"]):  # an admin launches on behalf of alice
            for_alice = cli_json("submit", job, "--queue", q, "--owner", "alice",
                                 "--param", f"record_dir={rec}", "--param", "seconds=0.2")["run_ids"]
        runs = wait_final(out["run_ids"] + for_alice, timeout=180)
        with cli_env(gw, PREFECT_API_KEY=gw["keys"]["bob"]):  # runs ls and runs show as another user
            rows = {r["run_id"]: r for r in cli_json("runs", "ls", "--queue", q)}
            shown = cli_json("runs", "show", for_alice[0])

        # the gateway is killed while alice's run runs on the agent, and started again: the CLI says why it
        # cannot submit meanwhile; the agent keeps its run, reconnects, and runs what comes after, each once
        release, env_file = tmp_path / "release", tmp_path / "job-env.json"
        with cli_env(gw, PREFECT_API_KEY=gw["keys"]["bob"]):
            held = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}", "--param", "seconds=120",
                            "--param", f"release_file={release}", "--param", f"env_file={env_file}")["run_ids"][0]
        wait_running(held)
        job_key = job_credentials_are_its_runs_own(gw, scene, held, env_file)
        gw["kill"]()
        with cli_env(gw, PREFECT_API_KEY=gw["keys"]["alice"]):
            down = cli("submit", job, "--queue", q, "--param", f"record_dir={rec}", check=False)
        assert agent.poll() is None, f"the agent exited during the outage:\n{agent_log.read_text()[-3000:]}"
        log2 = gw["start"]()  # its start-up (~4-8 s here) is the outage the agent's polls and websockets meet
        with cli_env(gw, PREFECT_API_KEY=gw["keys"]["alice"]):
            after = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}",
                             "--param", "seconds=0.2")["run_ids"]
        release.touch()
        again = wait_final([held] + after, timeout=180)
        wait_agent_online(f"gw-agent-{sfx}", [q], timeout=60)
        # the agent revoked the run's key when its process ended
        wait_for(lambda: job_key("GET", f"/flow_runs/{held}").status_code == 401, 30,
                 lambda: f"the run key still works after its run ended: {job_key('GET', f'/flow_runs/{held}')}")
    assert down.returncode == 2 and "cannot reach the Prefect API at " + gw["api"] in down.stderr, down.stderr
    assert "nothing was sent" in down.stderr
    assert [r.state.type.value for r in again] == ["COMPLETED"] * 2, [r.state for r in again]
    assert sorted(records(rec)) == sorted(out["run_ids"] + for_alice + [held] + after)  # each ran once
    with direct() as client:  # nothing made while it was down, nothing twice
        from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

        made = client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[q])))
        assert sorted(str(r.id) for r in made) == sorted(out["run_ids"] + for_alice + [held] + after)
        for rid in [held] + after:
            assert [s.name for s in client.read_flow_run_states(rid)].count("Pending") == 1, rid  # claimed once
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=after)))  # sent with its run's key
        assert any("Finished in state Completed" in line.message for line in logs), [x.message for x in logs]
    assert all(r.run_count == 1 for r in again)
    assert not any(k in log2.read_text() for k in gw["keys"].values())
    assert [r.state.type.value for r in runs] == ["COMPLETED"] * 3, [r.state for r in runs]
    assert all("owner:alice" in r.tags and "owner:bob" not in r.tags for r in runs)
    assert q in listed
    assert rows[for_alice[0]]["owner"] == "alice" and rows[for_alice[0]]["launched_by"] == "root"
    assert rows[out["run_ids"][0]]["owner"] == "alice" and rows[out["run_ids"][0]]["launched_by"] is None
    assert shown["launched_by"] == "root"
    text = agent_log.read_text()
    assert not any(k in text for k in gw["keys"].values())


def test_the_monitor_reads_through_the_gateway_as_a_user(gw, scene):
    """The monitor's API layer (dashboard/api.py: Basic user:key from PREFECT_API_AUTH_STRING) through the
    gateway as alice: queues, runs, the server id (made by the first monitor, a plain user may create it)."""
    import datetime as dt

    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from prefect_launch.dashboard.api import SERVER_ID_VARIABLE, Api, fetch_pools, fetch_runs
    from prefect_launch.dashboard.spec import ViewSpec

    now = dt.datetime.now(dt.timezone.utc)
    with temporary_settings(updates={PREFECT_API_URL: gw["api"],
                                     PREFECT_API_AUTH_STRING: f"alice:{gw['keys']['alice']}"}):
        api = Api(gw["api"])
        pools = {p["name"] for p in fetch_pools(api)}
        runs = {r["id"] for r in fetch_runs(api, ViewSpec(since=now - dt.timedelta(days=1),
                                                          until=now + dt.timedelta(days=1)), limit=500)}
        server_id = api.server_id()
    assert scene["pool"] in pools and scene["run"] in runs
    assert len(server_id) == 32
    r = call(gw, "bob", "PATCH", f"/variables/name/{SERVER_ID_VARIABLE}", json={"value": "0" * 32})
    assert r.status_code == 403 and "may not create, change or delete variable" in r.json()["detail"]


# The monitor's Sessions page through the gateway as two users (issue 40 section 2): Streamlit's AppTest in this
# process, the monitor reading with its own key (carol, a plain user), alice and bob signing in with theirs; each
# write the page makes goes to the gateway with the signed-in user's key, so the gateway's rules decide.

SESSIONS_PAGE = Path(__file__).resolve().parents[1] / "dashboard" / "pages" / "1_Sessions.py"


@contextmanager
def monitor_env(gw, monkeypatch):
    """os.environ as the monitor runs behind the gateway: PREFECT_API_URL at the gateway with the monitor's own
    key (which turns the sign-in with users on), the identity store found as the gateway finds it."""
    monkeypatch.setenv("LAUNCH_METRICS_URL", gw["store_url"])
    for name in ("LAUNCH_DASHBOARD_LOGIN", "LAUNCH_DASHBOARD_PASSWORD", "LAUNCH_DASHBOARD_PASSWORD_BLOCK"):
        monkeypatch.delenv(name, raising=False)
    with cli_env(gw, PREFECT_API_AUTH_STRING=f"carol:{gw['keys']['carol']}"):
        yield


def page_as(gw, who, key=None):
    """The Sessions page signed in as ``who`` (with ``key``, default theirs); returns the AppTest."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    st.cache_data.clear()
    at = AppTest.from_file(str(SESSIONS_PAGE), default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "launch_next" not in [b.key for b in at.button]  # nothing writes before a sign-in
    at.sidebar.text_input(key="sessions_login_user").input(who)
    at.sidebar.text_input(key="sessions_login_key").input(key or gw["keys"][who])
    next(b for b in at.sidebar.button if b.label == "Sign in").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@contextmanager
def server_direct(url):
    """Prefect's settings at the server itself (no key), inside monitor_env: what an agent or admin does there."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}, restore_defaults={PREFECT_API_AUTH_STRING, PREFECT_API_KEY}):
        yield


def page_text(at) -> str:
    kinds = ("markdown", "caption", "code", "error", "success", "info", "warning", "text")
    return "\n".join(str(e.value) for k in kinds for e in at.get(k)) + "\n".join(
        d.value.to_csv() for d in at.dataframe)


def test_the_sessions_page_acts_as_the_signed_in_user_through_the_gateway(gw, prefect_server, tmp_path, monkeypatch):
    from prefect.blocks.system import Secret
    from prefect.exceptions import PrefectHTTPStatusError

    from launch_helpers import apply_queue
    from prefect_launch.dashboard import sessions_ops as O
    from prefect_launch.deployments.session_view import app_urls

    q = apply_queue(tmp_path, {"name": f"gw-sq-{os.urandom(3).hex()}", "presets": {"s": {"cpu": 1, "memory": "1Gi"}},
                               "default_preset": "s"})  # straight to the server, as an admin would
    name = f"lab-{os.urandom(3).hex()}"
    with monitor_env(gw, monkeypatch):
        wrong = page_as(gw, "alice", gw["keys"]["bob"])
        assert any("Wrong user name or key" in e.value for e in wrong.error), [e.value for e in wrong.error]
        assert "launch_next" not in [b.key for b in wrong.button]
        alice = page_as(gw, "alice")
        S = alice.session_state
        assert "launch_next" in [b.key for b in alice.button] and S["monitor_user"].name == "alice"
        # alice launches an interactive session from the page (no agent serves the queue: it waits)
        alice.radio(key="lf_type_0").set_value("interactive").run()
        alice.text_input(key="lf_name_0").input(name)
        alice.button(key="launch_next").click().run()
        alice.selectbox(key="lf_queue_0").set_value(q).run()
        for _ in range(3):
            alice.button(key="launch_next").click().run()
        alice.button(key="launch_go").click().run()
        assert not alice.exception and S["sl_step"] == 0, (S["sl_errors"], [e.value for e in alice.exception])
        run_id = S["sel_session"]
        token = f"tok-{os.urandom(4).hex()}"
        with server_direct(prefect_server), direct() as client:  # it starts, as its agent would make it
            from prefect.states import Running

            assert {"owner:alice", "project:vision"} <= set(client.read_flow_run(run_id).tags)
            client.set_flow_run_state(run_id, Running(), force=True)  # running, on its port, with its app token
            client.update_flow_run_labels(run_id, {"launch.session.ports": "18888"})
            Secret(value=token).save(f"session-token-{run_id}", overwrite=True)
        alice.run()
        assert any(token in c.value for c in alice.code), page_text(alice)  # her app link, with its token
        alice.text_input(key=f"rename_{run_id}").input(f"{name}-b")
        alice.button(key="rename_go").click().run()
        assert not alice.exception and any("Renamed" in s.value for s in alice.success), page_text(alice)

        # bob sees alice's session, not its token, and the page offers him no rename or terminate
        bob = page_as(gw, "bob")
        bob.sidebar.checkbox(key="sessions_all").check().run()
        bob.session_state["sel_session"] = run_id
        bob.run()
        assert not bob.exception and f"{name}-b" in page_text(bob).replace("\\", "")
        assert token not in page_text(bob) and not {"rename_go", "terminate"} & {b.key for b in bob.button}
        assert any("shown to the session's owner only" in c.value for c in bob.caption)
        # what bob's page sends carries bob's key: past the page's own check, the gateway refuses him
        as_bob, as_alice = bob.session_state["monitor_user"], S["monitor_user"]
        with O.client(as_bob) as c:
            fr = c.read_flow_run(run_id)
            assert app_urls(c, fr) == []  # the gateway refuses bob alice's token
            for attempt in (lambda: O.rename(c, run_id, "bob-took-it", "alice"), lambda: O.terminate(c, run_id, "alice")):
                with pytest.raises(PrefectHTTPStatusError) as exc:
                    attempt()
                assert exc.value.response.status_code == 403 and "may not" in exc.value.response.json()["detail"]
        with O.client(as_alice) as c:
            assert app_urls(c, c.read_flow_run(run_id)) == [f"http://127.0.0.1:18888/lab?token={token}"]
        with server_direct(prefect_server), direct() as client:
            fr = client.read_flow_run(run_id)
        assert fr.name == f"{name}-b" and fr.state.type.value == "RUNNING"

        # alice terminates it from the page
        alice.button(key="terminate").click().run()
        alice.button(key="terminate_confirm").click().run()
        assert not alice.exception, [e.value for e in alice.exception]
    with direct() as client:
        fr = client.read_flow_run(run_id)
    assert fr.state.type.value in ("CANCELLING", "CANCELLED") and fr.state.message == "terminated by alice"
    assert not any(k in gw["log"].read_text() for k in gw["keys"].values())


def test_manage_links_saves_as_the_signed_in_user_so_only_an_admin_may(gw, prefect_server, tmp_path, monkeypatch):
    """The queue monitor's Manage Links through the gateway: bob's save is refused with the gateway's reason,
    root's (an admin) is saved; read back from the server directly."""
    import html

    from fixtures_dashboard import fresh_app
    from launch_helpers import apply_queue
    from prefect_launch.blocks.queue_links import QueueLinks

    q = apply_queue(tmp_path, {"name": f"gw-lq-{os.urandom(3).hex()}", "presets": {"s": {"cpu": 1, "memory": "1Gi"}},
                               "default_preset": "s"})
    with monitor_env(gw, monkeypatch):
        at = fresh_app()
        at.session_state["links_open"] = True
        at.run()
        for who, url in (("bob", "https://bob.example/dash"), ("root", "https://grafana.example/d/1")):
            if who == "root":  # bob signs out first
                at.button(key="links_login_out").click().run()
            assert "link_url" not in {w.key for w in at.text_input}  # nothing to change before a sign-in
            at.text_input(key="links_login_user").input(who)
            at.text_input(key="links_login_key").input(gw["keys"][who])
            next(b for b in at.button if b.label == "Sign in").click().run()
            at.selectbox(key="links_queue").set_value(q).run()
            at.text_input(key="link_label").input(f"{who} dash")
            at.text_input(key="link_url").input(url)
            next(b for b in at.button if b.label == "Save link").click().run()
            assert not at.exception, [e.value for e in at.exception]
            if who == "bob":
                assert any("Link not saved: 403: user 'bob' may not create, change or delete blocks"
                           in html.unescape(e.value) for e in at.error), [e.value for e in at.error]
            else:
                assert any("Saved link 'root dash'" in s.value for s in at.success), [e.value for e in at.error]
        with server_direct(prefect_server):
            assert [(x.label, x.url) for x in QueueLinks.for_queue(q).links] == [("root dash", "https://grafana.example/d/1")]
