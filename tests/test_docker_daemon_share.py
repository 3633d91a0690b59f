"""The suite's private dockerd (tests/docker_env.py) under faults: two workers that need it at once start
one daemon, the last one out stops it, and a daemon whose starter was killed with -9 is adopted and
stopped rather than left running with nobody to stop it.

Each test runs its own dockerd (its own socket folder and data root), so the suite's shared daemon and
the other workers' docker tests are not touched."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from docker_env import _answers, docker_daemon  # noqa: E402

pytestmark = [pytest.mark.server,  # dockerd, started by the holder processes
              pytest.mark.skipif(not shutil.which("dockerd") or os.geteuid() != 0,
                                 reason="needs dockerd and root (make system-deps installs docker.io)")]

HOLDER = """
import pathlib, sys, time
sys.path.insert(0, sys.argv[4])
from docker_env import docker_daemon
folder, data, release = map(pathlib.Path, sys.argv[1:4])
with docker_daemon(folder, data) as url:
    print("in", url, flush=True)
    while not release.exists():
        time.sleep(0.1)
print("out", flush=True)
"""


def _daemons(folder: Path) -> list[psutil.Process]:
    """The dockerd processes serving ``folder``'s socket."""
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if (p.info["name"] == "dockerd" and p.info["status"] != psutil.STATUS_ZOMBIE
                and f"--host=unix://{folder}/docker.sock" in (p.info["cmdline"] or [])):
            found.append(p)
    return found


class Holders:
    """Processes that each hold the daemon (``docker_daemon``) until their release file appears."""

    def __init__(self, tmp: Path) -> None:
        # a short folder: the daemon's unix sockets live under it (108-byte path limit)
        self.folder = Path(tempfile.mkdtemp(prefix="dkd-", dir="/tmp"))
        self.data = tmp / "data-root"
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(self.folder), str(self.data),
                                 str(self.tmp / f"release-{name}"), str(TESTS)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def release(self, name: str) -> None:
        (self.tmp / f"release-{name}").touch()

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        left = _daemons(self.folder)  # a failing test leaves no daemon behind: stopped, so it unmounts its data root
        for d in left:
            d.terminate()
        _, alive = psutil.wait_procs(left, timeout=30)
        for d in alive:
            d.kill()
        for mount in [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]:
            if mount.startswith((str(self.folder), str(self.data))):  # what a killed daemon leaves mounted
                subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.folder, ignore_errors=True)


def _wait_in(proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until ``proc`` says it holds the daemon (it prints one line when it does)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith("in "), f"holder did not get a daemon within {timeout} s: {line!r}"


def _wait_gone(folder: Path, timeout: float = 40) -> None:
    deadline = time.time() + timeout
    while _daemons(folder) and time.time() < deadline:
        time.sleep(0.2)


@pytest.fixture
def holders(tmp_path):
    h = Holders(tmp_path)
    try:
        yield h
    finally:
        h.cleanup()


def test_two_processes_at_once_start_one_daemon_and_the_last_out_stops_it(holders):
    a, b = holders.start("a"), holders.start("b")  # both decide at the same moment
    _wait_in(a)
    _wait_in(b)
    assert len(_daemons(holders.folder)) == 1, "two workers needing the daemon at once must start one"
    owner = int((holders.folder / "owner").read_text())
    first, second = ("a", "b") if owner == a.pid else ("b", "a")
    holders.release(first)  # the owner leaves first: it must wait for the other, not stop the daemon under it
    time.sleep(2)
    assert _daemons(holders.folder) and _answers(f"unix://{holders.folder}/docker.sock"), \
        "the owner stopped the daemon while another process still used it"
    holders.release(second)
    for p in (a, b):
        assert p.wait(timeout=60) == 0
    _wait_gone(holders.folder)
    assert not _daemons(holders.folder), "the daemon outlived every process that used it"


def test_a_daemon_whose_starter_was_killed_is_adopted_and_stopped(holders):
    a = holders.start("a")
    _wait_in(a)
    (daemon,) = _daemons(holders.folder)
    a.send_signal(signal.SIGKILL)  # the starter cannot stop it now; the daemon runs on in its own session
    a.wait()
    time.sleep(1)
    assert daemon.is_running(), "precondition: the killed starter's daemon is still running"
    with docker_daemon(holders.folder, holders.data) as url:
        assert _answers(url)
        assert [d.pid for d in _daemons(holders.folder)] == [daemon.pid], "adopted, not a second daemon"
        assert int((holders.folder / "owner").read_text()) == os.getpid()
    _wait_gone(holders.folder)
    assert not _daemons(holders.folder), "the adopted daemon was not stopped"


def test_a_sharer_that_leaves_last_after_its_starter_was_killed_stops_the_daemon(holders):
    a = holders.start("a")
    _wait_in(a)
    b = holders.start("b")
    _wait_in(b)
    (daemon,) = _daemons(holders.folder)
    a.send_signal(signal.SIGKILL)
    a.wait()
    holders.release("b")
    assert b.wait(timeout=60) == 0
    _wait_gone(holders.folder)
    assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE, \
        "the last sharer left the killed starter's daemon running"
