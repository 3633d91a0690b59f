"""The monitor's login decisions (dashboard/monitor_login.py), pure: which mode, who signs in, who the page
acts as, what a refusal says. Users and keys come from a real identity store on SQLite (test_identity.py's
tables); the page itself through the gateway is in test_gateway_e2e.py."""

from __future__ import annotations

import httpx
import pytest

from prefect_launch.blocks.identity_repository import IdentityRepository
from prefect_launch.dashboard import monitor_login as L
from prefect_launch.gateway_auth import FailureLimiter


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    repo = IdentityRepository(f"sqlite:///{tmp_path_factory.mktemp('login') / 'identity.db'}")
    keys = {n: repo.add_user(n, role=r)[1] for n, r in [("alice", "user"), ("root", "admin"), ("box-1", "agent"),
                                                         ("dave", "user")]}
    repo.set_disabled("dave")
    return repo, keys


def _verify(repo):
    return lambda name, key: repo.verify(key, name)


KEY = "plk_0123456789ab_" + "A" * 43


@pytest.mark.parametrize("chosen,api_key,auth,mode", [
    (None, None, None, L.Mode.PASSWORD),                          # nothing configured: the old gate (or none)
    (None, KEY, None, L.Mode.USERS),                              # the monitor holds a gateway key
    (None, None, f"monitor:{KEY}", L.Mode.USERS),                 # ... as user:key
    (None, None, "admin:hunter2", L.Mode.PASSWORD),               # Prefect's own auth string is no user key
    ("users", None, None, L.Mode.USERS),
    (" Password ", KEY, None, L.Mode.PASSWORD),                   # chosen wins
])
def test_login_mode(chosen, api_key, auth, mode):
    assert L.login_mode(chosen, api_key, auth) is mode


def test_an_unknown_login_mode_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"LAUNCH_DASHBOARD_LOGIN='sso' is not a login mode: use 'users'"):
        L.login_mode("sso")


def test_sign_in_with_the_stores_users(store):
    repo, keys = store
    limiter = FailureLimiter(limit=3, window_s=60)
    user, why = L.sign_in(" alice ", keys["alice"], "10.0.0.1", _verify(repo), limiter)
    assert why == "" and user.name == "alice" and user.role == "user"
    assert user.auth_string() == f"alice:{keys['alice']}" and keys["alice"] not in repr(user)  # SecretStr
    admin, _ = L.sign_in("root", keys["root"], "10.0.0.1", _verify(repo), limiter)
    assert admin.role == "admin"
    for name, key, words in [("alice", keys["root"], "Wrong user name or key"),   # root's key is not alice's
                             ("dave", keys["dave"], "Wrong user name or key"),    # disabled
                             ("alice", "", "Enter your user name and your API key"),
                             ("box-1", keys["box-1"], "is an agent's key")]:
        user, why = L.sign_in(name, key, "10.0.0.2", _verify(repo), limiter)
        assert user is None and words in why, (name, why)


def test_failed_sign_ins_are_limited_per_address(store):
    repo, keys = store
    limiter = FailureLimiter(limit=2, window_s=60)
    for _ in range(2):
        assert L.sign_in("alice", keys["alice"][:-1] + "x", "10.0.0.3", _verify(repo), limiter)[0] is None
    user, why = L.sign_in("alice", keys["alice"], "10.0.0.3", _verify(repo), limiter)  # even the right key waits
    assert user is None and why.startswith("Too many failed sign-ins from 10.0.0.3")
    assert L.sign_in("alice", keys["alice"], "10.0.0.4", _verify(repo), limiter)[0] is not None  # another address


def test_a_store_that_cannot_be_read_keeps_the_page_locked():
    def down(name, key):
        raise ConnectionError("store down")

    limiter = FailureLimiter(limit=1, window_s=60)
    user, why = L.sign_in("alice", KEY, "10.0.0.5", down, limiter)
    assert user is None and why.startswith("Sign-in unavailable: the users cannot be read (ConnectionError)")
    assert limiter.retry_after("10.0.0.5") == 0  # not held against the person


def test_who_the_page_acts_as_and_whether_it_writes():
    import getpass

    alice = L.SignedIn(name="alice", role="user", key=KEY)
    assert L.viewer(L.Mode.USERS, alice) == "alice" and L.viewer(L.Mode.USERS, None) is None
    assert L.viewer(L.Mode.PASSWORD, None) == getpass.getuser()
    assert L.may_write(L.Mode.USERS, alice, False, True) and not L.may_write(L.Mode.USERS, None, True, False)
    assert L.may_write(L.Mode.PASSWORD, None, False, False)  # no password configured: no gate, as before
    assert not L.may_write(L.Mode.PASSWORD, None, False, True) and L.may_write(L.Mode.PASSWORD, None, True, True)


def test_acting_as_sets_prefects_auth_for_the_block_only():
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, temporary_settings

    def plain(setting):
        v = setting.value()
        return v.get_secret_value() if hasattr(v, "get_secret_value") else v

    alice = L.SignedIn(name="alice", role="user", key=KEY)
    with temporary_settings(updates={PREFECT_API_KEY: "monitor-key", PREFECT_API_AUTH_STRING: "m:x"}):
        with L.acting_as(alice):
            assert plain(PREFECT_API_AUTH_STRING) == f"alice:{KEY}" and not plain(PREFECT_API_KEY)
        with L.acting_as(None):
            assert plain(PREFECT_API_AUTH_STRING) == "m:x"
        assert plain(PREFECT_API_KEY) == "monitor-key"


def test_a_refusal_says_the_gateways_words():
    req = httpx.Request("POST", "http://gw/api/flow_runs/x/set_state")
    resp = httpx.Response(403, json={"detail": "user 'bob' may not cancel 'alice''s run"}, request=req)
    exc = httpx.HTTPStatusError("Client error '403 Forbidden'", request=req, response=resp)
    assert L.refusal_text(exc) == "403: user 'bob' may not cancel 'alice''s run"
    assert L.refusal_text(RuntimeError("boom\nmore")) == "RuntimeError: boom"
