"""Every occupancy panel against ground truth from the runs' own state histories.

Real server, real agent, real job processes: a long, a short, a failed, a retried and a
still-running job wait and run across several 5 s buckets; the view is served from the
run index (synced from Prefect's records and events). The expected numbers are worked
out here with plain loops from ``client.read_flow_run_states`` (the definitions of
:mod:`prefect_launch.dashboard.occupancy`, written again independently), never from
Prefect's aggregation nor from the module under test.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import time
from pathlib import Path

import pandas as pd
import pytest

from launch_helpers import agent, apply_queue, read_runs, wait_running
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.blocks.run_index import RunIndex
from prefect_launch.dashboard import api as A
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import view as V
from prefect_launch.dashboard import index_sync as X
from prefect_launch.dashboard import occupancy as OC

pytestmark = pytest.mark.usefixtures("prefect_server")
UTC = dt.timezone.utc
STEP = 5
HERE = Path(__file__).resolve().parent
PRESETS = {"cpu1": {"cpu": 1, "memory": "256Mi", "gpu": 0}, "gpu1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1},
           "gpu2": {"cpu": 0.5, "memory": "256Mi", "gpu": 2}}
FINAL = {"COMPLETED": "completed", "FAILED": "failed", "CRASHED": "crashed", "CANCELLED": "cancelled"}


def _deploy(queue: str, entry: str, name: str) -> str:
    from prefect import flow

    flow.from_source(source=str(HERE), entrypoint=entry).deploy(
        name=name, work_pool_name=queue, work_queue_name="medium", build=False, push=False, print_next_steps=False)
    return name


def _submit(ref: str, queue: str, preset: str, params: dict) -> str:
    """What ``prefect-launch submit`` does, in this process (a CLI process start costs seconds here)."""
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit

    with get_client(sync_client=True) as client:
        return submit(client, SubmitRequest(job=ref, queue=queue, preset=preset, params=params)).run_ids[0]


# ------------------------------------------------------------- ground truth


def _truth(run, states, now: dt.datetime, preset: str) -> dict:
    """The run's phases (epoch seconds) from its state history: queued from its latest
    scheduling before it first left the queue (not before the state's own time), pending
    from the first claim after that, running from its first Running to its end."""
    states = sorted(states, key=lambda s: s.timestamp)
    kinds = [s.type.value for s in states]
    first_out = next((i for i, k in enumerate(kinds) if k in ("PENDING", "RUNNING")), len(states))
    sched = [s for s in states[:first_out] if s.type.value == "SCHEDULED"][-1]
    q0 = max(sched.timestamp, sched.state_details.scheduled_time or sched.timestamp).timestamp()
    run_i = next((i for i, k in enumerate(kinds) if k == "RUNNING"), None)
    pend = next((s.timestamp.timestamp() for s in states[first_out:run_i] if s.type.value == "PENDING"), None)
    r0 = states[run_i].timestamp.timestamp() if run_i is not None else None
    final = states[-1] if states[-1].type.value in FINAL else None
    end = final.timestamp.timestamp() if final else None
    stop = end if end is not None else now.timestamp()
    leave = pend if pend is not None else r0 if r0 is not None else stop
    out = dict(q=(q0, leave), p=(pend, r0 if r0 is not None else stop) if pend is not None else None,
               r=(r0, stop) if r0 is not None else None, end=end, status=FINAL.get(final.type.value) if final else None)
    out["h"] = (pend if pend is not None else r0, stop) if (pend is not None or r0 is not None) else None
    out["gpu"], out["cpu"] = float(PRESETS[preset]["gpu"]), float(PRESETS[preset]["cpu"])
    out["placement"] = (run.labels or {}).get("launch.placement")
    return out


def _overlap(iv, lo, hi) -> float:
    return max(0.0, min(iv[1], hi) - max(iv[0], lo)) if iv and iv[1] > iv[0] else 0.0


def _touches(iv, lo, hi) -> bool:
    return bool(iv) and iv[1] > iv[0] and iv[0] < hi and iv[1] > lo


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, prefect_server):
    """Five real jobs on one agent; yields while the last one still runs."""
    tmp = tmp_path_factory.mktemp("occ")
    tag = os.urandom(3).hex()
    q = apply_queue(tmp, {"name": f"occ-{tag}", "presets": PRESETS, "default_preset": "cpu1"})
    job = _deploy(q, "occupancy_job.py:occ_job", f"occ-{tag}")
    retry = _deploy(q, "occupancy_job.py:occ_retry", f"occ-retry-{tag}")
    store = RunMetricsStore(url=f"sqlite:///{tmp / 'occ-metrics.db'}")
    X.build(RunIndex(store), A.get_api(), days=1)  # built before the runs: their state changes arrive by events
    since = dt.datetime.fromtimestamp(math.floor(time.time() / STEP) * STEP, UTC)
    plan = [  # (kind, reference, preset, params): submitted before the agent starts, so every run waits
        ("long", f"occ-job/{job}", "cpu1", dict(seconds=12)),
        ("short", f"occ-job/{job}", "gpu1", dict(seconds=1)),
        ("failed", f"occ-job/{job}", "cpu1", dict(seconds=2, fail=True)),
        ("retried", f"occ-retry/{retry}", "gpu1", dict(seconds=2)),
        ("running", f"occ-job/{job}", "gpu2", dict(seconds=120)),
    ]
    ids = {}
    for kind, ref, preset, params in plan:
        ids[kind] = _submit(ref, q, preset, params)
        time.sleep(1)  # submissions a little apart: their waits start in different buckets
    with agent([q], f"occ-{tag}", "cpu=2,memory=4Gi,gpu=2", tmp):
        deadline = time.time() + 180
        while time.time() < deadline:
            runs = {str(r.id): r for r in read_runs(list(ids.values()))}
            done = all(runs[ids[k]].state.is_final() for k in ("long", "short", "failed", "retried"))
            if done and runs[ids["running"]].state_name == "Running":
                break
            time.sleep(1)
        else:
            raise AssertionError({k: runs[i].state_name for k, i in ids.items()})
        wait_running(ids["running"])
        # placement labels are written a moment after the start
        deadline = time.time() + 20
        while time.time() < deadline and not all((r.labels or {}).get("launch.placement")
                                                  for r in read_runs(list(ids.values())) if r.start_time):
            time.sleep(0.5)
        yield dict(queue=q, ids=ids, store=store, since=since, jobs=(job, retry), presets={k: p[2] for k, p in zip(ids, plan)})


@pytest.fixture(scope="module")
def observed(scenario):
    """(view, truth per run, now): the view served from the index once it holds every state change."""
    from prefect import get_client

    ids = scenario["ids"]
    index = RunIndex(scenario["store"])
    deadline = time.time() + 60
    while True:  # events are persisted in batches: sync until the index holds every claim
        X.sync(index, A.get_api())
        rows = index.frame(ids=list(ids.values())).set_index("id")
        runs = {str(r.id): r for r in read_runs(list(ids.values()))}
        ok = all(rows.loc[i, "state_type"] == runs[i].state_type.value and pd.notna(rows.loc[i, "pending_us"])
                 and pd.notna(rows.loc[i, "placement"]) for i in ids.values())
        if ok or time.time() > deadline:
            break
        time.sleep(1)
    assert ok, rows[["state_type", "pending_us", "placement"]]
    now = dt.datetime.now(UTC)
    with get_client(sync_client=True) as client:
        truth = {k: _truth(runs[i], client.read_flow_run_states(i), now, scenario["presets"][k]) for k, i in ids.items()}
    assert runs[ids["running"]].state_type.value == "RUNNING" and truth["running"]["end"] is None
    spec = S.ViewSpec(since=scenario["since"], until=now + dt.timedelta(seconds=1), queues=(scenario["queue"],),
                      grouping="job", interval_s=STEP)
    old = OC.PER_RUN_GANTT_MAX
    OC.PER_RUN_GANTT_MAX = 0  # draw lanes even for five runs
    try:
        v = V.load_view(spec, store=scenario["store"], source="index", use_cache=False, now=now)
    finally:
        OC.PER_RUN_GANTT_MAX = old
    assert v.source == "index"
    return v, truth, now, runs


def _buckets(v):
    b = OC.Buckets.aligned(v.spec.since, v.spec.until, STEP)
    return [(b.lo_us / 1e6 + k * STEP, b.lo_us / 1e6 + (k + 1) * STEP) for k in range(b.n)]


def test_scenario_spans_several_buckets(observed):
    v, truth, now, runs = observed
    assert truth["retried"]["status"] == "completed"
    retried = runs[[i for i, r in runs.items() if r.run_count >= 2][0]]
    assert retried.run_count == 2  # it did run twice
    assert truth["failed"]["status"] == "failed" and truth["long"]["r"][1] - truth["long"]["r"][0] >= 12
    assert max(t["q"][1] - t["q"][0] for t in truth.values()) > 2 * STEP  # someone waited over several buckets


def test_job_status_per_interval_is_occupancy(observed):
    v, truth, now, _ = observed
    got = v.occupancy.status.set_index(["bucket", "status"])
    n_checked = 0
    for lo, hi in _buckets(v):
        key = pd.Timestamp(lo, unit="s", tz=UTC)
        for phase, name in (("q", "queued"), ("p", "pending"), ("r", "running")):
            want = sum(_touches(t[phase], lo, hi) for t in truth.values())
            avg = sum(_overlap(t[phase], lo, hi) for t in truth.values()) / STEP
            have = got.loc[(key, name)] if (key, name) in got.index else None
            assert (int(have["count"]) if have is not None else 0) == want, (key, name)
            assert (float(have["avg"]) if have is not None else 0.0) == pytest.approx(avg, abs=1e-4), (key, name)
            n_checked += want
        for status in FINAL.values():
            want = sum(1 for t in truth.values() if t["status"] == status and lo <= t["end"] < hi)
            have = int(got.loc[(key, status), "count"]) if (key, status) in got.index else 0
            assert have == want, (key, status)
    assert n_checked >= 10
    # the long run is counted running in every bucket it spans, not once
    long_r = truth["long"]["r"]
    assert sum(_touches(long_r, lo, hi) for lo, hi in _buckets(v)) >= 3


def test_queued_time_per_interval_with_counts_and_means(observed):
    v, truth, now, _ = observed
    q = v.occupancy.queued.set_index(["bucket", "group"])
    total = 0.0
    for lo, hi in _buckets(v):
        key = pd.Timestamp(lo, unit="s", tz=UTC)
        for group in set(q.index.get_level_values("group")):
            kinds = [k for k in truth if (group.startswith("occ-retry-") == (k == "retried"))]
            secs = sum(_overlap(truth[k]["q"], lo, hi) for k in kinds)
            n = sum(_touches(truth[k]["q"], lo, hi) for k in kinds)
            have = q.loc[(key, group)] if (key, group) in q.index else None
            assert (float(have["queued_s"]) if have is not None else 0.0) == pytest.approx(secs, abs=1e-4), (key, group)
            assert (int(have["runs"]) if have is not None else 0) == n
            if n:
                assert float(have["mean_s"]) == pytest.approx(secs / n, abs=1e-4)
            total += secs
    assert total == pytest.approx(sum(t["q"][1] - t["q"][0] for t in truth.values()), abs=1e-3) and total > 0
    assert set(q.index.get_level_values("group")) == {f"occ-{v.spec.queues[0][4:]}", f"occ-retry-{v.spec.queues[0][4:]}"}


def test_load_idle_capacity_and_heatmap_from_held_seconds(observed):
    v, truth, now, _ = observed
    ld = v.occupancy.load.set_index("bucket")
    for lo, hi in _buckets(v):
        key = pd.Timestamp(lo, unit="s", tz=UTC)
        row = ld.loc[key]
        assert int(row["held"]) == sum(_touches(t["h"], lo, hi) for t in truth.values())
        assert row["run_s"] == pytest.approx(sum(_overlap(t["h"], lo, hi) for t in truth.values()), abs=1e-4)
        assert row["gpu_s"] == pytest.approx(sum(t["gpu"] * _overlap(t["h"], lo, hi) for t in truth.values()), abs=1e-4)
        assert row["cpu_s"] == pytest.approx(sum(t["cpu"] * _overlap(t["h"], lo, hi) for t in truth.values()), abs=1e-4)
    # idle: buckets (before now) no run held at any moment of, merged into stretches
    idle_buckets = [lo for lo, hi in _buckets(v) if lo < now.timestamp() and not any(_touches(t["h"], lo, hi) for t in truth.values())]
    assert idle_buckets, "the runs waited for the agent first: the queue was idle while they waited"
    got = sum(((r["to"] - r["from"]).total_seconds() for _, r in v.occupancy.idle.iterrows()))
    want = sum(min(lo + STEP, now.timestamp()) - lo for lo in idle_buckets)
    assert got == pytest.approx(want, abs=1e-3)
    assert all(r["waiting"] > 0 for _, r in v.occupancy.idle.iterrows())  # runs waited all along: stuck, not idle
    # capacity share: GPU-seconds held over the agent's 2 GPUs x the range up to now
    span = now.timestamp() - v.spec.since.timestamp()
    gpu_s = sum(t["gpu"] * _overlap(t["h"], v.spec.since.timestamp(), now.timestamp()) for t in truth.values())
    assert v.occupancy.capacity == dict(gpu=2.0, cpu=2.0) and gpu_s > 0
    assert v.occupancy.share["gpu"] == pytest.approx(100 * gpu_s / (2 * span), rel=1e-3)
    # heatmap: held seconds per UTC hour / 3600
    hm = v.occupancy.heatmap
    for _, r in hm.iterrows():
        day = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"].index(r["weekday"])
        lo = next(t for t in pd.date_range(v.spec.since.replace(minute=0, second=0, microsecond=0), v.spec.until, freq="h")
                  if t.day_of_week == day and t.hour == r["hour"]).timestamp()
        assert r["busy"] == pytest.approx(sum(_overlap(t["h"], lo, lo + 3600) for t in truth.values()) / 3600, abs=1e-6)
    assert hm["busy"].sum() > 0


def test_gantt_lanes_show_who_held_which_device(observed):
    v, truth, now, _ = observed
    seg = v.occupancy.lanes
    assert seg is not None and not seg.empty
    want_lanes: dict[str, list] = {}
    for kind, t in truth.items():
        p = t["placement"]
        agent_name = p.split(":", 1)[0][len("agent "):]
        gpus = p.split("; gpus ")[1].split(";")[0]
        cores = p.split("; cores ")[1]
        slots = [f"gpu {g}" for g in gpus.split(",")] if gpus != "none" else [f"core {c}" for c in cores.split(",")]
        for s in slots:
            want_lanes.setdefault(f"{agent_name} · {s}", []).append(t["h"])
    assert set(seg["lane"]) == set(want_lanes)
    assert int(seg["runs"].sum()) == sum(len(x) for x in want_lanes.values())
    for lane, ivs in want_lanes.items():
        mine = seg[seg["lane"] == lane]
        for s, e in ivs:  # every held interval lies inside one of its lane's segments
            lo = pd.Timestamp(max(s, v.spec.since.timestamp()), unit="s", tz=UTC)
            hi = pd.Timestamp(min(e, now.timestamp()), unit="s", tz=UTC)
            assert ((mine["start"] <= lo + pd.Timedelta("1ms")) & (mine["end"] >= hi - pd.Timedelta("1ms"))).any(), lane
    # the GPU job holding both GPUs shows in both GPU lanes
    two = truth["running"]["placement"].split("; gpus ")[1].split(";")[0].split(",")
    assert len(two) == 2
