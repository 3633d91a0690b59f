"""Warm engines preload JupyterLab only when sessions want it: jobs do not pay its import per run."""

from __future__ import annotations

import anyio

from prefect_launch.workers.warm_start import WarmPool


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
        pool = WarmPool(1, apps="auto")
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
