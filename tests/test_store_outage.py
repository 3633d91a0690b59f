"""The metrics store goes away while runs are sampled: runs go on, samples are buffered and
written when the store returns, what overflowed the buffer is counted and shown.

End to end: a real Prefect server, a real agent and job, and the metrics store on a
private PostgreSQL that the test stops with ``pg_ctl`` mid-run and starts again.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from uuid import uuid4

import pytest
from typer.testing import CliRunner

from launch_helpers import agent, apply_queue, cli_json, deploy_probe, records, wait_final, wait_running
from prefect_launch import cli as launch_cli
from prefect_launch.blocks.metrics_records import RunRecord
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.workers.metrics.sampler import RunSampler


def _wait_for(what: str, fn, timeout: float, every: float = 0.3):
    deadline = time.time() + timeout
    while True:
        try:
            got = fn()
        except Exception:  # the store may still be coming back
            got = None
        if got:
            return got
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def test_late_writer_stores_the_end_of_a_run_once_the_store_returns(tmp_path):
    """The store is down when the run ends: stop() returns at once, the rest is written when it is back."""
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}")
    rec = RunRecord(flow_run_id=str(uuid4()), queue="test")
    store.upsert_run(rec)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    s = RunSampler(store, rec, p.pid, [], 1, None, interval_s=0.1, batch_size=2, max_buffer=5,
                   retry_backoff_s=(0.05, 0.2), stop_flush_timeout_s=0.3).start()
    time.sleep(0.5)
    t_gone = datetime.now(timezone.utc)
    with store.engine.begin() as conn:  # the samples table goes away under the writer
        conn.exec_driver_sql("ALTER TABLE launch_samples RENAME TO launch_samples_away")
    taken, deadline = s.samples_taken, time.monotonic() + 60
    while s.samples_taken < taken + 8 and time.monotonic() < deadline:  # more than the buffer holds, however
        time.sleep(0.05)  # slowly a loaded box lets the sampler tick (a fixed sleep was too short under load)
    p.kill()
    p.wait()
    t0 = time.monotonic()
    summary = s.stop("COMPLETED")
    assert time.monotonic() - t0 < 3  # the run's end is not held up by the store
    assert summary.lost_samples == s.lost_samples > 5  # at stop: overflowed + not yet sent
    assert store.get_summary(rec.flow_run_id) is None
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE launch_samples_away RENAME TO launch_samples")
    assert s.late_written is not None and s.late_written.wait(10)
    late = store.get_summary(rec.flow_run_id)
    assert late is not None and late.exit_state == "COMPLETED"
    pts = store.series(rec.flow_run_id)
    assert len([p for p in pts if p["ts"] > t_gone]) == 5  # the full buffer, written late
    assert late.lost_samples == s.lost_samples == s.samples_taken - len(pts) > 0
    assert late.samples == summary.samples == s.samples_taken
    assert store.get_run(rec.flow_run_id).state == "COMPLETED"


def test_locked_sqlite_store_counts_every_sample_once(tmp_path):
    """Another process holds the SQLite store's write lock: the writer's batch waits in flight while the
    full buffer drops samples; each sample ends up either stored or counted lost, never both."""
    import sqlite3

    db = tmp_path / "m.db"
    store = RunMetricsStore(url=f"sqlite:///{db}")
    rec = RunRecord(flow_run_id=str(uuid4()), queue="test")
    store.upsert_run(rec)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.0)"])
    s = RunSampler(store, rec, p.pid, [], 1, None, interval_s=0.1, batch_size=2, max_buffer=3,
                   retry_backoff_s=(0.05, 0.1)).start()
    time.sleep(0.4)
    locker = sqlite3.connect(db, timeout=5, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # the store is locked: writes wait (busy timeout)
    time.sleep(1.0)
    locker.execute("ROLLBACK")
    locker.close()
    p.wait()
    summary = s.stop("COMPLETED")
    pts = store.series(rec.flow_run_id)
    assert s.lost_samples > 0  # ~10 samples came while the buffer held 3
    assert summary.samples == s.samples_taken == len(pts) + summary.lost_samples
    assert store.get_summary(rec.flow_run_id).lost_samples == summary.lost_samples


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


class _Postgres:
    """A PostgreSQL of this test's own (initdb/pg_ctl on a loopback port) that it stops and starts again."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="launch-pg-outage-"))
        self.data, sock = self.base / "data", self.base / "sock"
        sock.mkdir()
        self.user = None
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            self.user = next(u for u in ("postgres", "nobody") if _has_user(u))
            pw = pwd.getpwnam(self.user)
            for d in (self.base, sock):
                os.chown(d, pw.pw_uid, pw.pw_gid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.opts = f"-p {self.port} -k {sock} -h 127.0.0.1 -F -c fsync=off"
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "launch", "--auth=trust", "--no-sync")

    def _run(self, *argv: str) -> None:
        cmd = ["runuser", "-u", self.user, "--", *argv] if self.user else list(argv)
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.base / "pg.log"), "-o", self.opts,
                  "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://launch@127.0.0.1:{self.port}/{db}"


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture
def private_pg():
    if not _pg_bin("initdb") or not _pg_bin("pg_ctl") or (os.geteuid() == 0 and not shutil.which("runuser")):
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed; run scripts/system-deps.sh")
    pg = _Postgres()
    pg.start()
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=pg.port, user="launch", dbname="postgres", autocommit=True) as conn:
        conn.execute('CREATE DATABASE "metrics"')
    try:
        yield pg
    finally:
        try:
            pg.stop("immediate")
        except Exception:
            pass
        shutil.rmtree(pg.base, ignore_errors=True)


@pytest.mark.usefixtures("prefect_server")
def test_store_down_mid_run_end_to_end(tmp_path: Path, unique_name: str, private_pg, monkeypatch):
    pg = private_pg
    store = RunMetricsStore(url=pg.url("metrics"))
    store.schema_version()
    block = f"outage-{unique_name}"
    store.save(block)
    # the agent writes to that store, samples every 0.2 s, buffers 15 samples (3 s) while the store
    # is down and retries at least every 0.5 s; `runs show` reads the same block
    monkeypatch.setenv("LAUNCH_METRICS_BLOCK", block)
    monkeypatch.setenv("LAUNCH_SAMPLE_INTERVAL", "0.2")
    monkeypatch.setenv("LAUNCH_METRICS_BUFFER", "15")
    monkeypatch.setenv("LAUNCH_METRICS_RETRY_MAX_SECONDS", "0.5")
    q = apply_queue(tmp_path, {"name": f"outage-{unique_name}", "presets": {"small": {"cpu": 1, "memory": "1Gi"}},
                               "default_preset": "small"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec_dir = tmp_path / "records"
    with agent([q], f"outage-{unique_name}", "cpu=2,memory=2Gi", tmp_path):
        rid = cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec_dir}",
                       "--param", "seconds=6")["run_ids"][0]
        wait_running(rid)
        _wait_for("samples in the store", lambda: len(store.series(rid)) >= 3, 20)
        t_down = datetime.now(timezone.utc)
        pg.stop("fast")
        run = wait_final([rid], timeout=120)[0]  # the run goes on without its store
        time.sleep(1.0)
        pg.start()
        t_up = datetime.now(timezone.utc)
        summary = _wait_for("the run's summary after the store came back", lambda: store.get_summary(rid), 30)
    agent_log = (tmp_path / f"agent-outage-{unique_name}.log").read_text()

    assert run.state.is_completed(), run.state
    job_record = records(rec_dir)[rid]
    assert job_record["end"] - job_record["start"] >= 6  # it ran its full course
    assert "metrics store write failed" in agent_log

    # what the store has now: samples from before the outage, and samples taken while it was down
    # (buffered by the agent, written when it came back); the overflow counted as lost
    pts = store.series(rid)
    before = [p for p in pts if p["ts"] < t_down]
    during = [p for p in pts if t_down <= p["ts"] <= t_up]
    assert before and len(during) >= 10
    assert summary.exit_state == "COMPLETED"
    assert summary.lost_samples >= 5  # a ~7 s outage at 5 samples/s overflows a 15-sample buffer
    assert summary.samples == len(pts) + summary.lost_samples
    assert store.get_run(rid).state == "COMPLETED"

    # `runs show` says so (the CLI, invoked in this process)
    shown = CliRunner().invoke(launch_cli.app, ["runs", "show", rid])
    assert shown.exit_code == 0, shown.output
    text = shown.output
    assert f"{summary.samples} taken, {summary.lost_samples} lost" in text
    assert f"{summary.lost_samples} of {summary.samples} samples were lost while the metrics store was unreachable" in text
