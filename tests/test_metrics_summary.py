"""Pure parts: run summary, waste verdict, NVML wrapper over the fake, text report and artifact rows."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary
from prefect_launch.workers.metrics import nvml as nv
from prefect_launch.workers.metrics.report import render_run_report, report_dict, sparkline, summary_artifact_rows
from prefect_launch.workers.metrics.summary import SummaryAccumulator, WasteThresholds, summarize, waste_reasons

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GiB = 1 << 30


def _series(n, cpu, rss=GiB, gpu=None, gmem=None, interval=1.0):
    return [
        MetricSample(
            flow_run_id="r", ts=T0 + timedelta(seconds=i * interval), interval_s=interval,
            cpu_pct=cpu(i) if callable(cpu) else cpu, rss_bytes=rss(i) if callable(rss) else rss,
            gpu_util_pct=gpu, gpu_mem_bytes=gmem, read_bytes=100, write_bytes=5,
        )
        for i in range(n)
    ]


def _rec(**kw):
    base = dict(flow_run_id="r", submitted_at=T0 - timedelta(seconds=42), started_at=T0)
    base.update(kw)
    return RunRecord(**base)


# ------------------------------------------------------------------ summary


def test_summary_figures():
    samples = _series(100, cpu=lambda i: 200.0 if i < 50 else 0.0, rss=lambda i: i * 1000)
    s = summarize(_rec(cpu=4, memory_bytes=GiB), samples, "COMPLETED", ended_at=T0 + timedelta(seconds=100))
    assert s.duration_s == 100 and s.queue_s == 42
    assert s.avg_cpu_pct == pytest.approx(100.0) and s.max_cpu_pct == 200.0
    assert s.cpu_seconds == pytest.approx(100.0)
    assert s.avg_cpu_share_pct == pytest.approx(25.0)
    assert s.peak_rss_bytes == 99_000 and s.avg_rss_bytes == 49_500
    assert s.read_bytes == 10_000 and s.write_bytes == 500 and s.net_rx_bytes is None
    assert s.samples == 100 and s.exit_state == "COMPLETED"
    assert s.avg_gpu_util_pct is None and s.allocated_gpus is None


def test_time_weighted_cpu_and_order_independence():
    # 1 s at 100% then 3 s at 0%: 25% on average, not 50%
    a = MetricSample(flow_run_id="r", ts=T0, interval_s=1.0, cpu_pct=100.0)
    b = MetricSample(flow_run_id="r", ts=T0 + timedelta(seconds=4), interval_s=3.0, cpu_pct=0.0)
    s1 = summarize(_rec(), [a, b], "COMPLETED")
    s2 = summarize(_rec(), [b, a], "COMPLETED")
    assert s1.avg_cpu_pct == s2.avg_cpu_pct == pytest.approx(25.0)
    # no record start: the first sample is the start
    s3 = summarize(RunRecord(flow_run_id="r"), [b, a], "COMPLETED")
    assert s3.started_at == T0 and s3.duration_s == 4 and s3.queue_s is None


def test_empty_summary():
    s = SummaryAccumulator().finish(RunRecord(flow_run_id="r"), "CRASHED")
    assert s.samples == 0 and s.duration_s is None and s.avg_cpu_pct is None and not s.wasteful


def test_idle_gpu_run_is_wasteful():
    samples = _series(600, cpu=50.0, gpu=3.0, gmem=GiB // 2)
    s = summarize(_rec(cpu=8, gpu=2, memory_bytes=64 * GiB), samples, "COMPLETED",
                  ended_at=T0 + timedelta(seconds=600), gpu_mem_total_bytes=160 * GiB)
    assert s.wasteful
    codes = [r.split(":")[0] for r in s.waste_reasons]
    assert codes == ["gpu_idle", "gpu_memory_unused", "cpu_underused", "memory_overallocated"]
    assert "2 GPU allocated, average utilisation 3.0% < 10%" in s.waste_reasons[0]
    assert s.waste_reasons[2].startswith("cpu_underused: 8 CPUs allocated, average use 0.50 CPUs (6.")
    assert s.waste_reasons[3] == "memory_overallocated: peak 1.0 GiB of 64.0 GiB allocated (1.6% < 25%)"


def test_busy_gpu_run_is_not_wasteful():
    samples = _series(600, cpu=350.0, rss=40 * GiB, gpu=85.0, gmem=60 * GiB)
    s = summarize(_rec(cpu=4, gpu=1, memory_bytes=48 * GiB), samples, "COMPLETED",
                  ended_at=T0 + timedelta(seconds=600), gpu_mem_total_bytes=80 * GiB)
    assert not s.wasteful and s.waste_reasons == []
    assert s.avg_gpu_util_pct == 85.0 and s.peak_gpu_mem_bytes == 60 * GiB


def test_waste_thresholds_edges():
    base = dict(duration_s=3600, allocated_gpus=1, avg_gpu_util_pct=9.9)
    assert waste_reasons(RunSummary(**base))[0].startswith("gpu_idle")
    assert waste_reasons(RunSummary(**{**base, "avg_gpu_util_pct": 10.0})) == []
    # short runs are never flagged, unmeasured GPUs are not judged
    assert waste_reasons(RunSummary(**{**base, "duration_s": 30})) == []
    assert waste_reasons(RunSummary(**{**base, "avg_gpu_util_pct": None})) == []
    assert waste_reasons(RunSummary(**base), WasteThresholds(gpu_util_pct=5)) == []
    # memory: needs both a low fraction and at least 1 GiB unused
    mem = dict(duration_s=3600, allocated_memory_bytes=2 * GiB, peak_rss_bytes=GiB // 4)
    assert waste_reasons(RunSummary(**mem))[0].startswith("memory_overallocated")
    assert waste_reasons(RunSummary(**{**mem, "allocated_memory_bytes": GiB})) == []
    # cpu: only judged from cpu_min_alloc CPUs up
    cpu = dict(duration_s=3600, allocated_cpus=1, avg_cpu_pct=1.0)
    assert waste_reasons(RunSummary(**cpu)) == []
    assert waste_reasons(RunSummary(**{**cpu, "allocated_cpus": 4}))[0].startswith("cpu_underused")


# --------------------------------------------------------------------- NVML


def test_nvml_absent_is_clean():
    n = nv.Nvml(nv.FakeNVML(available=False))
    assert not n.available and "NVML" in n.error
    assert n.detect_gpus() == [] and n.usage([0], [1]) is None and n.memory_total([0]) is None
    assert nv.detect_gpus(nv.FakeNVML(available=False)) == []


def test_real_nvml_path_without_driver_returns_empty():
    # this machine has nvidia-ml-py but no driver: the real code path must not raise
    n = nv.Nvml()
    if n.available:  # pragma: no cover - on a GPU machine
        assert n.device_count() >= 1
    else:
        assert n.detect_gpus() == [] and n.usage([0]) is None


def test_nvml_detect_and_usage():
    fake = nv.FakeNVML(gpus=[{"name": "Fake H100", "memory_total": 80 * GiB}, {"name": "Fake H100", "memory_total": 80 * GiB}])
    gpus = nv.detect_gpus(fake)
    assert gpus == [
        nv.GpuInfo(0, "Fake H100", 80 * GiB, "GPU-fake-0"),
        nv.GpuInfo(1, "Fake H100", 80 * GiB, "GPU-fake-1"),
    ]
    n = nv.Nvml(fake)
    fake.util.update({0: 30.0, 1: 70.0})
    fake.mem_used.update({0: GiB, 1: 3 * GiB})
    u = n.usage([0, 1], pids=[])
    assert (u.util_pct, u.mem_bytes, u.source) == (50.0, 4 * GiB, "device")
    fake.processes[0] = [(111, 2 * GiB, 60.0), (222, GiB, 30.0)]
    u = n.usage([0], pids=[111, 222])
    assert (u.util_pct, u.mem_bytes, u.source) == (90.0, 3 * GiB, "process")
    u = n.usage([0], pids=[222])
    assert (u.util_pct, u.mem_bytes) == (30.0, GiB)
    # process-util timestamps advance between calls
    stamps = [c for c in fake.calls if c.startswith("procutil:0:")]
    assert stamps[0] == "procutil:0:0" and stamps[-1] != stamps[0]
    # process utilisation unsupported: device utilisation, per-process memory
    fake2 = nv.FakeNVML(gpus=[{"memory_total": 16 * GiB}], process_util_supported=False)
    fake2.processes[0] = [(5, GiB, 99.0)]
    fake2.util[0] = 12.0
    u = nv.Nvml(fake2).usage([0], pids=[5])
    assert (u.util_pct, u.mem_bytes, u.source) == (12.0, GiB, "process")
    assert n.memory_total([0, 1]) == 160 * GiB
    n.shutdown()
    assert "nvmlShutdown" in fake.calls and not n.available


# ------------------------------------------------------------------- report


def test_sparkline():
    assert sparkline([]) == ""
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5, None, 5]) == "█ █"
    assert sparkline([0, 0, 0]) == "▁▁▁"
    assert sparkline([50], hi=100) == "▅"
    assert len(sparkline(range(1000), width=40)) == 40
    line = sparkline([0] * 500 + [10] * 500, width=10)
    assert line == "▁" * 5 + "█" * 5


def test_report_and_artifact_rows():
    rec = _rec(queue="gpu-a", job="train", flow="train-flow", owner="ana", preset="large", cpu=4,
               memory_bytes=16 * GiB, gpu=1, gpu_indices=[2], agent="w1", state="COMPLETED")
    samples = _series(120, cpu=lambda i: float(i), rss=lambda i: i * 1024 * 1024, gpu=2.0, gmem=GiB)
    s = summarize(rec, samples, "COMPLETED", ended_at=T0 + timedelta(seconds=120), gpu_mem_total_bytes=80 * GiB)
    rows = summary_artifact_rows(s)
    by = {r["metric"]: r for r in rows}
    assert set(rows[0]) == {"metric", "allocated", "used"}
    assert all(isinstance(v, str) for r in rows for v in r.values())
    assert by["CPU"]["allocated"] == "4 CPUs" and by["CPU"]["used"].startswith("0.60 CPUs avg (59.5%)")
    assert by["memory"]["allocated"] == "16.0 GiB" and by["memory"]["used"] == "119.0 MiB peak (1%)"
    assert by["GPU"]["allocated"] == "1 GPU" and by["GPU"]["used"].startswith("2.0% avg util")
    assert by["GPU memory"]["allocated"] == "80.0 GiB"
    assert by["duration"]["used"] == "2m00s" and by["queued"]["used"] == "42.0s"
    assert by["waste"]["used"].startswith("WASTEFUL: gpu_idle")

    series = [x.model_dump() for x in samples]
    text = render_run_report(rec, s, series, width=30)
    assert text.startswith("Run r\n")
    for needle in ("queue        gpu-a", "preset       large", "gpu indices  2", "state        COMPLETED",
                   "WASTEFUL", "series: 120 points"):
        assert needle in text, needle
    cpu_line = next(line for line in text.splitlines() if line.strip().startswith("cpu %"))
    assert "▁" in cpu_line and "█" in cpu_line and "max 119.0%" in cpu_line
    assert "net rx" not in text  # no network data, no line
    # dict inputs (as summaries() returns) and a run without summary/samples
    assert "no summary yet" in render_run_report({"flow_run_id": "x", "queue": "q"}, None, [])
    assert "(no samples)" in render_run_report({"flow_run_id": "x"}, None, [])
    d = dict(s.model_dump(), cpu=4, memory_bytes=16 * GiB, gpu=1)
    assert summary_artifact_rows(d) == rows
    # --json shape
    doc = json.loads(json.dumps(report_dict(rec, s, series)))
    assert doc["run"]["queue"] == "gpu-a" and doc["summary"]["wasteful"] is True
    assert len(doc["series"]) == 120 and doc["series"][0]["ts"] == T0.isoformat()
    assert report_dict(None, None, [])["summary"] is None
