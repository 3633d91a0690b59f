"""Seeding for the dashboard tests: real flow runs on the test server, made through the client.

Each call creates its own work pool (type launch-process, priority queues), a flow, two
deployments (jobs) and runs with the prefect-launch tags; states are forced so that the
runs get Scheduled (in the past) -> Pending -> Running -> Completed/Failed histories
with their own server-side timestamps. Metrics summaries go to the run metrics store.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.states import Completed, Failed, Pending, Running, Scheduled

UTC = dt.timezone.utc


@dataclass
class Seeded:
    pool: str
    jobs: list[str]
    owners: list[str]
    run_ids: list[str] = field(default_factory=list)
    failed_ids: list[str] = field(default_factory=list)
    running_ids: list[str] = field(default_factory=list)
    queued_ids: list[str] = field(default_factory=list)
    since: dt.datetime | None = None


def seed_runs(tag: str | None = None, n_done: int = 8, n_failed: int = 2, n_running: int = 1, n_queued: int = 1,
              metrics: bool = True) -> Seeded:
    tag = tag or uuid.uuid4().hex[:6]
    pool = f"dash-{tag}"
    jobs = [f"train-{tag}", f"eval-{tag}"]
    owners = ["alice", "bob"]
    presets = ["small", "gpu-1"]
    seeded = Seeded(pool=pool, jobs=jobs, owners=owners, since=dt.datetime.now(UTC) - dt.timedelta(minutes=30))
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="launch-process", concurrency_limit=4))
        for q, prio in (("critical", 1), ("high", 2), ("medium", 3), ("low", 4)):
            client.create_work_queue(name=q, work_pool_name=pool, priority=prio)
        flow_id = client.create_flow_from_name(f"dash-flow-{tag}")
        deps = [client.create_deployment(flow_id=flow_id, name=j, work_pool_name=pool, work_queue_name="medium") for j in jobs]
        total = n_done + n_failed + n_running + n_queued
        now = dt.datetime.now(UTC)
        for i in range(total):
            owner, preset = owners[i % 2], presets[(i // 2) % 2]
            queued_for = 60 * (i + 1)  # run i waited (i+1) minutes
            run = client.create_flow_run_from_deployment(
                deps[i % 2], tags=["launch", f"owner:{owner}", f"preset:{preset}"],
                state=Scheduled(scheduled_time=now - dt.timedelta(seconds=queued_for)),
                job_variables={"preset": preset, "cpu": 2, "memory": "4Gi", "gpu": 1 if preset == "gpu-1" else 0},
                work_queue_name="medium",
            )
            rid = str(run.id)
            seeded.run_ids.append(rid)
            if i >= n_done + n_failed + n_running:
                seeded.queued_ids.append(rid)
                continue
            client.set_flow_run_state(run.id, Pending(), force=True)
            client.set_flow_run_state(run.id, Running(), force=True)
            if i < n_done:
                client.set_flow_run_state(run.id, Completed(), force=True)
            elif i < n_done + n_failed:
                client.set_flow_run_state(run.id, Failed(message=f"RuntimeError: loss is NaN in run {i}"), force=True)
                seeded.failed_ids.append(rid)
            else:
                seeded.running_ids.append(rid)
        if metrics:
            _seed_metrics(client, seeded, jobs, pool)
    wait_indexed(seeded.run_ids)
    return seeded


def wait_indexed(run_ids: list[str], timeout: float = 30.0) -> None:
    """If this process's monitor already has a run index, sync it until it holds these runs.

    The runs above are back-dated (expected minutes ago), so the index learns of them
    through Prefect's events, which the server persists every few seconds; a page that
    renders right after seeding would otherwise show them a few seconds late.
    """
    import time

    from prefect_launch.dashboard import index_sync as X
    from prefect_launch.dashboard.api import get_api
    from prefect_launch.dashboard.metrics_source import metrics_store

    store = metrics_store()
    if store is None:
        return
    svc = X.service_for(store, get_api())
    deadline = time.monotonic() + timeout
    while svc.building() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not svc.covers(dt.datetime.now(UTC) - dt.timedelta(hours=1)):
        return  # not built: the first build reads every run as it is then
    while time.monotonic() < deadline:
        X.sync(svc.index, svc.api)
        if set(svc.index.frame(ids=run_ids, columns=["id"])["id"]) >= set(run_ids):
            return
        time.sleep(0.5)
    raise AssertionError("the run index did not receive the seeded runs within the timeout")


def _seed_metrics(client, seeded: Seeded, jobs: list[str], pool: str) -> None:
    from prefect_launch.blocks.metrics_records import RunRecord, RunSummary
    from prefect_launch.blocks.metrics_store import RunMetricsStore

    # one explicit store for the test process and the dashboards it starts (they inherit the env)
    home = Path(os.environ.get("PREFECT_HOME") or tempfile.gettempdir())
    url = os.environ.setdefault("LAUNCH_METRICS_URL", f"sqlite:///{home / 'launch-metrics-dashboard.db'}")
    store = RunMetricsStore(url=url)
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(i) for i in seeded.run_ids])))
    for k, r in enumerate(runs):
        if r.start_time is None:
            continue
        owner = next(t.split(":", 1)[1] for t in r.tags if t.startswith("owner:"))
        preset = next(t.split(":", 1)[1] for t in r.tags if t.startswith("preset:"))
        gpu = 1 if preset == "gpu-1" else 0
        store.upsert_run(RunRecord(flow_run_id=str(r.id), flow_run_name=r.name, queue=pool, work_queue="medium",
                                   job=jobs[0] if r.name else None, flow="dash-flow", owner=owner, preset=preset, cpu=2,
                                   memory_bytes=4 * 2**30, gpu=gpu, submitted_at=r.expected_start_time, started_at=r.start_time))
        if r.end_time is None:
            continue
        waste = k % 3 == 0
        store.write_summary(str(r.id), RunSummary(
            flow_run_id=str(r.id), started_at=r.start_time, ended_at=r.end_time, duration_s=30.0 + 10 * k,
            avg_cpu_pct=5.0 if waste else 150.0, avg_cpu_share_pct=2.5 if waste else 75.0, peak_rss_bytes=(1 + k) * 2**28,
            avg_gpu_util_pct=(3.0 if waste else 85.0) if gpu else None, peak_gpu_mem_bytes=(2 + k) * 2**30 if gpu else None,
            allocated_cpus=2, allocated_memory_bytes=4 * 2**30, allocated_gpus=gpu, samples=10, exit_state=r.state_type.value,
            wasteful=waste, waste_reasons=["GPU idle: avg util 3% < 10%"] if waste else [],
        ))


ROOT_APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


def fresh_app(timeout: float = 120):
    """The monitor page under AppTest with Streamlit's caches emptied first.

    ``st.cache_data`` and the page's reads (:mod:`prefect_launch.dashboard.page_data`) live for the whole test process, so a page another test opened up to
    a minute ago would hide the queues this test just created (a real user waits the TTL out).
    """
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from prefect_launch.dashboard import metrics_source as M
    from prefect_launch.dashboard import page_data as P

    st.cache_data.clear()
    st.cache_resource.clear()  # the frame's API client and run index (dashboard/app.py)
    P.clear()
    M.STORE_CACHE.clear()
    return AppTest.from_file(ROOT_APP, default_timeout=timeout)


def tables(at) -> list:
    """Every table on an AppTest page (``st.dataframe``) as a frame, in page order."""
    return [d.value for d in at.dataframe]


def figures(at) -> dict:
    """Every headline figure on an AppTest page (``st.metric``), label to value as shown."""
    return {m.label: m.value for m in at.metric}


def _as_shown(text: str) -> str:
    """Markdown text as the page shows it (dashboard/caption_text.plain escapes punctuation with backslashes)."""
    import re

    return re.sub(r"\\(.)", r"\1", text)


def headings(at) -> list[str]:
    """The page's panel headings (``st.subheader``), in page order."""
    return [_as_shown(s.value) for s in at.subheader]


def captions(at) -> str:
    """Every caption line on an AppTest page (``st.caption``), as shown, one a line."""
    return "\n".join(_as_shown(c.value) for c in at.caption)


def control(at, key: str):
    """The control with ``key`` on an AppTest page: pills, a segmented control, a multiselect or a toggle."""
    for kind in ("button_group", "multiselect", "toggle"):
        for w in at.get(kind):
            if w.key == key:
                return w
    raise KeyError(f"no control {key!r}")


def choose(at, key: str, values: list):
    """Pick ``values`` in the control ``key`` as a click would: several for pills or a multiselect, the first
    for a segmented control, on (any value) or off (none) for a toggle. Returns ``at``, to be run."""
    w = control(at, key)
    if w.type == "toggle":
        return w.set_value(bool(values))
    if w.type == "button_group" and not isinstance(w.value, list):  # a segmented control: one value
        return w.set_value(values[0])
    return w.set_value(list(values))
