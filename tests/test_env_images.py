"""The job images' cache, pure (workers/environments/image_cache.py): what ``env ls --images`` shows and what the
LRU removes, from answers shaped like the Docker API's (``images``, ``df``, ``containers``). The real daemon's side
is checked in test_env_docker.py (test_an_image_per_hash_built_once_and_reused)."""

from __future__ import annotations

from prefect_launch.workers.environments.image import HASH_LABEL, base_arg
from prefect_launch.workers.environments.image_cache import RUN_ID_KEY, _epoch, image_rows
from prefect_launch.workers.environments.spec import CachedEnv, lru_victims

MiB = 1 << 20


def _image(n: int, env_hash: str, created: str, tags: list[str]) -> dict:
    return {"Id": f"sha256:{n:064d}", "RepoTags": tags, "Labels": {HASH_LABEL: env_hash}, "Created": created}


IMAGES = [
    _image(1, "aaa", "2026-01-01T00:00:00.5Z", ["launch-env/one:aaa", "launch-env/two:aaa"]),
    _image(2, "bbb", "2026-01-02T00:00:00Z", ["<none>:<none>"]),  # its tags were taken by another build
    _image(3, "ccc", "2026-01-03T00:00:00Z", ["launch-env/three:ccc"]),
    {"Id": "sha256:" + "9" * 64, "RepoTags": ["python:3.11"], "Labels": {}, "Created": "2026-01-01T00:00:00Z"},
]
DF = [{"Id": f"sha256:{1:064d}", "Size": 900 * MiB, "SharedSize": 800 * MiB},
      {"Id": f"sha256:{2:064d}", "Size": 850 * MiB, "SharedSize": 800 * MiB},
      {"Id": f"sha256:{3:064d}", "Size": 300 * MiB, "SharedSize": -1}]  # not computed: its whole size counts
CONTAINERS = [
    {"ImageID": f"sha256:{3:064d}", "State": "running", "Names": ["/launch-x"], "Labels": {RUN_ID_KEY: "run-7"}},
    {"ImageID": f"sha256:{3:064d}", "State": "created", "Names": ["/someone"], "Labels": {}},
    {"ImageID": f"sha256:{1:064d}", "State": "exited", "Names": ["/old"], "Labels": {RUN_ID_KEY: "run-1"}},
]


def test_rows_give_each_job_image_its_own_size_last_use_and_live_runs():
    rows = {r["hash"]: r for r in image_rows(IMAGES, DF, CONTAINERS, used={"bbb": 1_900_000_000.0})}
    assert sorted(rows) == ["aaa", "bbb", "ccc"]  # an image without the hash label is no job image
    assert rows["aaa"]["tags"] == ["launch-env/one:aaa", "launch-env/two:aaa"] and rows["bbb"]["tags"] == []
    # its own layers: what removing it frees (the base it shares with the queue's image is not counted)
    assert (rows["aaa"]["size"], rows["bbb"]["size"], rows["ccc"]["size"]) == (100 * MiB, 50 * MiB, 300 * MiB)
    assert rows["aaa"]["total_size"] == 900 * MiB
    # last use: the agent's mark, else the image's creation
    assert rows["bbb"]["last_used"] == 1_900_000_000.0
    assert rows["aaa"]["last_used"] == _epoch("2026-01-01T00:00:00Z") + 0.5
    # live runs: containers not exited, named by their run id label where they have one
    assert rows["ccc"]["users"] == ["run-7", "someone"] and rows["aaa"]["users"] == []


def test_lru_removes_the_least_recently_used_images_of_no_live_run():
    rows = image_rows(IMAGES, DF, CONTAINERS, used={"aaa": 1_900_000_500.0, "bbb": 1_900_000_000.0})
    envs = [CachedEnv(r["hash"], r["size"], r["last_used"], bool(r["users"])) for r in rows]
    assert sum(e.size for e in envs) == 450 * MiB
    assert [v.hash for v in lru_victims(envs, 400 * MiB)] == ["bbb"]  # older first
    assert [v.hash for v in lru_victims(envs, 310 * MiB)] == ["bbb", "aaa"]
    # ccc is in use: never removed, even when the limit cannot be met without it
    assert [v.hash for v in lru_victims(envs, 0)] == ["bbb", "aaa"]
    assert lru_victims(envs, None) == []


def test_docker_times_parse():
    assert _epoch("1970-01-01T00:01:00.250000000Z") == 60.25
    assert _epoch(1234) == 1234.0
    assert _epoch("") == _epoch("not a time") == 0.0


def test_a_dockerfile_builds_on_the_queue_image_through_its_base_image_argument():
    text = "ARG BASE_IMAGE=prefecthq/prefect:3-python3.11\nFROM ${BASE_IMAGE}\nCOPY a /a\n"
    assert base_arg(text, ["${BASE_IMAGE}"], "queue/image:1") == (["queue/image:1"], "queue/image:1")
    assert base_arg(text, ["$BASE_IMAGE"], None) == (["prefecthq/prefect:3-python3.11"],
                                                    "prefecthq/prefect:3-python3.11")
    assert base_arg("FROM python:3.11\n", ["python:3.11"], "queue/image:1") == (["python:3.11"], None)
    import pytest

    with pytest.raises(ValueError, match="queue has no image"):
        base_arg("FROM ${BASE_IMAGE}\n", ["${BASE_IMAGE}"], None)


def test_images_commands_say_when_no_docker_daemon_answers(tmp_path, monkeypatch):
    from launch_helpers import cli

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such.sock")
    for args in (("ls", "--json"), ("rm", "abc"), ("prune", "--all")):
        out = cli("env", *args, "--images", check=False)
        assert out.returncode != 0 and "no Docker daemon answers" in out.stdout + out.stderr, args
