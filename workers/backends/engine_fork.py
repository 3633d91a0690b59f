"""The agent's side of the engine zygote (workers/backends/engine_zygote.py): start it, fork engines from it.

`ForkedEngine` gives a forked engine the shape of the process that ``anyio.open_process`` returns
(pid, return code, stdin/stdout/stderr streams, wait, signals), so the warm-start path and Prefect's
output streaming and termination treat it exactly as a spawned one. Its return code comes from the
zygote over a status pipe; if the zygote itself is gone the engine is watched by its pid and its
return code is unknown (-1), which the agent logs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional

import anyio
import anyio.abc
import psutil

logger = logging.getLogger("prefect_launch.engine_fork")

UNKNOWN_RETURN_CODE = -1


class _PipeReceive(anyio.abc.ByteReceiveStream):
    """The read end of a pipe, non-blocking, on the event loop."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self._fd: Optional[int] = fd

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            if self._fd is None:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def aclose(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class _PipeSend(anyio.abc.ByteSendStream):
    """The write end of a pipe, non-blocking, on the event loop."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self._fd: Optional[int] = fd

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            if self._fd is None:
                raise anyio.ClosedResourceError
            try:
                view = view[os.write(self._fd, view):]
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
            except BrokenPipeError as exc:
                raise anyio.BrokenResourceError from exc

    async def aclose(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class ForkedEngine(anyio.abc.Process):
    """A warm engine forked by the zygote, seen through the interface of a spawned process."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int, stderr_fd: int, status_fd: int):
        self._pid = pid
        self._stdin = _PipeSend(stdin_fd)
        self._stdout = _PipeReceive(stdout_fd)
        self._stderr = _PipeReceive(stderr_fd)
        os.set_blocking(status_fd, False)
        self._status_fd: Optional[int] = status_fd
        self._status = b""
        self._returncode: Optional[int] = None
        self._reading = False
        self.apps_loaded = False  # JupyterLab's modules came with the fork (the zygote says so)
        try:
            self._ps: Optional[psutil.Process] = psutil.Process(pid)
        except psutil.Error:
            self._ps = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> Optional[int]:
        if self._returncode is None:
            self._poll_status()
        return self._returncode

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        return self._stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        return self._stdout

    @property
    def stderr(self) -> anyio.abc.ByteReceiveStream:
        return self._stderr

    def _poll_status(self) -> bool:
        """Read what the zygote wrote; True once the return code is known."""
        if self._returncode is not None:
            return True
        if self._status_fd is not None:
            try:
                while True:
                    chunk = os.read(self._status_fd, 64)
                    if not chunk:
                        os.close(self._status_fd)
                        self._status_fd = None
                        break
                    self._status += chunk
            except BlockingIOError:
                return False
            if self._status.strip():
                self._returncode = int(self._status)
                return True
            logger.warning("the engine zygote ended before engine %s; watching it by its pid", self._pid)
        # The zygote is gone: nobody can read the exit status; watch the pid (its start time guards reuse).
        if self._ps is None or not self._ps.is_running() or self._ps.status() == psutil.STATUS_ZOMBIE:
            self._returncode = UNKNOWN_RETURN_CODE
            logger.warning("engine %s ended after its zygote; its return code is unknown", self._pid)
            return True
        return False

    async def wait(self) -> int:
        while not self._poll_status():
            if self._status_fd is None or self._reading:  # orphaned, or another task reads the pipe
                await anyio.sleep(0.05 if self._status_fd is not None else 0.5)
                continue
            self._reading = True
            try:
                await anyio.wait_readable(self._status_fd)
            finally:
                self._reading = False
        assert self._returncode is not None
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self._pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def aclose(self) -> None:
        for stream in (self._stdin, self._stdout, self._stderr):
            await stream.aclose()
        try:
            await self.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                self.kill()
                await self.wait()
            raise


class EngineZygote:
    """The agent's zygote: started on first use, started again if it died."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()

    def _start(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "prefect_launch.workers.backends.engine_zygote", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )
        except Exception:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def fork(self, env: dict[str, str], apps: bool, timeout: float = 120.0) -> ForkedEngine:
        """One engine, forked (blocking: call it from a worker thread). ``env`` starts the zygote."""
        with self._lock:
            if not self.alive():
                self._close_sock()
                self._start(env)
            assert self._sock is not None
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            st_r, st_w = os.pipe()
            mine, theirs = (in_w, out_r, err_r, st_r), (in_r, out_w, err_w, st_w)
            try:
                socket.send_fds(self._sock, [json.dumps({"apps": apps}).encode()], list(theirs))
                self._sock.settimeout(timeout)  # the first answer waits for the zygote's imports
                reply = json.loads(self._sock.recv(4096) or b"{}")
            except BaseException:
                for fd in mine:
                    os.close(fd)
                self._close_sock()
                raise
            finally:
                for fd in theirs:
                    os.close(fd)
            if "pid" not in reply:
                for fd in mine:
                    os.close(fd)
                raise RuntimeError(f"the engine zygote refused: {reply.get('error', 'no answer')}")
            engine = ForkedEngine(int(reply["pid"]), in_w, out_r, err_r, st_r)
            engine.apps_loaded = bool(reply.get("apps"))
            return engine

    def _close_sock(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def release(self) -> None:
        """Let the zygote go: it exits when its socket closes; its running engines are not touched.

        Does not block: `alive` says when it is gone (the caller waits on its own event loop).
        """
        with self._lock:
            self._close_sock()

    def kill(self) -> None:
        """SIGKILL the zygote itself (not its engines: each leads its own session). For a stopping agent
        whose zygote is still importing, or slow to exit: it holds no run, so nothing is lost."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
