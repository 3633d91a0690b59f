"""Warm starts: hand a placed run to a pre-imported engine process.

`WarmPool` keeps ``size`` engine processes (workers/backends/warm_engine.py) forked from
one pre-imported zygote (workers/backends/engine_zygote.py; a fresh interpreter each where
the zygote cannot start) and waiting; `WarmEngineStarter` is a Prefect `EngineCommandStarter` that, instead
of spawning ``python -m prefect.engine``, takes one from the pool, writes it the
run's environment and working directory, then streams its output and waits for
it exactly as Prefect's own starter does. The pool refills in the background.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Optional

import anyio
import anyio.abc
import anyio.to_thread
from prefect.settings import get_current_settings
from prefect.utilities.processutils import consume_process_output, sanitize_subprocess_env

from prefect_launch.compat.prefect import EngineCommandStarter, ProcessHandle, create_isolated_termination_scope
from prefect_launch.workers.agent.run_keys import CREDENTIAL_VARS, without_agent_key
from prefect_launch.workers.backends.engine_fork import EngineZygote
from prefect_launch.workers.agent.tags import tag_value

logger = logging.getLogger("prefect_launch.warm_start")


APPS_WARM_S = 3600.0  # after an interactive session, the next engines carry its apps this long
ZYGOTE_EXIT_GRACE_S = 0.5  # a released zygote that is not gone by then is killed (see WarmPool.close)


class WarmPool:
    """Engines started ahead of the runs they will become.

    JupyterLab's modules cost every engine about a second of CPU and several of disk reads; a box
    that only runs jobs should not pay that per run. ``LAUNCH_WARM_APPS``: ``auto`` (default)
    preloads them once the agent has placed an interactive session, for an hour after the last one;
    ``1`` always; ``0`` never.
    """

    def __init__(self, size: int = 1, apps: Optional[str] = None, fork: Optional[bool] = None):
        self.size = size
        self._ready: list[anyio.abc.Process] = []
        self._spawning = 0
        self.apps_mode = (apps or os.environ.get("LAUNCH_WARM_APPS") or "auto").lower()
        self._apps_until = 0.0
        if fork is None:  # LAUNCH_ENGINE_FORK=0: every engine a fresh interpreter, as before the zygote
            fork = os.environ.get("LAUNCH_ENGINE_FORK", "1").lower() not in ("0", "false", "no")
        self.zygote: Optional[EngineZygote] = EngineZygote() if fork else None

    def want_apps(self, for_s: float = APPS_WARM_S) -> None:
        """An interactive session was placed: the engines started from now on preload its apps."""
        self._apps_until = time.monotonic() + for_s

    def apps_now(self) -> bool:
        if self.apps_mode in ("1", "true", "always"):
            return True
        if self.apps_mode in ("0", "false", "never"):
            return False
        return time.monotonic() < self._apps_until

    async def _spawn(self) -> None:
        self._spawning += 1
        try:
            env = dict(os.environ)
            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
            env = without_agent_key(env)  # behind a gateway, engines get their run's key with their order
            env["LAUNCH_WARM_APPS"] = "1" if self.apps_now() else "0"
            if self.zygote is not None:
                env["LAUNCH_WARM_APPS"] = "0"  # the zygote loads them before a fork that asks for them
                try:
                    proc = await anyio.to_thread.run_sync(self.zygote.fork, sanitize_subprocess_env(env),
                                                          self.apps_now())
                    self._ready.append(proc)
                    return
                except Exception as exc:
                    logger.warning("could not fork an engine from the zygote (%s); starting a fresh one", exc)
            proc = await anyio.open_process(
                [sys.executable, "-m", "prefect_launch.workers.backends.warm_engine"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=sanitize_subprocess_env(env), start_new_session=True,
            )
            self._ready.append(proc)
        except Exception as exc:
            logger.warning("could not pre-start an engine process: %s", exc)
        finally:
            self._spawning -= 1

    async def fill_one(self) -> None:
        await self._spawn()

    async def fill(self) -> None:
        while len(self._ready) + self._spawning < self.size:
            await self._spawn()

    def take(self) -> Optional[anyio.abc.Process]:
        while self._ready:
            proc = self._ready.pop(0)
            if proc.returncode is None:
                return proc
        return None

    async def close(self) -> None:
        """Kill the idle engines and reap them while the event loop still runs."""
        procs, self._ready = self._ready, []
        for proc in procs:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        with anyio.move_on_after(5, shield=True):
            for proc in procs:
                await proc.wait()
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        try:
                            await stream.aclose()
                        except Exception:
                            pass
        if self.zygote is not None:
            self.zygote.release()  # it exits once its socket closes; its running engines go on
            with anyio.move_on_after(ZYGOTE_EXIT_GRACE_S, shield=True):
                while self.zygote.alive():
                    await anyio.sleep(0.02)
            # still importing its preloads (seconds under load), or slow in its interpreter's exit: it holds
            # no run, so it is killed rather than waited for (an idle agent stopped in ~0.5 s, not 3-7 s);
            # a SIGKILLed process is reaped at once, so the blocking wait is short
            self.zygote.kill()


class WarmEngineStarter(EngineCommandStarter):
    """Prefect's engine starter, with the process taken from a `WarmPool` when one is ready."""

    def __init__(self, *, pool: WarmPool, refill, before_order=None, log_path: Optional[str] = None, **kwargs):
        kwargs["isolate_process_group"] = True  # cold fallback also gets its own session
        super().__init__(**kwargs)
        self._pool = pool
        self._refill = refill
        self._before_order = before_order  # learns the pid before the engine becomes the run
        self._log_path = log_path  # the run writes here and the agent tails it (survives an agent crash)

    async def start(self, flow_run, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        if tag_value(getattr(flow_run, "tags", None), "session-type") == "interactive":
            self._pool.want_apps()  # before the refill below: the next engine is ready for the next session
        proc = self._pool.take()
        if proc is None and self._log_path:  # none ready: spawn one now, so the run still outlives the agent
            await self._pool.fill_one()
            proc = self._pool.take()
        self._refill()
        if proc is None:  # none could start: a cold start, exactly as Prefect does it
            await super().start(flow_run, task_status=task_status)
            return
        control_env: dict[str, str] = {}
        registered = False
        if self._control_channel is not None:
            try:
                port, token = self._control_channel.register(flow_run.id)
                control_env = {"PREFECT__CONTROL_PORT": str(port), "PREFECT__CONTROL_TOKEN": token}
                registered = True
            except RuntimeError:
                pass
        env: dict[str, Optional[str]] = dict(os.environ)
        env.update(self._env)
        env.update(get_current_settings().to_environment_variables(exclude_unset=True))
        env.update({k: self._env[k] for k in CREDENTIAL_VARS if k in self._env})  # the run's key, not the agent's
        env.update({
            "PREFECT__FLOW_RUN_ID": str(flow_run.id),
            "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS": "false",
            "PREFECT__DEPLOYMENT_NAME": self._deployment_name or self._env.get("PREFECT__DEPLOYMENT_NAME"),
            **control_env,
        })
        order = {"env": sanitize_subprocess_env(env), "cwd": str(self._cwd or os.getcwd()),
                 "log_path": self._log_path}
        if self._before_order is not None:
            self._before_order(proc.pid)
        try:
            await proc.stdin.send((json.dumps(order) + "\n").encode())
            await proc.stdin.aclose()
        except Exception:
            if registered:
                self._control_channel.unregister(flow_run.id)
            proc.kill()
            await super().start(flow_run, task_status=task_status)
            return
        async with proc:
            task_status.started(ProcessHandle(proc, termination_scope=create_isolated_termination_scope(proc.pid)))
            if self._log_path:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume_process_output, proc, sys.stdout, sys.stderr)  # output before the order
                    await tail_file(self._log_path, proc, sys.stdout if self._stream_output else None)
            else:
                await consume_process_output(proc, stdout_sink=sys.stdout, stderr_sink=sys.stderr)
            await proc.wait()


async def tail_file(path: str, proc: anyio.abc.Process, sink, interval: float = 0.2) -> None:
    """Copy what the run writes to ``path`` into ``sink`` until the process exits."""
    offset = 0

    def read_new() -> None:
        nonlocal offset
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:
            return
        offset += len(data)
        if data and sink is not None:
            try:
                sink.write(data.decode(errors="replace"))
                sink.flush()
            except (OSError, ValueError):
                pass

    while proc.returncode is None:
        read_new()
        with anyio.move_on_after(interval):
            await proc.wait()
    read_new()
