"""Helpers for end-to-end tests: CLI calls, queues, the probe job, agents, waiting."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import yaml

from prefect_launch.local_server import background_process

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "prefect_launch.cli"]


def _cli_in_process(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    """The CLI's own Typer app called in this process: the same code path as the console script,
    without paying Python's and Prefect's import time (seconds of CPU) for every call."""
    import traceback

    import prefect.context
    from typer.testing import CliRunner

    from prefect_launch.cli import app

    prefect.context.refresh_global_settings_context()  # honour what the test put in os.environ
    res = CliRunner().invoke(app, list(args), catch_exceptions=True)
    stderr = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        stderr += "".join(traceback.format_exception(res.exception))
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, stderr)


def cli(*args: str, check: bool = True, timeout: float = 120, subprocess_: bool = False) -> subprocess.CompletedProcess:
    """Run ``prefect-launch ARGS``: in process by default (LAUNCH_TEST_CLI_SUBPROCESS=1 or
    ``subprocess_=True`` runs the real console entry point in a child process)."""
    if subprocess_ or os.environ.get("LAUNCH_TEST_CLI_SUBPROCESS") == "1":
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    else:
        proc = _cli_in_process(args)
    if check and proc.returncode != 0:
        raise AssertionError(f"prefect-launch {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def cli_json(*args: str):
    return json.loads(cli(*args, "--json").stdout)


def apply_queue(tmp_path: Path, spec: dict) -> str:
    path = tmp_path / f"queues-{spec['name']}.yaml"
    path.write_text(yaml.safe_dump({"queues": [spec]}))
    cli("queue", "apply", str(path))
    return spec["name"]


def deploy_probe(queue: str, name: str, job_variables: Optional[dict] = None) -> str:
    """Deploy flows/probe.py to ``queue``; returns the job reference probe/<name>."""
    import prefect.context
    from prefect import flow

    prefect.context.refresh_global_settings_context()
    flow.from_source(source=str(ROOT / "flows"), entrypoint="probe.py:probe").deploy(
        name=name, work_pool_name=queue, work_queue_name="medium", build=False, push=False,
        print_next_steps=False, job_variables=job_variables or {})
    return f"probe/{name}"


@contextlib.contextmanager
def agent(queues: list[str], name: str, capacity: str, log_dir: Path, extra: tuple[str, ...] = (),
          on_exit: str = "cancel", log_name: Optional[str] = None,
          wait_online: bool = True) -> Iterator[subprocess.Popen]:
    """An agent for the test; leaving the block stops it and (by default) cancels what it still runs."""
    args = [*CLI, "agent", "--name", name, "--capacity", capacity, "--on-exit", on_exit, *extra]
    for q in queues:
        args += ["--queue", q]
    with background_process(args, log_dir / (log_name or f"agent-{name}.log")) as proc:
        if wait_online:
            wait_agent_online(name, queues)
        yield proc


@contextlib.contextmanager
def restored_env(*keys: str) -> Iterator[None]:
    """The environment variables ``keys`` come back as they were after the block (unset ones unset), and
    Prefect's settings are re-read: for a fixture that points the process at a server or store of its own."""
    import prefect.context

    keep = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        prefect.context.refresh_global_settings_context()


def restored_prefect_env() -> contextlib.AbstractContextManager[None]:
    """For a test that starts a server of its own: the session server's settings come back after."""
    return restored_env("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_API_AUTH_STRING")


def _agents() -> list[dict]:
    """What `agent ls --json` prints, read in process (tests poll this often)."""
    from prefect import get_client

    from prefect_launch.workers.agent.registry import read_agents_sync

    with get_client(sync_client=True) as client:
        return [dict(a.model_dump(mode="json"), online=a.online()) for a in read_agents_sync(client)]


def wait_agent_online(name: str, queues: list[str], timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        agents = {a["name"]: a for a in _agents()}
        a = agents.get(name)
        if a and a["online"] and set(queues) <= set(a["queues"]):
            return
        time.sleep(0.5)
    raise AssertionError(f"agent {name} did not come online for {queues}")


def read_runs(run_ids: list[str]):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        out = []
        for i in range(0, len(run_ids), 100):
            out += client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_ids[i:i + 100])))
        return out


def wait_final(run_ids: list[str], timeout: float = 240) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = read_runs(run_ids)
        if len(runs) == len(run_ids) and all(r.state and r.state.is_final() for r in runs):
            return runs
        time.sleep(0.4)  # a cheap read; a 1-s poll cost each of the suite's ~65 waits 0.5 s on average
    states = {str(r.id)[:8]: r.state_name for r in read_runs(run_ids)}
    raise AssertionError(f"runs did not finish in {timeout}s: {states}")


def records(record_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in record_dir.glob("*.json")}


def wait_running(run_id: str, timeout: float = 120) -> int:
    """Wait until the run is Running on an agent; return its process id (infrastructure pid)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = read_runs([run_id])[0]
        if run.state_name == "Running" and run.infrastructure_pid:
            return int(run.infrastructure_pid.split(":")[-1])
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} never started")


def wait_agent_free(name: str, gpu: int, timeout: float = 30, log: "Path | None" = None) -> dict:
    """The agent's published state once it shows ``gpu`` free GPUs and no runs (published within ~1 s);
    on failure the message carries the tail of the agent's ``log`` where given."""
    deadline = time.time() + timeout
    while True:
        a = {x["name"]: x for x in _agents()}.get(name)
        if a and a["free"]["gpu"] == gpu and a["runs"] == []:
            return a
        if time.time() > deadline:
            tail = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
            raise AssertionError(f"agent {name} never showed {gpu} free GPUs and no runs: {a}"
                                 + (f"\n--- {log.name} (tail)\n{tail}" if tail else ""))
        time.sleep(0.5)


def wait_for(what, timeout: float, message):
    """``what()``'s first truthy value within ``timeout`` s; else fail with ``message`` (a string, or a callable
    read only then, e.g. an agent log's tail)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(message() if callable(message) else message)


class LabelWatch:
    """Every distinct waiting reason (``launch.waiting``) the runs show, read every 0.2 s from the server while
    they wait and build (the label is cleared once a run is placed and started)."""

    def __init__(self) -> None:
        self.run_ids: list[str] = []
        self.seen: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "LabelWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            while not self._stop.wait(0.2):
                for run_id in list(self.run_ids):
                    with contextlib.suppress(Exception):
                        text = (client.read_flow_run(run_id).labels or {}).get("launch.waiting") or ""
                        if text and text not in self.seen.setdefault(run_id, []):
                            self.seen[run_id].append(text)
