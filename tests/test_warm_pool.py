"""Warm engines preload JupyterLab only when sessions want it: jobs do not pay its import per run."""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import anyio
import psutil

from prefect_launch.workers.backends.warm_start import WarmPool


def _env_of(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_modes_without_processes():
    assert WarmPool(1, apps="auto").apps_now() is False  # a fresh agent: jobs only
    assert WarmPool(1, apps="1").apps_now() is True
    never = WarmPool(1, apps="0")
    never.want_apps()
    assert never.apps_now() is False
    auto = WarmPool(1, apps="auto")
    auto.want_apps(for_s=60)
    assert auto.apps_now() is True
    auto.want_apps(for_s=-1)  # the window has passed
    assert auto.apps_now() is False


def test_spawned_engines_are_told_whether_to_preload_apps():
    async def main() -> tuple[str, str]:
        pool = WarmPool(1, apps="auto", fork=False)  # the fresh-interpreter path reads it from its env
        try:
            await pool.fill()
            first = pool.take()
            before = _env_of(first.pid)["LAUNCH_WARM_APPS"]
            first.kill()
            await first.wait()
            pool.want_apps()  # what WarmEngineStarter does when it places an interactive session
            await pool.fill()
            after = _env_of(pool._ready[0].pid)["LAUNCH_WARM_APPS"]
            return before, after
        finally:
            await pool.close()

    assert anyio.run(main) == ("0", "1")


def test_spawned_engines_without_the_zygote_are_fresh_interpreters():
    """LAUNCH_ENGINE_FORK=0: each engine is a child of the agent that imports Prefect itself."""

    async def main() -> tuple[int, int]:
        pool = WarmPool(1, apps="auto", fork=False)
        try:
            await pool.fill()
            engine = pool.take()
            return psutil.Process(engine.pid).ppid(), os.getpid()
        finally:
            await pool.close()

    parent, me = anyio.run(main)
    assert parent == me


def test_forked_engines_come_from_one_preimported_zygote():
    """Each engine is a fork: no import CPU of its own, its own session, return codes as subprocess gives them."""

    async def main() -> dict:
        pool = WarmPool(2, apps="auto")
        out: dict = {}
        try:
            await pool.fill()
            a, b = pool.take(), pool.take()
            zygote_pid = pool.zygote._proc.pid
            out["parents"] = {psutil.Process(p.pid).ppid() for p in (a, b)} == {zygote_pid}
            out["sessions"] = all(os.getsid(p.pid) == p.pid for p in (a, b))
            out["cpu"] = max(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in (a, b))
            out["apps_before"] = a.apps_loaded
            await a.stdin.aclose()  # no order: the engine exits cleanly
            out["rc_eof"] = await a.wait()
            b.kill()
            out["rc_kill"] = await b.wait()
            pool.want_apps()
            await pool.fill()
            out["apps_after"] = pool._ready[0].apps_loaded
            t0 = time.monotonic()
            extra = WarmPool(1)
            extra.zygote = pool.zygote  # the zygote is warm: a fork costs milliseconds, not an import
            await extra.fill()
            out["fork_s"] = time.monotonic() - t0
            c = extra.take()
            os.kill(zygote_pid, signal.SIGKILL)  # the zygote dies under a live engine
            c.kill()
            out["rc_orphan"] = await c.wait()
        finally:
            await pool.close()
        out["zygote_gone"] = not psutil.pid_exists(zygote_pid) or psutil.Process(zygote_pid).status() == "zombie"
        return out

    out = anyio.run(main)
    assert out["parents"] and out["sessions"]
    assert out["cpu"] < 0.3, out  # a fresh interpreter spends over a second importing Prefect here
    assert out["rc_eof"] == 0 and out["rc_kill"] == -signal.SIGKILL
    assert out["apps_before"] is False
    assert out["apps_after"] is (importlib.util.find_spec("jupyterlab") is not None)
    assert out["fork_s"] < 5, out
    assert out["rc_orphan"] == -1  # unknown, and said so, rather than a made-up exit status
    assert out["zygote_gone"]


def test_close_does_not_wait_for_a_busy_zygote_and_leaves_live_engines_running():
    """A stopping agent used to wait up to 5 s for its zygote (still importing, or slow in its exit); the
    zygote holds no run, so it is killed after a short grace, and an engine it forked goes on."""

    async def main() -> dict:
        pool = WarmPool(1, apps="auto")
        out: dict = {}
        await pool.fill()
        engine = pool._ready.pop()  # a run's engine: not idle in the pool any more
        zygote_pid = pool.zygote._proc.pid
        os.kill(zygote_pid, signal.SIGSTOP)  # a zygote that cannot read its socket (as while it imports)
        await pool.close()
        out["zygote_gone"] = not psutil.pid_exists(zygote_pid) or psutil.Process(zygote_pid).status() == "zombie"
        out["engine_alive"] = psutil.Process(engine.pid).status() != "zombie"
        engine.kill()
        await engine.wait()
        return out

    out = anyio.run(main)
    assert out["zygote_gone"] and out["engine_alive"], out  # before: left stopped, alive, after a 5-s wait
