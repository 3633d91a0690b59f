"""The GPU check's ground truth and comparisons (bench/gpu_truth.py), on synthetic NVML samples.

Pure: no server, no GPU. The samples are what a sampler reading NVML every 0.5 s would hold for a
host with two GPUs while a run used GPU 1 from t=10 to t=20: utilisation 0 before and after, a
ramp at the start, 300 W drawn (an energy counter advancing with it), memory up by 2 GiB.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_truth", Path(__file__).resolve().parents[1] / "bench" / "gpu_truth.py")
T = sys.modules.setdefault("gpu_truth", importlib.util.module_from_spec(_spec))  # bench/ is no package
_spec.loader.exec_module(T)

GiB = 1 << 30
IDLE_MEM = 500 << 20
T0, T1 = 10.0, 20.0


def util_at(t: float) -> float:
    if not T0 <= t <= T1:
        return 0.0
    return 50.0 if t < T0 + 1 else 100.0  # CUDA init, then busy


def power_w(t: float) -> float:
    return 300.0 if T0 <= t <= T1 else 60.0


def synthetic(dt: float = 0.5, until: float = 30.0, energy: bool = True, procs: bool = True) -> list:
    out, e = [], {0: 5e9, 1: 7e9}
    t = 0.0
    while t <= until:
        for i in (0, 1):
            busy = i == 1 and T0 <= t <= T1
            out.append(T.Sample(t=t, index=i, util_pct=util_at(t) if i == 1 else 0.0,
                                mem_used=IDLE_MEM + (2 * GiB if busy else 0),
                                proc_mem=(2 * GiB - (64 << 20)) if busy and procs else None,
                                power_mw=(power_w(t) if i == 1 else 60.0) * 1000,
                                energy_mj=e[i] if energy else None))
            e[i] += (power_w(t + dt / 2) if i == 1 else 60.0) * dt * 1000  # mJ over the next step
        t += dt
    return out


def test_truth_over_the_runs_own_interval():
    s = synthetic()
    truth = T.run_truth(s, [1], T0, T1, idle_mem=T.idle_memory(s, before=T0))
    assert truth["samples"] == 21  # 10.0, 10.5, ... 20.0
    assert truth["avg_util_pct"] == pytest.approx((2 * 50 + 19 * 100) / 21)
    assert truth["max_util_pct"] == 100.0
    assert truth["peak_mem_bytes"] == 2 * GiB - (64 << 20) and truth["peak_mem_source"] == "process"
    assert truth["peak_device_mem_bytes"] == IDLE_MEM + 2 * GiB
    assert truth["peak_device_mem_above_idle_bytes"] == 2 * GiB
    assert truth["energy_j"] == pytest.approx(300.0 * (T1 - T0), rel=0.01)
    assert truth["power_integrated_j"] == pytest.approx(300.0 * (T1 - T0), rel=0.01)
    assert truth["busy_index"] == 1


def test_the_counter_is_read_between_samples():
    pts = [(0.0, 100.0), (1.0, 200.0), (3.0, 600.0)]
    assert T.counter_at(pts, 0.5) == 150.0 and T.counter_at(pts, 2.0) == 400.0 and T.counter_at(pts, 3.0) == 600.0
    assert T.counter_at(pts, -1.0) is None and T.counter_at(pts, 4.0) is None and T.counter_at([], 1.0) is None
    # an interval not on a sample: the delta is the counter's over exactly that interval
    s = synthetic()
    assert T.run_truth(s, [1], 12.25, 17.75)["energy_j"] == pytest.approx(300.0 * 5.5, rel=0.01)


def test_without_processes_or_counter_the_device_figures_stand_in():
    s = synthetic(energy=False, procs=False)
    truth = T.run_truth(s, [1], T0, T1)
    assert truth["peak_mem_bytes"] == IDLE_MEM + 2 * GiB and truth["peak_mem_source"] == "device"
    assert truth["energy_j"] is None and truth["power_integrated_j"] == pytest.approx(3000.0, rel=0.01)
    assert truth["peak_device_mem_above_idle_bytes"] is None  # no idle baseline given
    checks = {c["what"]: c for c in T.compare_run({"avg_gpu_util_pct": 97, "max_gpu_util_pct": 100,
                                                   "peak_gpu_mem_bytes": IDLE_MEM + 2 * GiB, "gpu_energy_j": 3000},
                                                  [1], truth)}
    assert checks["energy_j"]["ok"] is None and "no figure" in checks["energy_j"]["note"]
    assert T.verdict(list(checks.values()))  # skipped, not failed


AGENT_OK = {"avg_gpu_util_pct": 90.0, "max_gpu_util_pct": 100.0, "peak_gpu_mem_bytes": int(1.98 * GiB),
            "gpu_energy_j": 3200.0}


@pytest.mark.parametrize("field,value,fails", [
    (None, None, None),  # all within
    ("avg_gpu_util_pct", 84.0, "avg_util_pct"),  # 95.2 - 84 > 10 points
    ("avg_gpu_util_pct", 85.5, None),  # within 10 points
    ("max_gpu_util_pct", 89.0, "max_util_pct"),
    ("peak_gpu_mem_bytes", int(2.2 * GiB), "peak_mem_bytes"),  # > 5 % over the processes' 1.94 GiB
    ("peak_gpu_mem_bytes", IDLE_MEM + 2 * GiB, "peak_mem_bytes"),  # the device's figure: 25 % over
    ("gpu_energy_j", 3350.0, "energy_j"),  # > 10 % over 3000 J
    ("gpu_energy_j", 2750.0, None),  # within 10 %
    ("gpu_energy_j", None, "energy_j"),  # the agent measured nothing: a failure, not a skip
])
def test_the_agent_against_the_truth(field, value, fails):
    s = synthetic()
    truth = T.run_truth(s, [1], T0, T1, idle_mem=T.idle_memory(s, T0))
    agent = dict(AGENT_OK)
    if field:
        agent[field] = value
    checks = T.compare_run(agent, [1], truth)
    failed = [c["what"] for c in checks if c["ok"] is False]
    assert failed == ([fails] if fails else []), checks
    assert T.verdict(checks) == (fails is None)


def test_pinning_is_checked_against_the_busy_device():
    s = synthetic()
    truth = T.run_truth(s, [0], T0, T1)  # the agent said GPU 0; NVML saw GPU 1 busy
    pin = next(c for c in T.compare_run(AGENT_OK, [0], truth) if c["what"] == "pinned_gpu")
    assert pin["ok"] is False and pin["truth"] == 1
    assert next(c for c in T.compare_run(AGENT_OK, [1], T.run_truth(s, [1], T0, T1))
                if c["what"] == "pinned_gpu")["ok"]


def test_runs_that_overlap_are_named():
    assert T.overlapping({"a": (0.0, 10.0), "b": (10.0, 20.0)}) == []  # back to back
    assert T.overlapping({"a": (0.0, 10.0), "b": (9.5, 20.0), "c": (30.0, 31.0)}) == [("a", "b")]
    assert T.overlapping({"b": (5.0, 6.0), "a": (0.0, 10.0)}) == [("a", "b")]


def test_gpu_hours_against_the_report():
    runs = [(1, 0.0, 1800.0), (1, 1800.0, 3600.0)]
    assert T.gpu_hours(runs) == 1.0 and T.gpu_hours([(2, 0.0, 900.0)]) == 0.5
    assert T.check_gpu_hours(1.05, 1.0, 2)["ok"] and not T.check_gpu_hours(1.2, 1.0, 2)["ok"]
    assert not T.check_gpu_hours(None, 1.0, 2)["ok"]
    short = T.gpu_hours([(1, 0.0, 30.0), (1, 31.0, 61.0)])  # two 30 s runs: 10 s of slack, not 6 s
    assert T.check_gpu_hours(short + 9 / 3600, short, 2)["ok"] and not T.check_gpu_hours(short + 11 / 3600, short, 2)["ok"]


def test_a_two_gpu_request_is_refused_with_its_reason():
    history = [{"phase": "check_precondition", "result": "NEED_RETRY", "error_code": "exceeds-agent-capacity",
                "message": "waiting: needs gpu=2, agent a has 1 in total"}]
    r = T.refusal(history, ever_started=False)
    assert r["ok"] and r["agent"].endswith("has 1 in total") and r["error_code"] == "exceeds-agent-capacity"
    assert not T.refusal(history, ever_started=True)["ok"]  # it ran after all
    assert not T.refusal([], ever_started=False)["ok"]  # no reason given
    assert not T.refusal([{**history[0], "message": "waiting: needs cpu=64, agent a has 8 in total"}], False)["ok"]
    at_submit = T.refusal([], False, submit_error="error: beyond any agent's total capacity on queue 'q': needs gpu=2 "
                                                  "(agent a has 1 in total); choose a smaller preset")
    assert at_submit["ok"] and at_submit["where"] == "submit"
    assert not T.refusal([], False, submit_error="error: cannot reach the server")["ok"]


def test_the_sampler_reads_nvml_itself():
    """The thread against the project's NVML fake (standing in for pynvml): it reads every device."""
    from prefect_launch.workers.metrics.nvml import FakeNVML

    fake = FakeNVML(gpus=[{"name": "Fake A", "memory_total": 16 * GiB}, {"name": "Fake B", "memory_total": 16 * GiB}])
    fake.util, fake.mem_used, fake.power_w = {1: 70.0}, {1: 3 * GiB}, {1: 250.0}
    fake.processes = {1: [(4242, 2 * GiB, 70.0)]}
    sampler = T.NvmlTruthSampler(interval_s=0.05, nv=fake).start()
    import time

    time.sleep(0.4)
    samples = sampler.stop()
    assert [d["uuid"] for d in sampler.devices] == ["GPU-fake-0", "GPU-fake-1"]
    ones = [s for s in samples if s.index == 1]
    assert len(ones) >= 3 and all(s.util_pct == 70.0 and s.mem_used == 3 * GiB and s.proc_mem == 2 * GiB for s in ones)
    assert ones[-1].energy_mj > ones[0].energy_mj and ones[0].power_mw == 250_000.0
    truth = T.run_truth(samples, [1], ones[0].t, ones[-1].t)
    assert truth["energy_j"] == pytest.approx(250.0 * (ones[-1].t - ones[0].t), rel=0.05)
    assert "nvmlShutdown" in fake.calls
