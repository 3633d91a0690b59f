"""The queues.yaml examples of README.md and docs/ are what the real loader accepts, with the values they say."""

from __future__ import annotations

import re
from pathlib import Path

from prefect_launch.workers.metrics.idle_checks import IdleChecker
from prefect_launch.workers.scheduling.queue_spec import load_queues_file

ROOT = Path(__file__).resolve().parents[1]
# README.md shows the basic queue; the sharing and idle-check examples moved to docs/
DOCS = [ROOT / "README.md", ROOT / "docs" / "jobs-and-queues.md", ROOT / "docs" / "sessions.md"]


def _queue_examples() -> list[str]:
    blocks = [b for doc in DOCS for b in re.findall(r"```yaml\n(.*?)```", doc.read_text(), flags=re.S)]
    return [b for b in blocks if b.lstrip().startswith("queues:")]


def test_every_readme_queues_example_loads(tmp_path):
    examples = _queue_examples()
    assert len(examples) >= 3, "README, the sharing section and the idle-check section each show one"
    for i, text in enumerate(examples):
        path = tmp_path / f"q{i}.yaml"
        path.write_text(text)
        assert load_queues_file(str(path)).queues


def test_readme_idle_policy_example_means_what_it_says(tmp_path):
    text = next(t for t in _queue_examples() if "idle:" in t)
    path = tmp_path / "idle.yaml"
    path.write_text(text)
    idle = load_queues_file(str(path)).queues[0].idle
    assert idle is not None
    assert (idle.max_lifetime, idle.lifetime_from, idle.network_idle_timeout) == ("12h", "start", "1h")
    u = idle.utilization
    assert (u.grace_period, u.window, u.operator) == ("15m", "30m", "and")
    assert (u.cpu, u.memory, u.gpu_util, u.gpu_memory) == (5, 10, 10, 5)
    assert idle.apply_to == ["interactive", "batch"] and not idle.applies(None) and idle.applies("batch")
    # a CPU-only session idling past grace + window is reclaimed for utilisation; GPU thresholds are skipped
    c = IdleChecker(idle, started=0.0, session_type="batch", requested_gpu=0, allocated_memory=2**30)
    for t in range(0, 46 * 60, 60):
        c.observe(float(t), cpu_share_pct=0.5, rss_bytes=2**20, gpu_util_pct=0.0, gpu_mem_pct=0.0)
    verdict = c.check(45 * 60.0)
    assert verdict and verdict.reason == "idle-utilization" and "gpu" not in verdict.message
    assert c.check(12 * 3600.0).reason == "idle-session-lifetime"


def test_readme_sharing_example_means_what_it_says(tmp_path):
    text = next(t for t in _queue_examples() if "preempt_grace:" in t)
    path = tmp_path / "share.yaml"
    path.write_text(text)
    q = load_queues_file(str(path)).queues[0]
    assert q.preemptible_priorities == ["low"] and q.preempt_grace_s == 30.0 and q.fair_share
    assert q.quota_for("bob").gpu == 2 and q.quota_for("alice").gpu == 4
