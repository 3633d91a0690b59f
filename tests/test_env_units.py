"""Job environments (issue 39): the spec, its hash, the LRU choice (pure), and the builder on a local wheel
folder (uv, offline: no network; child processes of plain uv and Python)."""

from __future__ import annotations

import subprocess
import threading

import pytest

from env_wheels import wheel_folder
from prefect_launch.workers.environments.builder import EnvCache, EnvironmentBuildError
from prefect_launch.workers.environments.spec import (
    CachedEnv, check_python, env_hash, identity, inline, lru_victims, parse_environment,
)
from prefect_launch.workers.scheduling.resources import LaunchValidationError


def spec_of(value, bases=()):
    return inline(parse_environment(value), list(bases))


@pytest.mark.parametrize("value, message", [
    ({"requirements": "r.txt", "pyproject": "pyproject.toml"}, "both requirements and pyproject"),
    ({"python": "3.11"}, "names no requirements"),
    ({"base_image": "python:3.11"}, "names no requirements"),
    ({"requirements": ["ok", 3]}, "bad environment"),
    ({"requirements": ["-r other.txt"]}, "names another file"),
    ({"requirement": "r.txt"}, "bad environment"),
    (["a"], "must be a mapping"),
])
def test_bad_declarations_say_what_to_change(value, message):
    with pytest.raises(LaunchValidationError, match=message):
        parse_environment(value, "in the submission")


def test_unset_is_none_and_a_bare_name_is_a_file():
    assert parse_environment(None) is None and parse_environment({}) is None
    assert parse_environment("requirements.txt").requirements == "requirements.txt"


def test_file_pins_and_inline_pins_hash_alike_comments_do_not_count(tmp_path):
    (tmp_path / "requirements.txt").write_text("# tools\nlaunchtiny==1.0  # pinned\n\nlaunchalpha\n")
    from_file = spec_of({"requirements": "requirements.txt"}, [tmp_path])
    assert from_file.requirements == ["launchtiny==1.0", "launchalpha"]
    assert env_hash(from_file, "3.9.1") == env_hash(spec_of({"requirements": ["launchtiny==1.0", "launchalpha"]}),
                                                    "3.9.1")


def test_pyproject_dependencies_are_the_pins(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "j"\ndependencies = ["launchbeta>=0.1"]\n')
    assert spec_of({"pyproject": "pyproject.toml"}, [tmp_path]).requirements == ["launchbeta>=0.1"]


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(LaunchValidationError, match="nope.txt.*does not exist"):
        spec_of({"requirements": "nope.txt"}, [tmp_path])


@pytest.mark.parametrize("change", [
    {"requirements": ["launchtiny==2.0"]}, {"find_links": "/other"}, {"index_url": "https://example.invalid/simple"},
])
def test_whatever_shapes_the_environment_changes_the_hash(change):
    base = {"requirements": ["launchtiny==1.0"], "find_links": "/wheels"}
    assert env_hash(spec_of(base), "3.9.1") != env_hash(spec_of({**base, **change}), "3.9.1")


def test_the_prefect_and_python_versions_are_in_the_hash():
    s = spec_of({"requirements": ["launchtiny==1.0"]})
    assert env_hash(s, "3.9.1") != env_hash(s, "3.9.2")
    assert env_hash(s, "3.9.1", "3.11") != env_hash(s, "3.9.1", "3.12")


def test_python_must_be_the_agents():
    assert check_python(parse_environment({"requirements": ["x"], "python": "3.11"}), "3.11") == "3.11"
    with pytest.raises(LaunchValidationError, match="this agent runs python 3.11"):
        check_python(parse_environment({"requirements": ["x"], "python": "3.12"}), "3.11")


def test_lru_removes_the_least_recently_used_of_no_live_run():
    envs = [CachedEnv("a", 100, 1.0, False), CachedEnv("b", 100, 2.0, True), CachedEnv("c", 100, 3.0, False),
            CachedEnv("d", 100, 4.0, False)]
    assert lru_victims(envs, None) == []
    assert lru_victims(envs, 400) == []
    assert [e.hash for e in lru_victims(envs, 250)] == ["a", "c"]
    assert [e.hash for e in lru_victims(envs, 0)] == ["a", "c", "d"]  # "b" is in use: it stays


# ---------------------------------------------------------------- the builder (uv, offline, local wheels)
@pytest.fixture
def wheels(tmp_path):
    return wheel_folder(tmp_path / "wheels")


def ident(wheels, pins):
    import prefect

    return identity(spec_of({"requirements": pins, "find_links": str(wheels)}), prefect.__version__)


def version_seen(python, module="launchtiny"):
    """The version of ``module`` the environment's python imports, and the Prefect version it would import
    (read from its metadata: importing Prefect costs seconds)."""
    code = (f"import {module}, importlib.metadata as m, importlib.util as u; assert u.find_spec('prefect'); "
            f"print({module}.VERSION, m.version('prefect'))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_two_environments_pinning_different_versions_each_see_their_own(tmp_path, wheels):
    import prefect

    cache = EnvCache(tmp_path / "envs")
    one, two = cache.ensure(ident(wheels, ["launchtiny==1.0"])), cache.ensure(ident(wheels, ["launchtiny==2.0"]))
    assert one.built and two.built and one.path != two.path
    assert version_seen(one.python) == ["1.0", prefect.__version__]  # the agent's Prefect, the job's pin
    assert version_seen(two.python) == ["2.0", prefect.__version__]
    again = cache.ensure(ident(wheels, ["launchtiny==1.0"]))
    assert not again.built and again.path == one.path


def test_concurrent_runs_of_one_hash_share_one_build(tmp_path, wheels):
    cache = EnvCache(tmp_path / "envs")
    target = ident(wheels, ["launchalpha", "launchbeta"])
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(cache.ensure(target, run_id=f"r{i}")))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.built for r in results) == [False, False, True]
    assert cache.users(target.hash) == ["r0", "r1", "r2"]


def test_a_failed_build_raises_the_installers_words_and_leaves_nothing_complete(tmp_path, wheels):
    cache = EnvCache(tmp_path / "envs")
    target = ident(wheels, ["launchnope==9"])
    with pytest.raises(EnvironmentBuildError, match="(?s)environment build failed:.*launchnope"):
        cache.ensure(target)
    assert not cache.is_complete(target.hash) and not (cache.root / target.hash).exists()
    assert not list(cache.root.glob(".build-*"))
    assert cache.entries() == []


def test_rm_prune_and_the_size_limit(tmp_path, wheels):
    cache = EnvCache(tmp_path / "envs")
    a = cache.ensure(ident(wheels, ["launchalpha"]))
    b = cache.ensure(ident(wheels, ["launchbeta"]), run_id="live")
    (cache.root / f".build-{a.hash}-crashed").mkdir()  # a crashed build's leftovers
    assert {e["hash"] for e in cache.entries()} == {a.hash, b.hash}
    assert cache.prune(all_unused=True) == [a.hash]  # b has a live run
    assert not list(cache.root.glob(".build-*"))
    with pytest.raises(RuntimeError, match="used by run"):
        cache.remove(b.hash)
    cache.release(b.hash, "live")
    c = cache.ensure(ident(wheels, ["launchgamma"]))
    size = max(e["size"] for e in cache.entries())
    assert cache.enforce_limit(size) == [b.hash]  # the least recently used goes first
    assert [e["hash"] for e in cache.entries()] == [c.hash]
    assert cache.remove(c.hash) and not cache.remove(c.hash)


def test_an_environment_that_only_adds_packages_may_start_warm(tmp_path, wheels):
    from prefect_launch.workers.environments.builder import shadows_agent

    cache = EnvCache(tmp_path / "envs")
    built = cache.ensure(ident(wheels, ["launchalpha", "launchbeta"]))
    assert cache.meta(built.hash)["top_level"] == ["launchalpha", "launchbeta"]
    assert shadows_agent(["launchalpha", "launchbeta"]) == []
    assert shadows_agent(["launchalpha", "iniconfig", "json", "prefect"]) == ["iniconfig", "json", "prefect"]


def test_submit_sends_inline_pins_the_run_over_the_deployment_and_images_on_container_queues_only(tmp_path):
    from prefect_launch.workers.environments.spec import environment_for_submit

    (tmp_path / "requirements.txt").write_text("launchtiny==1.0\n")
    dep = {"environment": {"requirements": "requirements.txt", "find_links": "/wheels"}}
    assert environment_for_submit("process", dep, None, [tmp_path]) == {
        "requirements": ["launchtiny==1.0"], "find_links": "/wheels"}
    assert environment_for_submit("process", dep, '{"requirements": ["launchtiny==2.0"]}', [tmp_path]) == {
        "requirements": ["launchtiny==2.0"]}
    assert environment_for_submit("process", {}, None, [tmp_path]) is None
    assert environment_for_submit("docker", dep, None, [tmp_path]) == {  # an image's pins, inlined the same way
        "requirements": ["launchtiny==1.0"], "find_links": "/wheels"}
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "Dockerfile").write_text("ARG BASE=python:3.11\nFROM $BASE\nRUN true\n")
    assert environment_for_submit("kubernetes", {}, '{"dockerfile": "img/Dockerfile"}', [tmp_path]) == {
        "requirements": [], "dockerfile": str((tmp_path / "img" / "Dockerfile").resolve()),
        "context": str((tmp_path / "img").resolve())}
    with pytest.raises(LaunchValidationError, match="for docker and kubernetes queues"):
        environment_for_submit("process", {}, '{"dockerfile": "img/Dockerfile"}', [tmp_path])
    with pytest.raises(LaunchValidationError, match="both dockerfile and base_image"):
        environment_for_submit("docker", {}, '{"dockerfile": "img/Dockerfile", "base_image": "x"}', [tmp_path])
    with pytest.raises(LaunchValidationError, match="does not exist"):
        environment_for_submit("docker", {}, '{"dockerfile": "none/Dockerfile"}', [tmp_path])
    (tmp_path / "img" / "Dockerfile").write_text("# no FROM\nRUN true\n")
    with pytest.raises(LaunchValidationError, match="must be FROM"):
        environment_for_submit("docker", {}, '{"dockerfile": "img/Dockerfile"}', [tmp_path])
    with pytest.raises(LaunchValidationError, match="not valid JSON"):
        environment_for_submit("process", {}, "{requirements: [", [tmp_path])
