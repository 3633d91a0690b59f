"""The gateway's decisions (issue 40 section 2), pure: credentials, the failure limiter, the key cache, the
rules on creating and changing runs. The gateway served in front of a real server: test_gateway_e2e.py."""

from __future__ import annotations

import base64

import pytest

from prefect_launch import gateway_rules as R
from prefect_launch.blocks.identity_records import QueueAccess, User
from prefect_launch.gateway_auth import Credentials, FailureLimiter, KeyCache, credentials, token_credentials

ALICE = User(name="alice", projects=("vision", "nlp"))
BOB = User(name="bob")
ROOT = User(name="root", role="admin")
AGENT = User(name="box-3", role="agent")


def basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("header, expected", [
    ("Bearer plk_k", Credentials("plk_k")),
    ("bearer   plk_k ", Credentials("plk_k")),
    (basic("alice:plk_k"), Credentials("plk_k", "alice")),
    (basic("alice:plk:k"), Credentials("plk:k", "alice")),
    (basic("alice"), None),
    (basic(":plk_k"), None),
    ("Basic !!!notbase64", None),
    ("Bearer", None),
    ("Token plk_k", None),
    ("", None),
    (None, None),
])
def test_credentials_from_the_authorization_header(header, expected):
    assert credentials(header) == expected


@pytest.mark.parametrize("token, expected", [
    ("alice:plk_k", Credentials("plk_k", "alice")), ("plk_k", Credentials("plk_k")),
    (None, None), ("", None), (":x", None), (42, None),
])
def test_credentials_from_the_events_auth_message(token, expected):
    assert token_credentials(token) == expected


def test_failed_attempts_are_limited_per_address():
    now = [0.0]
    lim = FailureLimiter(limit=3, window_s=60, clock=lambda: now[0])
    for _ in range(3):
        assert lim.retry_after("10.0.0.1") == 0
        lim.failed("10.0.0.1")
    assert lim.retry_after("10.0.0.1") == pytest.approx(60)
    assert lim.retry_after("10.0.0.2") == 0  # another address is not affected
    now[0] = 59.0
    assert lim.retry_after("10.0.0.1") == pytest.approx(1)
    now[0] = 60.5
    assert lim.retry_after("10.0.0.1") == 0  # the window has passed


def test_the_limiter_keeps_a_bounded_number_of_addresses():
    lim = FailureLimiter(limit=1, window_s=60, clock=lambda: 0.0, max_addresses=10)
    for i in range(100):
        lim.failed(f"a{i}")
    assert len(lim._fails) <= 10


def test_the_key_cache_keeps_no_key_and_expires():
    now = [0.0]
    cache: KeyCache[User] = KeyCache(ttl_s=10, clock=lambda: now[0])
    cred = Credentials("plk_secret-value", "alice")
    cache.put(cred, ALICE)
    assert cache.get(cred) == ALICE
    assert cache.get(Credentials("plk_secret-value", "bob")) is None  # the user is part of the entry
    assert cache.get(Credentials("plk_other")) is None
    assert "secret-value" not in repr(cache._data)
    now[0] = 10.0
    assert cache.get(cred) is None


RUN = "0b4f2b1e-7c1a-4c59-9d2b-3c1f7f1d2e3a"


@pytest.mark.parametrize("method, path, expected", [
    ("POST", f"/api/deployments/{RUN}/create_flow_run", R.Route(R.CREATE_FROM_DEPLOYMENT, RUN)),
    ("POST", "/api/flow_runs/", R.Route(R.CREATE_RUN, None)),
    ("POST", "/api/flow_runs", R.Route(R.CREATE_RUN, None)),
    ("POST", f"/api/flow_runs/{RUN}/set_state", R.Route(R.CHANGE_RUN, RUN)),
    ("PATCH", f"/api/flow_runs/{RUN}", R.Route(R.CHANGE_RUN, RUN)),
    ("PATCH", f"/api/flow_runs/{RUN}/labels", R.Route(R.CHANGE_RUN, RUN)),
    ("DELETE", f"/api/flow_runs/{RUN}", R.Route(R.CHANGE_RUN, RUN)),
    ("GET", f"/api/flow_runs/{RUN}", None),
    ("POST", "/api/flow_runs/filter", None),
    ("POST", "/api/deployments/filter", None),
])
def test_which_requests_have_a_rule(method, path, expected):
    assert R.classify(method, path) == expected


@pytest.mark.parametrize("path, ok", [
    ("/api/flow_runs/x", True), ("/", True), ("/api/../admin", False), ("/api/./x", False),
    ("/api/..", False), ("/api\\x", False),
])
def test_paths_that_step_out_are_refused(path, ok):
    assert R.safe_path(path) is ok


@pytest.mark.parametrize("user, tags, expected", [
    # a user's run is theirs whatever the body says, in their first project unless they name another of theirs
    (ALICE, None, ["owner:alice", "project:vision"]),
    (ALICE, ["launch", "owner:bob", "preset:s"], ["launch", "preset:s", "owner:alice", "project:vision"]),
    (ALICE, ["owner:alice", "project:nlp"], ["owner:alice", "project:nlp"]),
    (ALICE, ["launched_by:root"], ["owner:alice", "project:vision"]),
    (BOB, ["owner:alice"], ["owner:bob"]),
    # admins and agents may launch for someone else, and that is recorded
    (ROOT, ["owner:alice"], ["owner:alice", "launched_by:root"]),
    (ROOT, ["x"], ["x", "owner:root"]),
    (AGENT, ["owner:alice", "project:p"], ["owner:alice", "project:p", "launched_by:box-3"]),
])
def test_a_new_runs_tags_come_from_the_verified_user(user, tags, expected):
    out, refusal = R.launch_tags(user, tags)
    assert refusal is None and out == expected


@pytest.mark.parametrize("user, tags, status, words", [
    (ALICE, ["project:secret"], 403, "not a member of project 'secret'"),
    (BOB, ["project:vision"], 403, "their projects: none"),
    (ROOT, ["owner:a", "owner:b"], 422, "one owner"),
])
def test_tags_that_are_refused(user, tags, status, words):
    _, refusal = R.launch_tags(user, tags)
    assert refusal.status == status and words in refusal.message


@pytest.mark.parametrize("user, tags, allowed", [
    (ALICE, ["owner:alice"], True), (BOB, ["owner:alice"], False), (BOB, [], False), (BOB, None, False),
    (ROOT, ["owner:alice"], True), (AGENT, ["owner:alice"], True), (AGENT, None, True),
])
def test_who_may_change_a_run(user, tags, allowed):
    refusal = R.may_change_run(user, tags, "cancel")
    assert (refusal is None) is allowed
    if refusal:
        assert refusal.status == 403 and f"user '{user.name}' may not cancel" in refusal.message


def test_a_closed_queue_says_who_it_is_open_to():
    acc = QueueAccess(queue="gpu", users=("carol",), projects=("vision",))
    assert R.queue_refusal(ALICE, acc) is None and R.queue_refusal(ROOT, acc) is None
    refusal = R.queue_refusal(BOB, acc)
    assert refusal.status == 403 and "queue 'gpu' is not open to user 'bob'" in refusal.message
    assert "users carol and projects vision" in refusal.message
    assert R.queue_refusal(BOB, QueueAccess(queue="gpu")) is None


@pytest.mark.parametrize("user, method, path, refused", [
    (BOB, "GET", "/api/work_pools/gpu", False),
    (BOB, "POST", "/api/work_pools/filter", False),
    (BOB, "POST", "/api/flow_runs/count", False),
    (BOB, "POST", "/api/ui/flow_runs/history", False),
    (BOB, "POST", "/api/events/count-by/day", False),
    (BOB, "POST", "/api/flows/", False),
    (BOB, "POST", "/api/flow_runs/", False),  # a run rule decides
    (BOB, "POST", "/api/variables/", False),  # the own-variable rule decides
    (BOB, "GET", "/api/admin/version", False),
    (BOB, "GET", "/api/admin/settings", True),
    (BOB, "POST", "/api/work_pools/", True),
    (BOB, "PATCH", "/api/work_pools/gpu", True),
    (BOB, "POST", "/api/work_pools/gpu/workers/heartbeat", True),
    (BOB, "POST", "/api/work_pools/gpu/get_scheduled_flow_runs", True),
    (BOB, "POST", "/api/flow_runs/bulk_set_state", True),
    (BOB, "POST", "/api/flow_runs/bulk_delete", True),
    (BOB, "POST", "/api/deployments/0f3c2b1a-aaaa-bbbb-cccc-0123456789ab/create_flow_run/bulk", True),
    (BOB, "DELETE", "/api/block_documents/0f3c2b1a-aaaa-bbbb-cccc-0123456789ab", True),
    (BOB, "POST", "/api/automations/", True),
    (BOB, "POST", "/api/logs/", True),
    (ROOT, "POST", "/api/work_pools/", False),
    (AGENT, "POST", "/api/work_pools/gpu/workers/heartbeat", False),
    (AGENT, "POST", "/api/block_documents/", False),
])
def test_writes_outside_the_run_rules_are_for_admins_and_agents(user, method, path, refused):
    refusal = R.write_refusal(user, method, path)
    assert (refusal is not None) == refused
    if refused:
        assert refusal.status == 403 and f"user {user.name!r} may not" in refusal.message


def test_agent_labels_and_variables():
    assert R.label_refusal(ALICE, {"launch.alloc": "x"}).status == 403
    assert R.label_refusal(ALICE, {"prefect.worker.name": "w"}).status == 403
    assert R.label_refusal(ALICE, {"launch.cluster.plan": "{}"}).status == 403
    assert R.label_refusal(ALICE, {"launch.resources": "cpu=1", "launch.session.ports": "8888",
                                   "launch.cluster": "2 x cpu=1"}) is None  # what submit and session start write
    assert R.label_refusal(AGENT, {"launch.alloc": "x"}) is None
    assert R.own_variable_refusal(ALICE, "launch_recent_alice") is None
    assert R.own_variable_refusal(ALICE, "launch_recent_bob").status == 403
    assert R.own_variable_refusal(ROOT, "anything") is None


@pytest.mark.parametrize("user, path, include, expected", [
    (BOB, "/api/block_types/slug/secret/block_documents/name/k", True, R.SecretRead(True, name="k", refuse=True)),
    (BOB, "/api/block_types/slug/secret/block_documents/name/k", False, R.SecretRead(True)),
    (BOB, "/api/block_types/slug/secret/block_documents/name/session-token-0f3c2b1a-aaaa-bbbb-cccc-0123456789ab",
     True, R.SecretRead(True, name="session-token-0f3c2b1a-aaaa-bbbb-cccc-0123456789ab",
                        run_id="0f3c2b1a-aaaa-bbbb-cccc-0123456789ab")),
    (BOB, "/api/block_types/slug/launch-metrics/block_documents/name/default", True, R.SecretRead(True)),
    (BOB, "/api/block_documents/0f3c2b1a-aaaa-bbbb-cccc-0123456789ab", True, R.SecretRead(True)),
    (BOB, "/api/block_documents/filter", False, R.SecretRead(True)),
    (BOB, "/api/flow_runs/filter", True, R.SecretRead(False)),
    (ROOT, "/api/block_types/slug/secret/block_documents/name/k", True, R.SecretRead(False)),
    (AGENT, "/api/block_documents/filter", True, R.SecretRead(False)),
])
def test_which_block_reads_hide_secret_values(user, path, include, expected):
    method = "POST" if path.endswith("/filter") else "GET"
    assert R.secret_read(user, method, path, include) == expected


def test_the_monitor_server_id_matches_the_dashboards_and_a_user_may_only_create_it():
    from prefect_launch.dashboard.api import SERVER_ID_VARIABLE

    assert R.MONITOR_SERVER_ID == SERVER_ID_VARIABLE
    assert R.own_variable_refusal(BOB, SERVER_ID_VARIABLE, creating=True) is None
    assert R.own_variable_refusal(BOB, SERVER_ID_VARIABLE).status == 403


def test_a_session_row_shows_who_launched_it_for_its_owner():
    import datetime as dt
    from types import SimpleNamespace

    from prefect_launch.deployments.session_view import row_of

    now = dt.datetime.now(dt.timezone.utc)
    fr = SimpleNamespace(id="r1", name="nb", tags=["owner:alice", "launched_by:root", "session-type:interactive"],
                         labels={}, state=None, state_name="Scheduled", end_time=None, start_time=None,
                         created=now, expected_start_time=now, work_pool_name="gpu-box")
    row = row_of(fr, now)
    assert (row.owner, row.launched_by) == ("alice", "root")
    assert row_of(SimpleNamespace(**{**vars(fr), "tags": ["owner:alice"]}), now).launched_by is None


def test_the_cli_says_why_when_the_gateway_or_server_does_not_answer(monkeypatch):
    """A refused connection sent nothing; one broken mid-request may have been applied (the e2e kills the
    gateway under the CLI: test_gateway_e2e)."""
    import httpx

    from prefect_launch.cli_common import unreachable

    monkeypatch.setenv("PREFECT_API_URL", "http://gw:4280/api")
    req = httpx.Request("POST", "http://gw:4280/api/flow_runs/")
    refused = unreachable(httpx.ConnectError("[Errno 111] Connection refused", request=req))
    assert refused.startswith("cannot reach the Prefect API at http://gw:4280/api (ConnectError: [Errno 111] "
                              "Connection refused); nothing was sent") and "gateway" in refused
    broken = unreachable(httpx.RemoteProtocolError("Server disconnected without sending a response.", request=req))
    assert "(RemoteProtocolError: Server disconnected" in broken and "may or may not have been applied" in broken
    assert "nothing was sent" not in broken


# ------------------------------------------------------------------ run keys (a run's own key, not its agent's)

RUN = "0b5c2b8e-64f1-4b9e-9d3e-2f6f0c1a7d11"
ALICE_RUN = User(name="alice", projects=("vision",), run_id=RUN)  # a run key of alice's run


def test_only_agents_obtain_run_keys_for_live_owned_runs():
    live = {"id": RUN, "state": {"type": "PENDING"}, "tags": ["owner:alice"]}
    assert R.run_key_refusal(AGENT, live) is None
    for who in (ALICE, ROOT, ALICE_RUN):  # users, admins, and a run key itself may not
        refusal = R.run_key_refusal(who, live)
        assert refusal.status == 403 and "only agents" in refusal.message
    assert R.run_key_refusal(AGENT, None).status == 404
    ended = R.run_key_refusal(AGENT, {**live, "state": {"type": "COMPLETED"}})
    assert ended.status == 409 and "has ended (COMPLETED)" in ended.message
    ownerless = R.run_key_refusal(AGENT, {**live, "tags": ["x"]})
    assert ownerless.status == 409 and "no owner" in ownerless.message


def test_a_run_key_acts_as_its_owner_a_plain_user():
    """It changes its owner's runs only, reads Secret values of its owner's session only, writes no queue or block;
    beyond a user's key it may write what an engine writes (logs, artifacts, concurrency slots)."""
    assert R.may_change_run(ALICE_RUN, ["owner:alice"], "cancel") is None
    refusal = R.may_change_run(ALICE_RUN, ["owner:bob"], "cancel")
    assert refusal.status == 403 and "may not cancel 'bob''s run" in refusal.message
    assert R.secret_read(ALICE_RUN, "GET", "/api/block_types/slug/secret/block_documents/name/wandb", True).refuse
    token = R.secret_read(ALICE_RUN, "GET", f"/api/block_types/slug/secret/block_documents/name/session-token-{RUN}",
                          True)
    assert token.run_id == RUN and not token.refuse  # the gateway checks the session's owner
    for method, path in [("POST", "/api/block_types/"), ("POST", "/api/work_pools/"),
                         ("POST", "/api/flow_runs/bulk_set_state"), ("POST", "/api/admin/settings")]:
        assert R.write_refusal(ALICE_RUN, method, path).status == 403, path
    for path in ("/api/logs/", "/api/artifacts/", "/api/v2/concurrency_limits/increment-with-lease",
                 "/api/v2/concurrency_limits/decrement"):
        assert R.write_refusal(ALICE_RUN, "POST", path) is None, path
        assert R.write_refusal(ALICE, "POST", path).status == 403, path  # a user's own key: not these
    tags, refusal = R.launch_tags(ALICE_RUN, ["owner:bob"])  # a subflow or run_deployment: the owner's run
    assert refusal is None and "owner:alice" in tags and "owner:bob" not in tags
    assert R.label_refusal(ALICE_RUN, {"launch.alloc": "gpu=8"}).status == 403


@pytest.mark.parametrize("state, age_s, ended", [
    (None, 0, True),  # the run is gone
    ({"type": "RUNNING", "timestamp": "2026-01-01T00:00:00+00:00"}, 10_000, False),
    ({"type": "COMPLETED", "timestamp": "2026-01-01T00:00:00+00:00"}, 30, False),  # its last logs still flush
    ({"type": "COMPLETED", "timestamp": "2026-01-01T00:00:00+00:00"}, 61, True),
    ({"type": "CRASHED", "timestamp": "2026-01-01T00:00:00Z"}, 61, True),
    ({"type": "FAILED", "timestamp": "not a time"}, 0, True),
])
def test_a_run_key_ends_a_grace_after_its_run(state, age_s, ended):
    from datetime import datetime

    t0 = datetime.fromisoformat("2026-01-01T00:00:00+00:00").timestamp()
    run = None if state is None else {"id": RUN, "state": state}
    assert R.run_key_ended(run, t0 + age_s, grace_s=60) is ended


def test_the_key_cache_forgets_a_revoked_run_key_at_once():
    cache: KeyCache[User] = KeyCache(ttl_s=60)
    cache.put(Credentials("k1", "alice"), ALICE_RUN)
    cache.put(Credentials("k2", "alice"), ALICE)
    cache.forget(lambda u: u.run_id == RUN)
    assert cache.get(Credentials("k1", "alice")) is None and cache.get(Credentials("k2", "alice")) == ALICE


def test_a_run_key_writes_only_its_own_session_token():
    """flows/session.py stores the token as session-token-<run id> from inside the job, and drops it."""
    for method, path in [("POST", "/api/block_documents/"), ("PATCH", f"/api/block_documents/{RUN}"),
                         ("DELETE", f"/api/block_documents/{RUN}")]:
        assert R.token_write(method, path) and R.write_refusal(ALICE_RUN, method, path) is None  # the name decides
        assert R.write_refusal(ALICE, method, path).status == 403  # a user's own key: never
    assert not R.token_write("POST", "/api/block_types/") and not R.token_write("POST", "/api/block_documents/filter")
    assert R.token_write_refusal(ALICE_RUN, f"session-token-{RUN}") is None
    for name in ("session-token-" + "1" * 36, "wandb-key", None):
        refusal = R.token_write_refusal(ALICE_RUN, name)
        assert refusal.status == 403 and "only its own session's token" in refusal.message
    assert R.token_write_refusal(ALICE, f"session-token-{RUN}").status == 403
