"""Sessions on a docker queue and `session commit`, against a real dockerd (skipped where none can run).

Pure rules first (image names, repository, the run's environment blanked), and the CLI refusing a
bad image name before it reads anything. End to end: a batch session in a container writes a file
into its container and one into its mounted folder; `session commit` makes the owner's image of it:
the container's file is in the image, the mounted folder's is not (a volume), the run's environment
is blanked and the image is labelled as the owner's; a new session started with `--image` on it
finds the committed file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from launch_helpers import apply_queue, cli, cli_json, read_runs, wait_final
from test_docker_backend import agent, docker_client, docker_host, image  # noqa: F401  (the real-dockerd fixtures)
from prefect_launch.deployments.session_commit import (OWNER_LABEL, _blanked_env, check_image_name,
                                                       repository_for)


def test_image_name_rules_and_repository():
    for ok in ("my-env", "Env_2", "abcd", "a" * 32, "a-b_c"):
        assert check_image_name(ok) is None, ok
    for bad in ("abc", "a" * 33, "my env", "my.env", "ümlaut", "", "-env", "env_", "a-_b"):
        assert check_image_name(bad), bad
    assert repository_for("Jane.Doe", "My-Env") == "launch/jane-doe/my-env"
    assert repository_for("", "envx") == "launch/user/envx"


def test_the_runs_environment_is_blanked_and_the_images_own_kept():
    env = _blanked_env(["PATH=/opt/venv/bin", "PREFECT_API_URL=http://x", "SECRET=s3", "SECRET=again"],
                       ["PATH=/opt/venv/bin", "LANG=C"])
    assert env == ["PATH=/opt/venv/bin", "LANG=C", "PREFECT_API_URL=", "SECRET="]


def test_commit_refuses_a_bad_image_name_before_anything():
    out = cli("session", "commit", "no-such-session", "--image-name", "x!", check=False)
    assert out.returncode == 2 and "4-32 characters" in out.stdout + out.stderr, out.stdout + out.stderr




@pytest.mark.usefixtures("prefect_server")
@pytest.mark.timeout(900)
def test_docker_session_commit_then_a_session_on_the_image(tmp_path: Path, unique_name: str, docker_client,  # noqa: F811
                                                           image: str):  # noqa: F811
    q = apply_queue(tmp_path, {"name": f"sd-{unique_name}", "target": "docker", "image": image,
                               "presets": {"small": {"cpu": 1, "memory": "512Mi"}}, "default_preset": "small"})
    owner = f"Dev.{unique_name}"
    kept = tmp_path / "kept"
    t0 = time.time()
    with agent([q], f"sd-{unique_name}", "cpu=2,memory=2Gi", tmp_path):
        first = cli_json("session", "start", "--type", "batch", "--queue", q, "--owner", owner, "--name",
                         f"env-{unique_name}", "--mount", f"{kept}:/data", "--json", "--startup-command",
                         "echo baked > /opt/prefect/baked.txt && echo kept > data/kept.txt && sleep 300")
        rid = first["run_ids"][0]
        deadline = time.time() + 240
        while not (kept / "kept.txt").exists():
            run = read_runs([rid])[0]
            assert not run.state.is_final(), run.state
            assert time.time() < deadline, "the session never wrote its mounted folder"
            time.sleep(0.5)
        print(f"docker session running in {time.time() - t0:.1f} s")
        bad = cli("session", "commit", f"env-{unique_name}", "--image-name", "ab", "--owner", owner, check=False)
        assert bad.returncode == 2 and "4-32 characters" in bad.stdout + bad.stderr
        done = cli_json("session", "commit", f"env-{unique_name}", "--image-name", "My-Env", "--owner", owner)
        repo = f"launch/dev-{unique_name}/my-env"
        assert done["image"] == f"{repo}:latest" and done["repository"] == repo, done
        assert "/data" in done["excluded_mounts"], done
        img = docker_client.images.get(done["image"])
        assert img.labels[OWNER_LABEL] == owner and f"{repo}:{done['tag']}" in img.tags
        env = dict(e.split("=", 1) for e in img.attrs["Config"]["Env"])
        assert env.get("PREFECT_API_URL") == "" and env.get("PREFECT__FLOW_RUN_ID", "") == "", "run env blanked"
        assert env["PATH"].startswith("/opt/venv/bin"), "the image's own environment stays"
        seen = docker_client.containers.run(done["image"], ["sh", "-c", "cat /opt/prefect/baked.txt; ls -A /data 2>/dev/null; true"],
                                            remove=True, network_mode="none").decode()
        assert seen.split() == ["baked"], f"the container's file is in the image, the mount's is not: {seen!r}"
        assert read_runs([rid])[0].state.name == "Running", "the session keeps running after its commit"
        listed = cli_json("session", "images", "--owner", owner, "--json")
        assert [i["image"] for i in listed] == [done["image"]] and listed[0]["session"] == f"env-{unique_name}", listed
        assert f"{repo}:{done['tag']}" in listed[0]["tags"] and listed[0]["image_id"] == done["image_id"], listed
        ended = cli_json("session", "terminate", f"env-{unique_name}", "--owner", owner)
        assert ended["status"] == "Cancelled", ended

        second = cli_json("session", "start", "--type", "batch", "--queue", q, "--owner", owner, "--image",
                          done["image"], "--json", "--startup-command",
                          "test \"$(cat /opt/prefect/baked.txt)\" = baked")
        run = wait_final(second["run_ids"], timeout=240)[0]
        assert run.state.is_completed(), (run.state.name, run.state.message)
    print(f"docker session test body {time.time() - t0:.1f} s")
    for t in img.tags:
        docker_client.images.remove(t)


def test_owner_images_lists_only_the_owners_committed_images_newest_first():
    from types import SimpleNamespace

    from prefect_launch.deployments.session_commit import SESSION_LABEL, owner_images

    def img(i, owner, tags, created):
        return SimpleNamespace(id=f"sha256:{i}", labels={OWNER_LABEL: owner, SESSION_LABEL: f"s{i}"}, tags=tags,
                               attrs={"Created": created, "Size": 1000 * i})

    rows = owner_images([img(1, "ann", ["launch/ann/env-a:20261130-101010", "launch/ann/env-a:latest"],
                             "2026-11-30T10:10:10.123456789Z"),
                         img(2, "bob", ["launch/bob/env-b:latest"], "2026-11-30T11:00:00Z"),
                         img(3, "ann", ["launch/ann/env-c:latest"], "2026-11-30T12:00:00Z"),
                         img(4, "ann", [], "2026-11-30T13:00:00Z"),  # untagged (dangling): not usable by --image
                         img(5, "ann", ["other/thing:latest"], "2026-11-30T14:00:00Z")], "ann")
    assert [r.image for r in rows] == ["launch/ann/env-c:latest", "launch/ann/env-a:latest"]
    assert rows[1].tags == ["launch/ann/env-a:latest", "launch/ann/env-a:20261130-101010"]
    assert rows[1].created.isoformat() == "2026-11-30T10:10:10.123456+00:00" and rows[1].session == "s1"
    assert rows[0].created.isoformat() == "2026-11-30T12:00:00+00:00" and rows[0].size_bytes == 3000


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.timeout(900)
def test_interactive_docker_session_serves_jupyter_with_token_then_terminates(tmp_path: Path, unique_name: str,
                                                                              docker_client, image: str):  # noqa: F811
    """An interactive session on a docker queue: JupyterLab runs in the session's container (host network,
    bound to 127.0.0.1), answers with its token only, and is gone with the container on terminate."""
    import httpx

    from docker_env import session_image
    from prefect_launch.workers.agent.tags import RUN_ID_LABEL

    t0 = time.time()
    lab_image = session_image(docker_client, image)
    print(f"session image {lab_image} ready in {time.time() - t0:.1f} s")
    q = apply_queue(tmp_path, {"name": f"sj-{unique_name}", "target": "docker", "image": lab_image,
                               "presets": {"small": {"cpu": 1, "memory": "1Gi"}}, "default_preset": "small"})
    owner = f"o{unique_name}"
    name = f"lab-{unique_name}"
    started = cli_json("session", "start", "--queue", q, "--owner", owner, "--name", name, "--json")
    port, rid = started["ports"][0], started["run_ids"][0]
    with agent([q], f"sj-{unique_name}", "cpu=2,memory=4Gi", tmp_path):
        deadline = time.time() + 300
        urls: list = []
        while not urls:
            show = cli_json("session", "show", name, "--owner", owner)
            urls = show["app_urls"]
            assert time.time() < deadline and not read_runs([rid])[0].state.is_final(), (show, read_runs([rid])[0].state)
            time.sleep(1)
        print(f"docker JupyterLab listed in {time.time() - t0:.1f} s")
        assert urls[0].startswith(f"http://127.0.0.1:{port}/lab?token="), urls
        token = urls[0].split("token=", 1)[1]
        [container] = docker_client.containers.list(filters={"label": f"{RUN_ID_LABEL}={rid}"})
        assert container.attrs["HostConfig"]["NetworkMode"] == "host"
        ok = httpx.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"}, timeout=10)
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=10).status_code in (401, 403)
        top = container.top()  # the app is the container's: JupyterLab runs inside it, not on the host
        assert any("jupyter" in " ".join(p) or "jupyterlab" in " ".join(p) for p in top["Processes"]), top
        ended = cli_json("session", "terminate", name, "--owner", owner)
        assert ended["status"] == "Cancelled", ended
        deadline = time.time() + 60
        while docker_client.containers.list(filters={"label": f"{RUN_ID_LABEL}={rid}"}):
            assert time.time() < deadline, "the session's container outlived its terminate"
            time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=3)
