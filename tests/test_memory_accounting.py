"""Memory is counted once: a job that holds 300 MiB and forks two workers that read it.

Real processes, real cgroups (cgroup v1, as root) or PSS where a run has no group.
The truth the tests compare with is the kernel's own charge of a memory cgroup
(``memory.max_usage_in_bytes``); summing RSS over the tree would count the shared
300 MiB three times.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from uuid import uuid4

import pytest

from prefect_launch.blocks.metrics_records import RunRecord
from prefect_launch.workers.agent import limits as L
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.limits import MemoryGroup, RunLimits, tree_rss
from prefect_launch.workers.scheduling.resources import Resources, parse_size
from prefect_launch.workers.metrics.sampler import RunSampler

MiB = 1 << 20

# base MiB held by the parent, extra MiB each of the 2 forked workers allocates on its own,
# seconds the workers keep reading the parent's pages. Starts on a line on stdin.
FORKED_JOB = textwrap.dedent("""
    import os, sys, time
    base, extra, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    sys.stdin.readline()
    data = bytearray(base << 20)
    for i in range(0, len(data), 4096):
        data[i] = 1
    kids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            own = bytearray(extra << 20)
            for i in range(0, len(own), 4096):
                own[i] = 1
            end = time.time() + hold
            s = 0
            while time.time() < end:
                for i in range(0, len(data), 4096 * 8):
                    s += data[i]
                time.sleep(0.05)
            os._exit(0)
        kids.append(pid)
    bad = 0
    for pid in kids:
        bad |= os.waitpid(pid, 0)[1]
    sys.exit(1 if bad else 0)
""")


def _cgroups_writable() -> bool:
    g = MemoryGroup.create(f"probe-{uuid4().hex[:8]}", 64 * MiB)
    if g is None:
        return False
    g.remove()
    return True


CGROUPS = _cgroups_writable()


def _meter_group() -> Path | None:
    """A plain memory group (no limit) the test puts a job in to read the kernel's own figures."""
    if not CGROUPS:
        return None
    path = L.cgroup_memory_root() / "prefect-launch-test" / uuid4().hex[:12]
    path.mkdir(parents=True)
    return path


def _start(args: list[str], group: Path | None = None) -> subprocess.Popen:
    def enter_group() -> None:
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.Popen([sys.executable, "-c", FORKED_JOB, *args], stdin=subprocess.PIPE,
                            start_new_session=True, preexec_fn=enter_group)


def _alloc(run_id: str, memory: int, cores: list[int] | None = None) -> Allocation:
    return Allocation(run_id=run_id, resources=Resources(cpu=1, memory=memory), cpu_cores=cores or [])


async def _run(use_cgroup: bool, limit: int, base: int, extra: int, hold: float) -> dict:
    """Start the job under RunLimits and the sampler, as the agent does; return what each saw."""
    run_id = str(uuid4())
    meter = None if use_cgroup else _meter_group()
    proc = _start([str(base), str(extra), str(hold)], meter)
    limits = RunLimits(run_id, _alloc(run_id, limit), use_cgroup=use_cgroup, interval_s=0.2)
    limits.apply(proc.pid)
    if use_cgroup:
        assert limits.group is not None
    sampler = RunSampler(None, RunRecord(flow_run_id=run_id), proc.pid, [], allocated_cpus=1,
                         allocated_memory_bytes=limit, interval_s=0.2).start()
    t0 = time.monotonic()
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    rss_sum = 0
    while proc.poll() is None:
        rss_sum = max(rss_sum, tree_rss(proc.pid))
        await asyncio.sleep(0.1)
    elapsed = time.monotonic() - t0
    group = limits.group or (MemoryGroup(meter) if meter else None)
    kernel_peak = group.peak() if group else None
    watch_reason = limits.kill_reason
    reason = limits.finish()
    summary = sampler.stop("COMPLETED" if proc.returncode == 0 else "CRASHED")
    if meter is not None:  # empty once the killed workers are reaped
        for _ in range(50):
            try:
                meter.rmdir()
                break
            except OSError:
                await asyncio.sleep(0.1)
    return dict(run_id=run_id, proc=proc, elapsed=elapsed, rss_sum=rss_sum, kernel_peak=kernel_peak,
                watch_reason=watch_reason, reason=reason, summary=summary, sampler=sampler, limits=limits)


def _modes():
    return [pytest.param(True, id="cgroup", marks=pytest.mark.skipif(not CGROUPS, reason="cgroup v1 memory not writable")),
            pytest.param(False, id="pss")]


@pytest.mark.parametrize("use_cgroup", _modes())
def test_forked_workers_fit_a_limit_the_rss_sum_exceeds(use_cgroup: bool):
    limit = 600 * MiB
    r = asyncio.run(_run(use_cgroup, limit, base=300, extra=0, hold=2.0))
    # the old count (RSS summed over the tree) saw ~3x 300 MiB: more than the limit
    assert r["rss_sum"] > limit
    # counted once, the job fits: it completes and nobody stopped it
    assert r["proc"].returncode == 0, r["reason"]
    assert r["reason"] is None
    s = r["summary"]
    assert 300 * MiB <= s.peak_rss_bytes < 450 * MiB
    assert r["sampler"].memory_source == ("cgroup" if use_cgroup else "pss")
    assert r["sampler"].record.extra["memory_measure"] == r["sampler"].memory_source
    # the watch and the sampler count the same way (once, not 3x), each at its own 0.2-s ticks: a transient
    # peak while the workers fork (copy-on-write pages) can fall between one's ticks and not the other's
    # (16.6 % apart in one clean-clone CI run), so the bound is loose next to the 3x it tells apart
    assert r["limits"].peak_rss == pytest.approx(s.peak_rss_bytes, rel=0.25)
    assert max(x.rss_bytes for x in r["sampler"].recent) >= 300 * MiB
    if r["kernel_peak"] is not None:  # the kernel's own maximum charge for the job
        assert s.peak_rss_bytes == pytest.approx(r["kernel_peak"], rel=0.12)


@pytest.mark.parametrize("use_cgroup", _modes())
def test_forked_workers_over_the_limit_are_stopped_with_the_reason(use_cgroup: bool):
    limit = 600 * MiB  # 300 MiB shared + 2 x 250 MiB private: ~820 MiB really held
    r = asyncio.run(_run(use_cgroup, limit, base=300, extra=250, hold=6.0))
    assert r["proc"].returncode == -signal.SIGKILL
    assert r["elapsed"] < 5.0  # stopped, not finished
    assert r["reason"] and r["reason"].startswith("memory limit exceeded")
    if use_cgroup:
        assert "killed by the kernel (cgroup OOM)" in r["reason"]
        # the watch stopped the whole run when the kernel killed a worker
        assert r["watch_reason"] == r["reason"]
    else:
        assert "stopped by the agent" in r["reason"]
        used = parse_size(r["reason"].split("the run used ")[1].split(" ")[0])
        # counted once: well under the ~1.4Gi an RSS sum gives at the kill; the test's own 0.1-s poll of the RSS sum
        # may stop before that (the run is killed between two polls), but it had passed the limit already
        assert limit < used < 900 * MiB and r["rss_sum"] > limit
    _gone(L.cgroup_memory_root() / "prefect-launch" / r["run_id"])


def _gone(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists(), f"{path} was left behind"


# ------------------------------------------------------------------ attach

HOLDER = textwrap.dedent("""
    import os, sys, time
    mb = int(sys.argv[1])
    sys.stdin.readline()
    if os.fork() == 0:          # a worker goes over the limit
        x = bytearray(mb << 20)
        for i in range(0, len(x), 4096):
            x[i] = 1
        time.sleep(30)
        os._exit(0)
    time.sleep(30)             # the main process just waits
""")


def _holder(mb: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(mb)], stdin=subprocess.PIPE, start_new_session=True)


async def _until_dead(proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.skipif(not CGROUPS, reason="cgroup v1 memory not writable")
def test_attach_reopens_the_runs_group_and_watches_again():
    run_id = str(uuid4())
    group = MemoryGroup.create(run_id, 200 * MiB)  # what the agent before the restart set up
    proc = _holder(400)
    try:
        assert group.add(proc.pid)
        os.sched_setaffinity(proc.pid, {0})

        async def main():
            # the restarted agent's allocation says 1Gi and core 1: attach must not apply either
            limits = RunLimits(run_id, _alloc(run_id, 1 << 30, cores=[1]), interval_s=0.2)
            limits.attach(proc.pid)
            assert limits.group is not None and limits.group.path == group.path
            assert group.limit() == 200 * MiB  # the limit was not rewritten
            assert group.pids() == {proc.pid}  # nothing moved
            assert os.sched_getaffinity(proc.pid) == {0}  # affinity untouched
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            # the kernel kills the worker at 200 MiB; the main process would sleep on for 30 s:
            # only the re-started watch can stop it
            waited = await _until_dead(proc, 10)
            reason_from_watch = limits.kill_reason
            return waited, reason_from_watch, limits.finish()

        waited, watch_reason, reason = asyncio.run(main())
        assert proc.returncode == -signal.SIGKILL and waited < 5
        assert watch_reason and "killed by the kernel (cgroup OOM)" in watch_reason and reason == watch_reason
        _gone(group.path)  # finish removed it once its processes were reaped
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        group.remove()


@pytest.mark.parametrize("stray_group", [False, True], ids=["no-group", "pid-not-in-group"])
def test_attach_without_the_runs_group_watches_pss(stray_group: bool):
    run_id = str(uuid4())
    stray = MemoryGroup.create(run_id, 64 * MiB) if stray_group else None
    if stray_group and stray is None:
        pytest.skip("cgroup v1 memory not writable")
    proc = _holder(250)
    try:
        async def main():
            limits = RunLimits(run_id, _alloc(run_id, 150 * MiB), interval_s=0.2)
            limits.attach(proc.pid)
            assert limits.group is None  # no group of its own: PSS of the tree is watched
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            waited = await _until_dead(proc, 10)
            return waited, limits.finish()

        waited, reason = asyncio.run(main())
        assert proc.returncode == -signal.SIGKILL and waited < 5
        assert reason.startswith("memory limit exceeded: the run used") and "stopped by the agent" in reason
        if stray is not None:
            assert stray.limit() == 64 * MiB and proc.pid not in stray.pids()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if stray is not None:
            stray.remove()
