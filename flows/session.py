"""The built-in compute-session flow: a batch command or interactive apps, on launch hardware.

A session is a flow run of this flow, deployed on every launch queue by `queue apply`
and submitted through the same path as jobs, so presets, bounds, placement, pinning,
metrics, timeouts and the monitor apply unchanged. Like every launch job it needs
nothing from prefect-launch: only Prefect and the standard library.

- batch: runs ``startup_command`` in the session's scratch folder; exit 0 completes the
  run (``task-finished``), any other exit fails it with the code (``task-failed``).
- interactive: serves JupyterLab (with its terminal) on the first of the session's ports,
  bound to 127.0.0.1 by default, protected by a token kept in a Prefect Secret block
  (``session-token-<run id>``) that `prefect-launch session show` reads; lives until it is
  terminated or reclaimed.

The scratch folder is deleted when the session ends; mounts (host folders) are linked
into it and outlive it.

A cluster session (``--cluster-size N``) runs this flow in every member (main1, sub1, ...):
in a batch session every member runs the startup command with its own rank and the cluster's
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), as a distributed launcher expects;
in an interactive one main1 serves the apps and the sub members hold their share until the
session ends. Each member has a scratch folder of its own.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run


class SessionFailed(Exception):
    """The batch command exited non-zero (Backend.AI's ``task-failed``)."""


def _scratch_root() -> Path:
    return Path(os.environ.get("LAUNCH_SCRATCH_ROOT") or Path(tempfile.gettempdir()) / "prefect-launch-sessions")


def _link_mounts(scratch: Path, mounts: list[str]) -> list[str]:
    """``SRC:DST``: DST (relative to the scratch folder) links to the host folder SRC."""
    linked = []
    for m in mounts:
        src, dst = m.split(":", 1)
        target = scratch / dst.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(src).mkdir(parents=True, exist_ok=True)
        target.symlink_to(Path(src).resolve(), target_is_directory=True)
        linked.append(f"{src} -> {target}")
    return linked


def _wait_port(host: str, port: int, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode} before it listened on {host}:{port}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)  # a connect to a closed loopback port costs nothing; poll tightly
    raise RuntimeError(f"the app did not listen on {host}:{port} within {timeout:.0f} s")


def _store_token(run_id: str, token: str) -> None:
    from prefect.blocks.system import Secret

    Secret(value=token).save(f"session-token-{run_id}", overwrite=True)


def _token_writer(run_id: str, token: str):
    """Store the token later in one API call: the block type and schema are registered (and the
    document built) now, while the app starts. Falls back to a plain save."""
    try:
        from prefect.blocks.system import Secret
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import BlockDocumentCreate

        Secret.register_type_and_schema()
        doc = BlockDocumentCreate(**Secret(value=token)._to_block_document(
            name=f"session-token-{run_id}", include_secrets=True).model_dump(
            include={"name", "block_schema_id", "block_type_id", "data", "is_anonymous"}))
    except Exception:
        return lambda: _store_token(run_id, token)

    def write() -> None:
        try:
            with get_client(sync_client=True) as client:
                client.create_block_document(block_document=doc)
        except Exception:  # already there (a retry), or anything else: the plain path
            _store_token(run_id, token)

    return write


def _drop_token(run_id: str) -> None:
    try:
        from prefect.blocks.system import Secret

        Secret.delete(f"session-token-{run_id}")
    except Exception:
        pass


# Server extensions a session needs: the lab UI and its terminal. Language-server discovery
# (jupyter_lsp) and the classic-notebook shim only lengthen the start.
JUPYTER_EXTENSIONS = {"jupyterlab": True, "jupyter_server_terminals": True, "jupyter_lsp": False,
                      "notebook_shim": False}


def _jupyter_argv(scratch: Path, port: int, host: str) -> list[str]:
    exts = ",".join(f"{json.dumps(k)}:{'True' if v else 'False'}" for k, v in JUPYTER_EXTENSIONS.items())
    return ["--no-browser", f"--ip={host}", f"--port={port}", "--port-retries=0", f"--ServerApp.root_dir={scratch}",
            f"--ServerApp.allow_remote_access={host not in ('127.0.0.1', 'localhost', '::1')}",  # --expose: True
            "--ServerApp.base_url=/", "--ServerApp.terminals_enabled=True",
            f"--ServerApp.jpserver_extensions={{{exts}}}", "--LabApp.extension_manager=readonly",
            "--LabApp.news_url=None", *(["--allow-root"] if os.geteuid() == 0 else [])]


class _ForkedApp:
    """The app in a forked child of this (already-imported) interpreter; Popen's poll/terminate/kill/wait."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_jupyter(scratch: Path, argv: list[str], token: str) -> _ForkedApp:
    """Serve JupyterLab from a fork of this process, which has JupyterLab imported already.

    Importing JupyterLab is most of its start (seconds; far more on a busy machine). The agent's
    warm engines import it before any run exists, so a session forks a server that only has to
    start. The child is what ``python -m jupyterlab`` would be: same cgroup, CPUs, process group,
    environment and stdout/stderr as the run; it never runs this process's exit handlers.
    """
    pid = os.fork()
    if pid:
        return _ForkedApp(pid)
    code = 1
    try:
        # Python's own signal defaults (the server installs its handlers); the run's descriptors stay
        # open, as closing them under this process's objects could later close the server's own.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.environ["JUPYTER_TOKEN"] = token
        os.chdir(scratch)
        from jupyterlab.labapp import LabApp

        LabApp.launch_instance(argv=argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _jupyter(scratch: Path, port: int, host: str, token: str):
    argv = _jupyter_argv(scratch, port, host)
    if "jupyterlab.labapp" in sys.modules and hasattr(os, "fork"):  # imported already (a warm engine): fork
        return _fork_jupyter(scratch, argv, token)
    env = dict(os.environ, JUPYTER_TOKEN=token)
    return subprocess.Popen([sys.executable, "-m", "jupyterlab", *argv], cwd=scratch, env=env,
                            stdout=sys.stdout, stderr=sys.stderr)


def _member() -> str:
    """This process's cluster member (main1 outside a cluster)."""
    return os.environ.get("LAUNCH_CLUSTER_MEMBER") or "main1"


def _logger():
    """The run's logger in main1 (the flow engine); a sub member runs the function without a run context."""
    try:
        return get_run_logger()
    except Exception:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s | %(levelname)s | {_member()} - %(message)s")
        return logging.getLogger("launch.session")


def _hold_until_terminated(log) -> dict:
    """A sub member of an interactive cluster session: keep its share until the agent ends the session."""
    log.info("cluster member %s holds its resources; the apps are served by main1", _member())
    stopped = {"signal": None}

    def on_term(signum, _frame):
        stopped["signal"] = signum

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while stopped["signal"] is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"result": "terminated"}


@flow(name="launch-session", log_prints=True)
def session(session_type: str = "interactive", startup_command: str = "", ports: list[int] | None = None,
            mounts: list[str] | None = None, apps: list[str] | None = None, bind_host: str = "127.0.0.1") -> dict:
    log = _logger()
    run_id = str(flow_run.id)
    member = _member()
    scratch = _scratch_root() / (run_id if member == "main1" else f"{run_id}.{member}")
    scratch.mkdir(parents=True, exist_ok=True)
    ports = list(ports or [])
    stop = {"signal": None}
    # session variables for the command and the apps (Backend.AI's BACKENDAI_SESSION_* equivalents)
    os.environ.update(LAUNCH_SESSION_ID=run_id, LAUNCH_SESSION_NAME=str(flow_run.name),
                      LAUNCH_SESSION_PORTS=",".join(map(str, ports)), LAUNCH_SESSION_SCRATCH=str(scratch))
    if os.environ.get("LAUNCH_OMP_THREADS"):  # --omp-threads; otherwise the agent's default: the session's CPUs
        os.environ["OMP_NUM_THREADS"] = os.environ["LAUNCH_OMP_THREADS"]

    def on_term(signum, _frame):  # a terminate: stop the apps, clean up, end
        stop["signal"] = signum
        raise KeyboardInterrupt

    try:
        linked = _link_mounts(scratch, list(mounts or []))
        if linked:
            log.info("mounts: %s", "; ".join(linked))
        else:
            log.warning("no mounts: nothing in the scratch folder %s is kept after the session ends", scratch)
        if session_type == "batch":
            log.info("startup command%s: %s", "" if member == "main1" else f" (cluster member {member})",
                     startup_command)
            proc = subprocess.run(startup_command, shell=True, cwd=scratch)
            if proc.returncode != 0:
                raise SessionFailed(f"task-failed: the startup command exited with code {proc.returncode}")
            return {"result": "task-finished", "exit_code": 0}
        if member != "main1":
            return _hold_until_terminated(log)
        apps = list(apps or ["jupyterlab"])
        if not ports:
            raise ValueError("an interactive session needs at least one port for its apps")
        token = secrets.token_urlsafe(24)
        children = []
        store_token = None
        for app, port in zip(apps, ports):
            if app != "jupyterlab":
                raise ValueError(f"unknown app {app!r}; sessions serve: jupyterlab")
            children.append(_jupyter(scratch, port, bind_host, token))
            store_token = store_token or _token_writer(run_id, token)  # while the app starts
            _wait_port(bind_host, port, children[-1])
            how = "forked from the warm engine" if isinstance(children[-1], _ForkedApp) else "started cold"
            log.info("%s ready on http://%s:%s/lab (%s; token in Secret block session-token-%s)", app, bind_host,
                     port, how, run_id)
        (store_token or (lambda: _store_token(run_id, token)))()  # only now: a URL once the app answers
        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            while all(c.poll() is None for c in children):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            for c in children:
                if c.poll() is None:
                    c.terminate()
            for c in children:
                try:
                    c.wait(10)
                except subprocess.TimeoutExpired:
                    c.kill()
        if stop["signal"] is None:
            raise RuntimeError("the session's app exited on its own")
        return {"result": "terminated"}
    finally:
        if member == "main1":
            _drop_token(run_id)
        shutil.rmtree(scratch, ignore_errors=True)
