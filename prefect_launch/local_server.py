"""Start and stop a local Prefect server on loopback: for tests, benchmarks and scripts.

One place for what every test fixture and benchmark needs: a free port, a
private PREFECT_HOME (SQLite), a health wait, and a clean stop.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(home: Path, api_url: str, ui: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    if not ui:
        env.update(PREFECT_UI_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false")
    return env


def wait_healthy(api_url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 120,
                 log: Optional[Path] = None, health_path: str = "/health", what: str = "prefect server") -> None:
    """Wait until ``api_url + health_path`` answers 200 (any local server: Prefect, Streamlit)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{api_url}{health_path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} at {api_url} did not become healthy in {timeout:.0f} s; see {log}")


@contextlib.contextmanager
def local_prefect_server(home: Optional[Path] = None, port: Optional[int] = None, ui: bool = False,
                         export: bool = True) -> Iterator[str]:
    """Run ``prefect server start`` on 127.0.0.1; yields the API URL.

    With ``export`` the URL and home go into ``os.environ`` (so subprocesses use this server)
    and Prefect's in-process settings are refreshed to match.
    """
    home = Path(home or tempfile.mkdtemp(prefix="prefect-launch-"))
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log_path = home / "server.log"
    log = open(log_path, "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=server_env(home, api_url, ui), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_healthy(api_url, proc, log=log_path)
        if export:
            os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=api_url,
                              PREFECT_SERVER_ANALYTICS_ENABLED="false")
            import prefect.context

            prefect.context.refresh_global_settings_context()
        yield api_url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def background_process(args: list[str], log_path: Path, env: Optional[dict] = None,
                       cwd: Optional[Path] = None) -> Iterator[subprocess.Popen]:
    """Run ``args`` in its own session, logging to ``log_path``; Ctrl-C it (then kill) on exit."""
    import signal

    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                            cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
