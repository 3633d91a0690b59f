"""Users, projects, API keys and queue access (issue 40 section 1): pure, on SQLite under tmp_path."""

from __future__ import annotations

import sqlalchemy as sa
import pytest

from prefect_launch.blocks import identity_keys as K
from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.identity_records import QueueAccess, User, check_name
from prefect_launch.blocks.identity_repository import IdentityError, IdentityRepository
from prefect_launch.blocks.metrics_engines import engine_for


@pytest.fixture
def repo(tmp_path):
    return IdentityRepository(f"sqlite:///{tmp_path / 'identity.db'}")


def test_keys_are_stored_only_as_salted_scrypt_hashes():
    a, b = K.new_key(), K.new_key()
    assert a.plaintext.startswith("plk_") and a.key_id in a.plaintext
    key_id, secret = K.split_key(a.plaintext)
    assert key_id == a.key_id and secret not in (a.hash, a.salt)
    assert a.salt != b.salt and a.hash != b.hash
    assert K.verify_secret(secret, a.salt, a.hash)
    assert not K.verify_secret(secret + "x", a.salt, a.hash)
    assert not K.verify_secret(secret, b.salt, a.hash)
    assert a.hash == K.hash_secret(secret, a.salt) and len(a.hash) == 64


@pytest.mark.parametrize("text", ["", "Bearer x", "plk_abc_def", "plk_0123456789ab_short", "x" * 80, None])
def test_malformed_keys_do_not_parse(text):
    assert K.split_key(text) is None


def test_users_projects_and_keys(repo):
    repo.add_project("vision")
    alice, key = repo.add_user("alice", projects=["vision"])
    assert alice == User(name="alice", role="user", projects=("vision",), created=alice.created)
    admin, admin_key = repo.add_user("root", role="admin")
    assert admin.is_admin and repo.verify(admin_key).name == "root"
    assert repo.verify(key).name == "alice" and repo.verify(key, "alice") and repo.verify(key, "root") is None
    assert repo.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert [p.members for p in repo.projects()] == [("alice",)]
    # the database holds no plaintext, only the hash; last-used is recorded
    with engine_for(repo.url).connect() as conn:
        dump = repr(conn.execute(sa.select(S.api_keys)).all())
    assert K.split_key(key)[1] not in dump
    assert repo.keys("alice")[0].last_used is not None
    # rotate: the old key stops working, the new one works
    new = repo.rotate_key("alice")
    assert repo.verify(key) is None and repo.verify(new).name == "alice"
    assert [k.revoked is not None for k in repo.keys("alice")] == [True, False]
    # disable: every key stops working
    repo.set_disabled("alice")
    assert repo.verify(new) is None and repo.user("alice").disabled
    repo.set_disabled("alice", False)
    assert repo.verify(new).name == "alice"
    repo.revoke_key(K.split_key(new)[0])
    assert repo.verify(new) is None


@pytest.mark.parametrize("call, message", [
    (lambda r: r.add_user("alice"), "exists already"),
    (lambda r: r.add_user("bob", projects=["nope"]), "no project 'nope'"),
    (lambda r: r.add_user("bob", role="king"), "role 'king'"),
    (lambda r: r.add_user("-bad"), "not allowed"),
    (lambda r: r.rotate_key("ghost"), "no user 'ghost'"),
    (lambda r: r.set_queue_access("gpu", users=["ghost"]), "no user 'ghost'"),
])
def test_bad_requests_say_what_is_wrong(repo, call, message):
    repo.add_user("alice")
    with pytest.raises(IdentityError, match=message):
        call(repo)
    assert [u.name for u in repo.users()] == ["alice"]  # nothing half-written


def test_queue_access(repo):
    repo.add_project("vision")
    alice, _ = repo.add_user("alice", projects=["vision"])
    bob, _ = repo.add_user("bob")
    root, _ = repo.add_user("root", role="admin")
    assert repo.queue_access("gpu").open_to_all and repo.queue_access("gpu").allows(bob)
    acc = repo.set_queue_access("gpu", projects=["vision"])
    assert acc.allows(alice) and not acc.allows(bob) and acc.allows(root)
    assert repo.set_queue_access("gpu", users=["bob"]).allows(bob)
    assert [a.queue for a in repo.all_queue_access()] == ["gpu"]
    assert repo.set_queue_access("gpu").open_to_all and repo.all_queue_access() == []


@pytest.mark.parametrize("access, user, allowed", [
    (QueueAccess(queue="q"), User(name="u"), True),
    (QueueAccess(queue="q", users=("u",)), User(name="u"), True),
    (QueueAccess(queue="q", users=("v",)), User(name="u"), False),
    (QueueAccess(queue="q", projects=("p",)), User(name="u", projects=("p",)), True),
    (QueueAccess(queue="q", projects=("p",)), User(name="u", projects=("r",)), False),
    (QueueAccess(queue="q", projects=("p",)), User(name="a", role="admin"), True),
    (QueueAccess(queue="q", projects=("p",)), User(name="a", role="agent"), False),
])
def test_queue_access_decisions(access, user, allowed):
    assert access.allows(user) is allowed


def test_names_become_tags_so_they_are_checked():
    assert check_name("alice.b@x") == "alice.b@x"
    for bad in ("", "a b", "a:b", "-x", "x" * 64):
        with pytest.raises(ValueError):
            check_name(bad)


def test_run_keys_act_as_their_runs_owner_until_revoked_or_expired(repo, monkeypatch):
    """A run key: hashed like any key, verified as its owner (a plain user, even for an admin's run) bound to its
    run; revoked by run id, expired after its TTL; a user's key rotation leaves running jobs' keys alone."""
    from prefect_launch.blocks import identity_repository as IR

    repo.add_user("root", role="admin")
    repo.add_user("alice")
    repo.add_user("off")
    repo.set_disabled("off")
    key = repo.mint_run_key("alice", "run-1", ttl_s=3600)
    admins = repo.mint_run_key("root", "run-2", ttl_s=3600)
    user = repo.verify(key)
    assert user.name == "alice" and user.run_id == "run-1" and user.is_run_key and not user.is_agent
    assert repo.verify(admins).role == "user" and repo.verify(admins).run_id == "run-2"
    with engine_for(repo.url).connect() as conn:
        assert K.split_key(key)[1] not in repr(conn.execute(sa.select(S.api_keys)).all())
        row = conn.execute(sa.select(S.api_keys).where(S.api_keys.c.key_id == K.split_key(key)[0])).one()
    assert row.hash == K.hash_fast(K.split_key(key)[1], row.salt)  # a random 256-bit secret: SHA-256, not scrypt
    assert not K.verify_secret(K.split_key(key)[1], row.salt, row.hash)  # a user key's check would not pass it
    repo.rotate_key("alice")
    assert repo.verify(key).run_id == "run-1"
    assert [k.run_id for k in repo.keys("alice")] == [None, "run-1", None]
    assert repo.revoke_run_keys("run-1") == 1 and repo.verify(key) is None and repo.verify(admins) is not None
    # a preempted run's lives: the end of the first revokes its key, not the next life's
    first, second = repo.mint_run_key("alice", "run-5", ttl_s=60), repo.mint_run_key("alice", "run-5", ttl_s=60)
    assert repo.revoke_run_keys("run-5", [K.split_key(first)[0]]) == 1
    assert repo.verify(first) is None and repo.verify(second).key_id == K.split_key(second)[0]
    short = repo.mint_run_key("alice", "run-3", ttl_s=60)
    now = IR._now_ms()
    monkeypatch.setattr(IR, "_now_ms", lambda: now + 61_000)
    assert repo.verify(short) is None  # expired
    for owner, words in [("ghost", "'ghost' is not an enabled user"), ("off", "'off' is not an enabled user")]:
        with pytest.raises(IdentityError, match=words):
            repo.mint_run_key(owner, "run-4", ttl_s=60)


def test_launch_credentials_keeps_only_prefect_launch_keys():
    from prefect_launch.blocks.identity_keys import launch_credentials

    key = "plk_0123456789ab_" + "s" * 32
    assert launch_credentials(f"alice:{key}", None) == (f"alice:{key}", None)
    assert launch_credentials(None, key) == (None, key)
    assert launch_credentials("admin:hunter2", "pnu_cloudkey") == (None, None)  # a plain server's auth string
    assert launch_credentials(f":{key}", None) == (None, None)  # no user name: not a gateway login
