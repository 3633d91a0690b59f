"""What a run change costs between one run's end and the next one's claim (bench/preemption.py's transition gaps).

- A run's end wakes the agent's intake (every queue's worker of the agent) at once: the next waiting run is
  planned then, not at the next poll. Real worker, ledger and run-end path; only the intake cycle itself (a read
  of the server's due runs) is replaced by a recorder.
- A warm engine does not wait for Prefect's heartbeat thread (a daemon sleeping in 1-s steps) after its run's
  final state: its process, and so the run's capacity, is gone up to a second sooner (Prefect's own
  ``join_on_exit=False``, the async engine's choice; prefect_launch/compat/prefect.py).
- A warm engine ends once its threads, exit handlers and open files are done, without the interpreter's
  finalization (seconds on a loaded box, the run's capacity held meanwhile).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from uuid import uuid4

from prefect import flow_engine

from prefect_launch.compat.prefect import ENGINE_HEARTBEATS, engine_heartbeats_unjoined
from prefect_launch.workers.agent.context import AgentContext
from prefect_launch.workers.backends.warm_engine import exit_code
from prefect_launch.workers.backends.process import LaunchProcessWorker
from prefect_launch.workers.scheduling.resources import Resources


def test_a_run_end_wakes_every_queue_of_the_agent_before_the_poll_interval(monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCH_STATE_DIR", str(tmp_path))
    ctx = AgentContext.detect("cpu=2,memory=4Gi,gpu=2", warm_engines=0)
    workers = [LaunchProcessWorker(work_pool_name=q, agent=ctx) for q in ("q-a", "q-b")]
    run_id = uuid4()
    assert ctx.ledger.try_allocate(str(run_id), Resources(cpu=1, memory=2**30, gpu=1), queue="q-a") is not None

    async def main() -> list[str]:
        cycles: list[str] = []
        woken = asyncio.Event()
        for w in workers:
            w.poll_seconds = 3600.0  # only a wake-up can start a cycle within this test
            w._wake = asyncio.Event()

            async def cycle(name=w._work_pool_name):
                cycles.append(name)
                if len(cycles) == len(workers):
                    woken.set()
                return []

            w.get_and_submit_flow_runs = cycle
        loops = [asyncio.create_task(w._wake_loop()) for w in workers]
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            assert cycles == [], "a cycle ran before any run ended or the poll interval passed"
            await workers[0].ends.on_finished(SimpleNamespace(id=run_id, name="r"), 0)
            assert ctx.ledger.get(str(run_id)) is None, "the run's capacity went back"
            await asyncio.wait_for(woken.wait(), 60)  # a safety bound, far below the 3600-s poll
            return cycles
        finally:
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    assert sorted(asyncio.run(main())) == ["q-a", "q-b"]


class _Engine:
    """What Prefect's heartbeat context reads of its engine; the heartbeat itself blocks on ``gate``."""

    heartbeat_seconds = 30

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.emitting = threading.Event()
        self.flow_run = SimpleNamespace(state=SimpleNamespace(is_final=lambda: False))
        self.logger = SimpleNamespace(debug=lambda *a, **k: None)

    def _build_heartbeat_event_template(self):
        return {}, []

    def _emit_flow_run_heartbeat(self, resource, related) -> None:
        self.emitting.set()
        self.gate.wait()


def test_a_warm_engine_leaves_prefects_heartbeat_thread_unjoined_at_its_runs_end(monkeypatch):
    joined: list[threading.Thread] = []
    real_join = threading.Thread.join

    def recording_join(self, timeout=None):
        joined.append(self)
        return real_join(self, 0)

    monkeypatch.setattr(flow_engine, ENGINE_HEARTBEATS, getattr(flow_engine, ENGINE_HEARTBEATS))  # restored after
    assert engine_heartbeats_unjoined()
    assert engine_heartbeats_unjoined(), "installing twice keeps one wrapper"
    engine = _Engine()
    before = set(threading.enumerate())
    monkeypatch.setattr(threading.Thread, "join", recording_join)
    try:
        with getattr(flow_engine, ENGINE_HEARTBEATS)(engine):  # how the sync engine's run_context calls it
            assert engine.emitting.wait(60)
            beat = [t for t in threading.enumerate() if t not in before]
    finally:
        monkeypatch.setattr(threading.Thread, "join", real_join)
        engine.gate.set()
    assert len(beat) == 1 and beat[0].daemon, "Prefect's heartbeat thread ran"
    assert beat[0] not in joined, "the run's end waited for the heartbeat thread"


def test_the_wrapper_passes_prefects_own_parameter(monkeypatch):
    seen: list[dict] = []

    @contextmanager
    def recorder(engine, join_on_exit: bool = True):
        seen.append({"engine": engine, "join_on_exit": join_on_exit})
        yield

    monkeypatch.setattr(flow_engine, ENGINE_HEARTBEATS, recorder)
    assert engine_heartbeats_unjoined()
    with getattr(flow_engine, ENGINE_HEARTBEATS)("e"):
        pass
    assert seen == [{"engine": "e", "join_on_exit": False}]


ENDING = """
import atexit, os, sys, threading
from prefect_launch.workers.backends.warm_engine import finish_fast
out = sys.argv[1]

class Finalized:
    def __init__(self):
        self.fd, self.write = os.open(out + "/finalized", os.O_WRONLY | os.O_CREAT), os.write

    def __del__(self):
        self.write(self.fd, b"x")

keep = Finalized()  # the interpreter's finalization would write its file
unclosed = open(out + "/unclosed", "w")
unclosed.write("kept")  # buffered, never closed: only a flush at the end writes it
started = threading.Event()

def work():
    started.wait()
    open(out + "/thread", "w").close()

threading.Thread(target=work).start()  # not a daemon: the end waits for it
atexit.register(lambda: open(out + "/atexit", "w").close())
print("to stdout", end="")
started.set()
finish_fast(3)
"""


def test_a_warm_engine_ends_after_its_threads_exit_handlers_and_files_without_finalization(tmp_path):
    done = subprocess.run([sys.executable, "-c", ENDING, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "to stdout"
    assert (tmp_path / "thread").exists() and (tmp_path / "atexit").exists()
    assert (tmp_path / "unclosed").read_text() == "kept"
    assert (tmp_path / "finalized").read_text() == "", "the interpreter's finalization ran"


def test_the_engines_exit_status_is_the_interpreters():
    assert [exit_code(SystemExit(c)) for c in (None, 0, 1, 2, 256 + 7)] == [0, 0, 1, 2, 7]
    assert exit_code(SystemExit("a message")) == 1
