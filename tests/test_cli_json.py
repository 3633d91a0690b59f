"""Every `--json` prints one JSON document on stdout and nothing else (issue 38): each listing and applying
command runs against a real server and its stdout goes through ``json.loads``; a command that fails prints
nothing on stdout (its error goes to stderr). The table is checked against the CLI itself, so a new
command with ``--json`` has to join it.

The commands run in process (`launch_helpers.cli`: the console script's Typer app, stdout and stderr
captured apart, Prefect's own console output included); tests/test_packaging.py runs setup, queue apply,
submit and session start as real processes of an installed wheel and parses their stdout too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_helpers import agent, cli, deploy_probe, wait_final, wait_running

# every command that takes --json; the server test below runs each (by this name)
JSON_COMMANDS = {
    "setup", "queue apply", "queue ls", "jobs ls", "submit", "agent ls", "runs ls", "runs show", "history",
    "env ls", "env prune",
    "monitor index", "monitor status", "store retention", "store purge", "report",
    "session start", "session ls", "session show", "session logs", "session terminate", "session rename",
    "session recent", "session pin", "session relaunch", "session images", "session commit",
    "user add", "user ls", "user key rotate", "user key ls", "project add", "project ls", "access set", "access ls",
}


def _json_commands() -> set[str]:
    import typer.main

    from prefect_launch.cli import app

    found = set()

    def walk(cmd, path):
        if hasattr(cmd, "commands"):  # a group (Typer's own click, or click)
            if any("--json" in p.opts for p in cmd.params):
                found.add(" ".join(path))
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        elif any("--json" in p.opts for p in cmd.params):
            found.add(" ".join(path))

    walk(typer.main.get_command(app), [])
    return found


def test_the_table_holds_every_command_with_json():
    assert _json_commands() == JSON_COMMANDS


def _one_document(proc, ok: bool = True):
    """stdout parsed as one JSON document (``ok``), or empty stdout for a command expected to fail."""
    if not ok:
        assert proc.returncode != 0 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
        return None
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"stdout is not one JSON document ({exc}):\n{proc.stdout[:3000]}") from None


@pytest.mark.usefixtures("prefect_server")
def test_every_json_command_prints_one_json_document(tmp_path: Path, unique_name, monkeypatch):
    store_url = f"sqlite:///{tmp_path / 'metrics.db'}"
    monkeypatch.setenv("LAUNCH_METRICS_BLOCK", f"json-{unique_name}")  # a store of this test's own
    monkeypatch.setenv("LAUNCH_METRICS_URL", store_url)
    ran: dict[str, object] = {}

    def run(command: str, *args: str, ok: bool = True):
        ran[command] = out = _one_document(cli(*command.split(), *args, "--json", check=False), ok)
        return out

    q, owner = f"json-{unique_name}", f"j{unique_name}"
    qfile = tmp_path / "queues.yaml"
    qfile.write_text(json.dumps({"queues": [{"name": q, "default_preset": "small",
                                             "presets": {"small": {"cpu": 1, "memory": "512Mi"}}}]}))
    assert run("setup", "--metrics-url", store_url)["metrics_block"] == f"json-{unique_name}"
    assert run("queue apply", str(qfile)) == [{"queue": q, "action": "created",
                                               "session_job": f"launch-session/session-{q}"}]
    assert run("queue apply", str(qfile))[0]["action"] == "unchanged"  # applying again prints JSON too
    job = deploy_probe(q, f"json-{unique_name}")
    params = ("--param", f"record_dir={tmp_path}", "--param", "seconds=0")
    assert run("submit", job, "--queue", q, "--dry-run", *params)["dry_run"] is True
    run_id = run("submit", job, "--queue", q, *params)["run_ids"][0]
    run("runs show", run_id, ok=False)  # nothing measured before an agent ran it: the error alone, on stderr
    common = ("--owner", owner)
    name, renamed = f"json-{unique_name}", f"json-{unique_name}-b"
    started = run("session start", "--type", "batch", "--queue", q, "--name", name, "--startup-command", "sleep 60",
                  *common)
    assert started["names"] == [name]
    with agent([q], f"json-{unique_name}", "cpu=4,memory=4Gi", tmp_path):
        wait_final([run_id])
        wait_running(started["run_ids"][0])
        assert [r["name"] for r in run("queue ls", q)] == [q]
        assert any(r["job"] == job for r in run("jobs ls"))
        assert any(a["name"] == f"json-{unique_name}" for a in run("agent ls"))
        assert run_id in [r["run_id"] for r in run("runs ls", "--queue", q)]
        assert run("runs show", run_id)["state"] == "Completed"
        assert isinstance(run("history", run_id), list)
        assert [s["name"] for s in run("session ls", *common)] == [name]
        assert run("session show", name, *common)
        assert isinstance(run("session logs", name, *common), list)  # one list, not a document per line
        assert run("session rename", name, renamed, *common)
        entry = run("session recent", *common)[0]["id"]
        assert run("session pin", entry, *common)["pinned"] is True
        assert run("session relaunch", entry, "--name", f"{name}-c", *common)["names"] == [f"{name}-c"]
        run("session commit", renamed, "--image-name", "nope", *common, ok=False)  # a process session: refused
        images = cli("session", "images", *common, "--json", check=False)  # answers only where a Docker daemon is
        ran["session images"] = _one_document(images, ok=images.returncode == 0)
        for session in (renamed, f"{name}-c"):
            run("session terminate", session, *common)
    assert run("monitor index", "--days", "1")["built"] is True
    monkeypatch.setenv("LAUNCH_ENV_DIR", str(tmp_path / "envs"))  # the host's job environments: none built here
    assert run("env ls")["environments"] == [] and run("env prune", "--all")["removed"] == []
    assert "indexed" in run("monitor status", "--no-sync")
    assert "retention_days" in run("store retention")
    assert run("store purge", "--older-than-days", "36500")["deleted_runs"] == 0
    assert isinstance(run("report", "--since", "1h"), (list, dict))
    # users, projects, keys and queue access (in the store's database)
    assert run("project add", f"p{unique_name}")["name"] == f"p{unique_name}"
    assert run("user add", f"u{unique_name}", "--project", f"p{unique_name}")["key"].startswith("plk_")
    run("user add", f"u{unique_name}", ok=False)  # the name is taken: the error alone
    assert run("user key rotate", f"u{unique_name}")["key"].startswith("plk_")
    assert [k["revoked"] is None for k in run("user key ls", f"u{unique_name}")] == [False, True]
    assert f"u{unique_name}" in [u["name"] for u in run("user ls")]
    assert run("project ls")[0]["members"] == [f"u{unique_name}"]
    assert run("access set", q, "--project", f"p{unique_name}")[0]["projects"] == [f"p{unique_name}"]
    assert run("access ls")[0]["queue"] == q
    assert set(ran) == JSON_COMMANDS
