"""One pre-imported interpreter that forks the agent's warm engines.

A warm engine (workers/backends/warm_engine.py) used to be a fresh interpreter that imported Prefect before
its run existed. That hid the import from the run's start time, but not from the box: about 1.8 s
of CPU per run, paid while other runs compete for the cores. This process imports Prefect once;
each warm engine is a fork of it, ready in milliseconds, with its pages shared until written.

Protocol, over a Unix SOCK_SEQPACKET socket the agent passes as ``--fd``:

- the agent sends ``{"apps": bool}`` with four descriptors: the engine's stdin (read end), stdout
  and stderr (write ends) and a status pipe (write end);
- the zygote forks; the child starts its own session, takes the three as 0/1/2, closes every
  other descriptor and becomes a warm engine; the zygote answers ``{"pid": N}``;
- when the child ends, the zygote writes its return code (``subprocess``'s convention: minus the
  signal number when killed) to the status pipe and closes it. The child is the zygote's, not the
  agent's, so only the zygote can read its exit status.

When the agent's end of the socket closes (the agent exited or was killed) the zygote exits and
leaves its children running: each run keeps going in its own session, as a cold-started one does,
and a restarted agent re-adopts it from its journal.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
from typing import Optional

from prefect_launch.workers.backends.warm_engine import PRELOAD, PRELOAD_APPS


def _preload(names: tuple[str, ...]) -> bool:
    """Import what can be imported; True when all of it could."""
    import importlib

    ok = True
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            ok = False
    return ok


def _report(status_fds: dict[int, int]) -> None:
    """Reap every ended child and tell the agent its return code."""
    while status_fds:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is None:
            continue
        try:
            os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
        except OSError:  # the agent is gone: nobody to tell
            pass
        finally:
            os.close(fd)


def serve(sock: socket.socket) -> Optional[list[int]]:
    """The zygote's loop. Returns only in a forked child, with its (stdin, stdout, stderr) set up."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status_fds: dict[int, int] = {}
    apps_loaded = False
    while True:
        try:
            ready = select.select([sock, wake_r], [], [])[0]
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        _report(status_fds)
        if sock not in ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 4)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the agent went away
            return None
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"error": f"expected 4 descriptors, got {len(fds)}"}).encode())
            continue
        request = json.loads(msg)
        if request.get("apps") and not apps_loaded:
            apps_loaded = _preload(PRELOAD_APPS)
        sys.stdout.flush()
        sys.stderr.flush()
        set_r, set_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            sock.detach()  # its descriptor is closed below; the object must not close a reused number later
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            os.write(set_w, b"1")
            os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
            return fds[:3]
        os.close(set_w)
        os.read(set_r, 1)  # the child leads its own session before the agent learns its pid (killpg)
        os.close(set_r)
        for fd in fds[:3]:
            os.close(fd)
        status_fds[pid] = fds[3]
        sock.send(json.dumps({"pid": pid, "apps": apps_loaded}).encode())


def main() -> None:
    ap = argparse.ArgumentParser(description="pre-imported Prefect engine forker (started by the agent)")
    ap.add_argument("--fd", type=int, required=True, help="the agent's SOCK_SEQPACKET socket")
    args = ap.parse_args()
    sock = socket.socket(fileno=args.fd)
    _preload(PRELOAD)
    if serve(sock) is None:
        return
    # A forked child: from here it is a warm engine, and exits as an interpreter normally does
    # (atexit handlers, Prefect's log and event workers flushed).
    os.environ["LAUNCH_WARM_APPS"] = "0"  # the zygote loaded them before the fork if they were asked for
    from prefect_launch.workers.backends import warm_engine

    warm_engine.main()


if __name__ == "__main__":
    main()
