"""The sampler's energy figures with a fake NVML (the only fake): counter, power readings
integrated where a GPU has no counter, and "unavailable" (with why) where it has neither.
A real child process is sampled into a real SQLite store."""

from __future__ import annotations

import subprocess
import sys
import time
from uuid import uuid4

import pytest

from prefect_launch.blocks.metrics_records import RunRecord
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.workers.metrics.nvml import FakeNVML
from prefect_launch.workers.metrics.sampler import RunSampler


def _run(tmp_path, fake: FakeNVML, indices: list[int], seconds: float = 1.5):
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}")
    rec = RunRecord(flow_run_id=str(uuid4()), queue="q", gpu_indices=indices)
    p = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    s = RunSampler(store, rec, p.pid, indices, 1, None, interval_s=0.2, nvml=fake).start()
    p.wait(timeout=30)
    time.sleep(0.3)
    summary = s.stop("COMPLETED")
    return summary, store.series(rec.flow_run_id), store.get_run(rec.flow_run_id), store.get_summary(rec.flow_run_id)


def _fake(**kw) -> FakeNVML:
    fake = FakeNVML(gpus=[{"memory_total": 16 << 30}, {"memory_total": 16 << 30}], **kw)
    fake.util.update({0: 60.0, 1: 30.0})
    fake.power_w.update({0: 200.0, 1: 50.0})
    return fake


def test_energy_from_the_counter_and_gpu_seconds_used(tmp_path):
    summary, pts, rec, stored = _run(tmp_path, _fake(), [0, 1])
    assert len(pts) >= 4 and all(p["gpu_energy_j"] is not None for p in pts)
    # the counters advanced by the devices' power over each interval
    assert sum(p["gpu_energy_j"] for p in pts) == pytest.approx(250.0 * sum(p["interval_s"] for p in pts), rel=0.05)
    assert stored.gpu_energy_j == pytest.approx(sum(p["gpu_energy_j"] for p in pts), rel=1e-6)
    # used GPU-seconds: mean utilisation of the two GPUs x interval x 2 GPUs
    assert stored.gpu_used_s == pytest.approx(sum(p["gpu_util_pct"] / 100 * p["interval_s"] * 2 for p in pts), rel=1e-3)
    assert stored.gpu_used_s == pytest.approx(0.45 * 2 * sum(p["interval_s"] for p in pts), rel=1e-3)
    assert rec.extra["gpu_energy"] == "nvml energy counter"
    assert rec.extra["cpu_energy"].startswith(("unavailable", "rapl"))


def test_power_readings_integrated_without_a_counter(tmp_path):
    summary, pts, rec, stored = _run(tmp_path, _fake(energy_supported=False), [0])
    assert rec.extra["gpu_energy"].startswith("nvml power readings integrated")
    for p in pts:  # constant 200 W: the trapezoid is exact
        assert p["gpu_energy_j"] == pytest.approx(200.0 * p["interval_s"], rel=0.02, abs=0.5)


def test_unavailable_gpu_energy_is_none_and_says_why(tmp_path):
    summary, pts, rec, stored = _run(tmp_path, _fake(energy_supported=False, power_supported=False), [1], seconds=0.8)
    assert pts and all(p["gpu_energy_j"] is None for p in pts)
    assert stored.gpu_energy_j is None and summary.gpu_energy_j is None
    assert rec.extra["gpu_energy"] == "unavailable: NVML reports neither energy nor power for these GPUs"
    assert stored.gpu_used_s is not None  # utilisation is still measured
