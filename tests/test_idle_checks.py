"""Idle checkers' rules, on hand-fed samples (the agent feeds real ones; see test_sessions)."""

from __future__ import annotations

from prefect_launch.workers.metrics.idle_checks import IdleChecker, IdlePolicy, UtilizationPolicy


def test_lifetime_applies_to_every_session_type():
    c = IdleChecker(IdlePolicy(max_lifetime="10s"), started=100.0, session_type="batch")
    assert c.check(109.0) is None and c.remaining(105.0)["max_lifetime"] == 5.0
    v = c.check(110.0)
    assert v.reason == "idle-session-lifetime" and "10s" in v.message


def test_network_idle_only_for_interactive_and_reset_by_connections():
    pol = IdlePolicy(network_idle_timeout="30s")
    batch = IdleChecker(pol, started=0.0, session_type="batch")
    assert batch.check(1000.0) is None
    c = IdleChecker(pol, started=0.0, session_type="interactive")
    c.observe(20.0, connections=1)  # someone is using the app
    assert c.check(45.0) is None and c.remaining(45.0)["network_idle_timeout"] == 5.0
    assert c.check(50.0).reason == "idle-timeout"


def test_utilization_grace_window_operator_and_unrequested_gpu():
    pol = IdlePolicy(utilization=UtilizationPolicy(grace_period="10s", window="20s", cpu=10, gpu_util=5))
    c = IdleChecker(pol, started=0.0, session_type="interactive", requested_gpu=0)
    for t in range(0, 9):
        c.observe(float(t), cpu_share_pct=1.0, gpu_util_pct=0.0)
    assert c.check(9.0) is None  # in the grace period
    for t in range(9, 16):
        c.observe(float(t), cpu_share_pct=1.0, gpu_util_pct=0.0)
    assert c.check(15.0) is None  # window not full yet
    for t in range(16, 31):
        c.observe(float(t), cpu_share_pct=1.0)
    v = c.check(30.0)
    assert v.reason == "idle-utilization" and "gpu_util" not in v.message  # GPUs not requested: not judged
    busy = IdleChecker(pol, started=0.0, session_type="interactive")
    for t in range(0, 31):
        busy.observe(float(t), cpu_share_pct=50.0)
    assert busy.check(30.0) is None
    either = IdleChecker(IdlePolicy(utilization=UtilizationPolicy(grace_period="1s", window="10s",
                                                                  operator="or", cpu=10, memory=50)),
                         started=0.0, session_type="batch", allocated_memory=1000)
    for t in range(0, 12):
        either.observe(float(t), cpu_share_pct=80.0, rss_bytes=100)  # busy CPU, memory 10% of the request
    assert either.check(11.0).reason == "idle-utilization"
    both = IdleChecker(IdlePolicy(utilization=UtilizationPolicy(grace_period="1s", window="10s", operator="and",
                                                                cpu=10, memory=50)),
                       started=0.0, session_type="batch", allocated_memory=1000)
    for t in range(0, 12):
        both.observe(float(t), cpu_share_pct=80.0, rss_bytes=100)
    assert both.check(11.0) is None
