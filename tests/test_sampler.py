"""RunSampler against real child processes: CPU, memory, process trees, GPU via the fake NVML, store outages."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from uuid import uuid4

import pytest
import sqlalchemy as sa

from fixtures_pg import pg_server, pg_url  # noqa: F401  (fixtures)
from prefect_launch.blocks.metrics_records import RunRecord
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.workers.metrics.nvml import FakeNVML
from prefect_launch.workers.metrics.sampler import RunSampler

MiB = 1 << 20


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])


def _wait(p: subprocess.Popen) -> float:
    """Reap the child; returns its CPU seconds (it and its reaped descendants)."""
    _, _, ru = os.wait4(p.pid, 0)
    p.returncode = 0
    return ru.ru_utime + ru.ru_stime


BURN = """
import time, sys
t = time.process_time()
while time.process_time() - t < {secs}:
    pass
time.sleep({tail})
"""


@pytest.fixture
def store(tmp_path) -> RunMetricsStore:
    return RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}")


def _rec(**kw) -> RunRecord:
    return RunRecord(flow_run_id=str(uuid4()), queue="test", **kw)


def test_burner_reads_one_core(store):
    p = _child(BURN.format(secs=2.0, tail=0.5))
    t0 = time.monotonic()
    s = RunSampler(store, _rec(), p.pid, [], allocated_cpus=2, allocated_memory_bytes=None, interval_s=0.15).start()
    truth_cpu = _wait(p)
    wall = time.monotonic() - t0
    summary = s.stop("COMPLETED")
    # what the child really used, as the kernel accounts it
    assert truth_cpu >= 1.9
    assert summary.cpu_seconds == pytest.approx(truth_cpu, abs=0.35)
    # samples while it burned read about one core (the 0.5 s sleep at the end reads ~0)
    busy = [x.cpu_pct for x in s.recent if x.cpu_pct is not None and x.cpu_pct > 20]
    assert busy and sum(busy) / len(busy) == pytest.approx(100.0 * truth_cpu / max(wall - 0.5, truth_cpu), abs=15)
    assert max(busy) <= 130
    assert summary.max_cpu_pct == max(x.cpu_pct for x in s.recent)  # (how near 100 depends on the machine's load)
    assert summary.avg_cpu_share_pct == pytest.approx(summary.avg_cpu_pct / 2)
    assert summary.samples == s.samples_taken >= 10
    # everything reached the store, plus the summary and the final state
    pts = store.series(summary.flow_run_id)
    assert len(pts) == s.samples_taken and s.lost_samples == 0
    row = store.summaries(flow_run_ids=[summary.flow_run_id])[0]
    assert row["has_summary"] and row["state"] == "COMPLETED" and row["cpu"] == 2
    assert row["avg_cpu_pct"] == pytest.approx(summary.avg_cpu_pct)
    assert s.self_cpu_s < 0.5 * truth_cpu


def test_peak_rss_of_allocating_child(store):
    n = 150
    p = _child(f"import time\nx = b'x' * ({n} << 20)\ntime.sleep(1.2)\n")
    s = RunSampler(store, _rec(), p.pid, [], allocated_cpus=1, allocated_memory_bytes=4 << 30, interval_s=0.2).start()
    _wait(p)
    summary = s.stop("COMPLETED")
    assert summary.peak_rss_bytes >= n * MiB
    assert summary.peak_rss_bytes < (n + 200) * MiB
    assert max(pt["rss_bytes"] for pt in store.series(summary.flow_run_id)) == summary.peak_rss_bytes


def test_process_tree_includes_short_lived_grandchildren(store):
    # the child starts a grandchild that burns ~1.5 s of CPU and exits, then idles
    code = f"""
    import subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", {BURN.format(secs=1.5, tail=0)!r}])
    g.wait()
    time.sleep(0.6)
    """
    p = _child(code)
    s = RunSampler(store, _rec(), p.pid, [], allocated_cpus=1, allocated_memory_bytes=None, interval_s=0.3).start()
    truth = _wait(p)
    summary = s.stop("COMPLETED")
    assert truth >= 1.5
    assert summary.cpu_seconds == pytest.approx(truth, abs=0.35)
    assert max(x.num_procs for x in s.recent) >= 2


def test_unreachable_store_never_breaks_sampling(caplog):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = RunMetricsStore(url=f"postgresql+psycopg://nobody@127.0.0.1:{port}/nothing")
    p = _child(BURN.format(secs=0.8, tail=0.6))
    caplog.set_level(logging.WARNING, logger="prefect_launch.sampler")
    s = RunSampler(
        store, _rec(), p.pid, [], allocated_cpus=1, allocated_memory_bytes=None, interval_s=0.1,
        batch_size=2, max_buffer=3, retry_backoff_s=(0.05, 0.2), stop_flush_timeout_s=0.5,
    ).start()
    _wait(p)
    t0 = time.monotonic()
    summary = s.stop("COMPLETED")
    assert time.monotonic() - t0 < 5
    assert s.samples_taken >= 8  # sampling went on at its pace
    assert s.stored_samples == 0
    assert s.lost_samples == s.samples_taken  # overflowed, then the rest at stop
    assert summary.lost_samples == s.lost_samples and summary.samples == s.samples_taken
    assert summary.cpu_seconds == pytest.approx(0.8, abs=0.3)
    text = caplog.text
    assert "metrics store write failed" in text and "samples lost" in text and "not stored" in text


def test_store_outage_then_recovery_loses_nothing(store):
    rec = _rec()
    store.upsert_run(rec)  # creates the schema
    p = _child("import time\ntime.sleep(2.2)\n")
    s = RunSampler(
        store, rec, p.pid, [], allocated_cpus=1, allocated_memory_bytes=None, interval_s=0.1,
        batch_size=2, retry_backoff_s=(0.05, 0.1),
    ).start()
    time.sleep(0.4)
    with store.engine.begin() as conn:  # the table disappears under the writer
        conn.exec_driver_sql("ALTER TABLE launch_samples RENAME TO launch_samples_away")
    time.sleep(0.8)
    failures = s._failures
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE launch_samples_away RENAME TO launch_samples")
    _wait(p)
    summary = s.stop("COMPLETED")
    assert failures >= 2  # it did fail, and kept sampling meanwhile
    assert s.lost_samples == 0 and summary.lost_samples == 0
    assert len(store.series(rec.flow_run_id)) == s.samples_taken >= 15
    assert store.get_summary(rec.flow_run_id) is not None


def test_without_store_and_callbacks():
    seen = []
    p = _child(BURN.format(secs=0.5, tail=0.2))
    s = RunSampler(None, _rec(), p.pid, None, 1, None, interval_s=0.1, on_sample=seen.append).start()
    _wait(p)
    summary = s.stop("FAILED")
    assert seen and s.latest is seen[-1] and summary.exit_state == "FAILED"
    assert summary.samples == len(seen) and s.lost_samples == 0
    assert s.stop("FAILED") is summary  # idempotent


def test_dead_pid_gives_empty_summary(store):
    p = _child("pass")
    _wait(p)
    s = RunSampler(store, _rec(), p.pid, [], 1, None, interval_s=0.05).start()
    time.sleep(0.2)
    summary = s.stop("CRASHED")
    assert summary.samples == 0 and summary.avg_cpu_pct is None and summary.exit_state == "CRASHED"
    assert store.get_run(summary.flow_run_id).state == "CRASHED"


def test_gpu_per_process_via_fake_nvml(store):
    fake = FakeNVML(gpus=[{"name": "Fake A100", "memory_total": 40 << 30}, {"name": "Fake A100", "memory_total": 40 << 30}])
    p = _child("import time\ntime.sleep(1.0)\n")
    fake.processes[1] = [(p.pid, 3 << 30, 80.0), (999999, 1 << 30, 10.0)]  # ours and a stranger's
    fake.util[1] = 90.0
    fake.mem_used[1] = 4 << 30
    rec = _rec(gpu_indices=[1])
    s = RunSampler(store, rec, p.pid, [1], 1, None, interval_s=0.1, nvml=fake).start()
    _wait(p)
    summary = s.stop("COMPLETED")
    assert s.gpu_source == "process"
    assert summary.avg_gpu_util_pct == pytest.approx(80.0)  # ours only, not the stranger's 10
    assert summary.peak_gpu_mem_bytes == 3 << 30
    assert summary.gpu_mem_total_bytes == 40 << 30 and summary.allocated_gpus == 1
    pts = store.series(rec.flow_run_id)
    assert all(pt["gpu_mem_bytes"] == 3 << 30 for pt in pts)


def test_gpu_device_level_fallback(store):
    fake = FakeNVML(gpus=[{"memory_total": 16 << 30}], process_util_supported=False)
    p = _child("import time\ntime.sleep(0.6)\n")
    fake.util[0] = 55.0
    fake.mem_used[0] = 2 << 30
    s = RunSampler(store, _rec(), p.pid, [0], 1, None, interval_s=0.1, nvml=fake).start()
    _wait(p)
    summary = s.stop("COMPLETED")
    assert s.gpu_source == "device"
    assert summary.avg_gpu_util_pct == 55.0 and summary.peak_gpu_mem_bytes == 2 << 30


def test_no_nvml_means_no_gpu_numbers(store):
    p = _child("import time\ntime.sleep(0.4)\n")
    s = RunSampler(store, _rec(), p.pid, [0], 1, None, interval_s=0.1, nvml=FakeNVML(available=False)).start()
    _wait(p)
    summary = s.stop("COMPLETED")
    assert summary.samples >= 2 and summary.avg_gpu_util_pct is None and summary.peak_gpu_mem_bytes is None


def test_dropped_samples_table_counts_losses(store):
    rec = _rec()
    store.upsert_run(rec)
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE launch_samples"))
    p = _child("import time\ntime.sleep(0.5)\n")
    s = RunSampler(store, rec, p.pid, [], 1, None, interval_s=0.1, batch_size=1,
                   retry_backoff_s=(0.05, 0.1), stop_flush_timeout_s=0.3).start()
    _wait(p)
    summary = s.stop("COMPLETED")
    assert s.lost_samples == s.samples_taken > 0 and summary.lost_samples == s.lost_samples


def test_sampler_into_postgres(pg_url):
    store = RunMetricsStore(url=pg_url)
    p = _child(BURN.format(secs=0.6, tail=0.3))
    rec = _rec(job="pg")
    s = RunSampler(store, rec, p.pid, [], 1, None, interval_s=0.1, batch_size=3).start()
    _wait(p)
    summary = s.stop("COMPLETED")
    assert s.lost_samples == 0 and len(store.series(rec.flow_run_id)) == s.samples_taken >= 5
    row = store.summaries(flow_run_ids=[rec.flow_run_id])[0]
    assert row["job"] == "pg" and row["exit_state"] == "COMPLETED"
    assert row["cpu_seconds"] == pytest.approx(summary.cpu_seconds)
