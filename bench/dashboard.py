"""Benchmark the queue monitor's data layer against the naive way of reading runs.

    python bench/dashboard.py                 # 10k runs over 7 days
    python bench/dashboard.py --runs 100000   # the target size
    python bench/dashboard.py --runs 1000000 --days 30 --database postgresql   # issue 41's size: PostgreSQL under it all

--database postgresql puts the Prefect server's database and the run metrics store (with the monitor's run
index) on a private PostgreSQL (fsync off, as in the tests); --days spreads the seeded runs over that many
days (the view timed stays the monitor's default, the last 7 days, so with --days 30 it holds about a
quarter of them).

It starts its own Prefect server (SQLite, throw-away PREFECT_HOME), creates pools,
queues, a flow and deployments through the API, then stops the server and bulk-inserts
N flow runs (with their current state rows) straight into the server's own tables
through Prefect's ORM table definitions - thousands of times faster than creating them
through the API - and starts the server again. Metrics are written to the run metrics
store when `prefect_launch.blocks.metrics_store` is importable.

The runs look like a working week: submissions peak on weekday working hours and at a
nightly sweep; durations run from minutes to hours (median ~10 min, ~1 in 6 over an hour,
the longest a day or more), so runs span many buckets of the 7-day view; the two
launch-process pools' runs are placed on simulated agents (8 GPUs / 64 cores each): a run
starts when its GPUs and cores are free and carries the agent's placement label, so the
Gantt draws real lanes per agent and device and waits grow at the peaks.

The run index (the monitor's copy of the runs' filter columns, in the metrics store)
is built once after seeding and its build time printed; then the data layer is timed
from the index (what the page uses once the index covers the range) and, for
comparison, from Prefect's API alone (server-side aggregation per group). Timed, each
several times (medians printed):
- cold load: the dashboard's data layer for the default view (all queues, last 7 days)
  with empty caches;
- filter change: from the default view just loaded (its caches held, as the page's
  process holds them) to a view it has not seen, its range 10 s later (and
  after a real pause long enough that the index syncs with the server first): one
  queue, one owner, one job, one preset, one status, and grouping by owner. filter_s is
  the median over the queue and owner changes; each kind is printed (and in the JSON as
  <kind>_s);
- naive: page through every flow run in the range with the Prefect client (200 per
  request, the API's cap) - what a dashboard without server-side aggregation does
  (--naive-max-runs: stop after that many and extrapolate, for 1M runs).

The last line printed is one JSON object: runs, cold_s, filter_s, naive_s, speedup_cold (the
index path), and queue_s, owner_s, job_s, preset_s, status_s, grouping_s, refresh_s,
index_build_s, api_cold_s, api_filter_s (the API-only path; null with --sources index), occupancy_s
(the occupancy panels of the 7-day view, computed from the index's rows held in memory), and
page_cold_s, page_warm_s: what a person waits for, from navigation to a fully drawn first page (every
panel of it there - the summary, job status, queued time, the first section (job runs), external links -,
every chart and table drawn, the script done; the other sections are drawn when chosen) in headless Chromium
through Playwright - cold:
the first visit after the monitor started (`python -m prefect_launch.dashboard.serve`, as `make dashboard` and
the demo start it: it reads the default view before it takes visits, timed as page_prepare_s, from the process's
start to its health check answering; the run index already built);
warm: a new visit (new session) right after, in a new browser profile (Streamlit's scripts fetched and
compiled again); page_return_s: a visit right after in the cold visit's profile (a returning visitor,
the browser's caches warm); page_warm_laptop_s: a warm visit in a new profile at a 1600x1000 window, where the
others use a 1600x7000 one (the whole page on screen, so rastered too): the same page, every part of it drawn, the
part below the window shown on scrolling (null where Chromium or Playwright is missing, or
with --no-page); page_floor_s: the same timing for a Streamlit page holding only a title and one empty
panel, in the same browser, its first visit left out (what Streamlit itself costs on the machine, below which
no page of it draws; page_warm_over_floor_s / page_cold_over_floor_s: page_warm_s / page_cold_s less page_floor_s, the
monitor measured against Streamlit itself in the same run (goals at 100k runs: <= 0.8 s / <= 2 s);
page_floor_return_s likewise in one profile: compare with page_return_s;
page_floor_controls_s / page_floor_controls_return_s: the same with the monitor's own sidebar (its filters offering the
seed's queues, jobs, owners and presets), section switch and links toggle, and no data: what a page with these controls
costs before it draws any figure; --page-only times only these, after building the index, the other figures null);
page_server_cpu_cores: the CPU the Prefect server used while the page was timed, in cores (its own services count:
on a seed whose last day holds ~800 cancelled runs, stock Prefect's cancellation cleanup reads each again every
20 s, ~0.5 of this box's 2 cores, whatever the monitor does; --no-cancellation-cleanup turns that service off
for the bench's server, to show what the page costs without it; server_cancellation_cleanup says which); loadavg_start / loadavg_end: the machine's load averages (on a shared box every
figure is an upper bound); cpu_probe_s: [start, end] seconds of a fixed pure-Python loop on one core (the
speed the machine gave; it varies by nearly 2x within minutes on a shared virtual machine). Progress lines carry the elapsed time and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import datetime as dt
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import psutil

from prefect_launch.local_server import (CHROMIUM, CHROMIUM_ARGS, create_database, free_port, local_postgres,
                                         local_prefect_server, pg_url)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stack import stop_on_signals, streamlit_app  # noqa: E402
from _stack import visit as _stack_visit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

POOLS = [("gpu-a100", "launch-process"), ("cpu-batch", "launch-process"), ("k8s-gpu", "kubernetes")]
PRIORITIES = ["critical", "high", "medium", "low"]
JOBS = ["train-resnet", "train-llm", "evaluate", "preprocess", "sweep-hparams", "notebook"]
OWNERS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
PRESETS = {
    "small": dict(cpu=2, memory="4Gi", gpu=0),
    "medium": dict(cpu=4, memory="16Gi", gpu=0),
    "gpu-1": dict(cpu=8, memory="32Gi", gpu=1),
    "gpu-2": dict(cpu=16, memory="64Gi", gpu=2),
}
# what each pool runs (the kubernetes pool: anything, placed by Kubernetes, not by an agent)
POOL_PRESETS = {"gpu-a100": {"gpu-1": 0.7, "gpu-2": 0.3}, "cpu-batch": {"small": 0.6, "medium": 0.4},
                "k8s-gpu": {"small": 0.25, "medium": 0.25, "gpu-1": 0.25, "gpu-2": 0.25}}
# launch agents per pool (8 GPUs / 64 cores each): sized per 100k runs a week so that waits stay
# short except at the weekday peaks (scaled with --runs)
AGENTS_PER_100K = {"gpu-a100": 48, "cpu-batch": 14}
GPUS_PER_AGENT, CORES_PER_AGENT = 8, 64
# durations: minutes to hours (runs span many buckets of a 7-day view's hourly intervals)
DURATIONS = ((0.55, 240.0, 0.8), (0.30, 1800.0, 0.6), (0.15, 3 * 3600.0, 0.7))  # (share, median s, log sigma)


def _duration(rng: random.Random) -> float:
    roll = rng.random()
    for share, median, sigma in DURATIONS:
        if roll < share:
            return rng.lognormvariate(math.log(median), sigma)
        roll -= share
    return rng.lognormvariate(math.log(DURATIONS[-1][1]), DURATIONS[-1][2])


class Cluster:
    """Launch agents of one pool: when each GPU and core is free next. A run starts on the
    agent where its GPUs and cores free up first (not before it is due), and holds them to
    its end: placements and waits as an agent's ledger makes them."""

    def __init__(self, pool: str, agents: int) -> None:
        import numpy as np

        self.names = [f"{pool}-node{i:02d}" for i in range(agents)]
        self.gpu = np.zeros((agents, GPUS_PER_AGENT))
        self.core = np.zeros((agents, CORES_PER_AGENT))

    def place(self, due: float, gpus: int, cores: int, duration: float) -> tuple[float, str]:
        """(start, placement label) of a run due at ``due`` (epoch s)."""
        import numpy as np

        g_ready = np.sort(self.gpu, axis=1)[:, gpus - 1] if gpus else np.zeros(len(self.names))
        c_ready = np.partition(self.core, cores - 1, axis=1)[:, cores - 1]
        ready = np.maximum(np.maximum(g_ready, c_ready), due)
        a = int(np.argmin(ready))
        start = float(ready[a])
        g = np.argsort(self.gpu[a], kind="stable")[:gpus] if gpus else np.array([], dtype=int)
        c = np.argsort(self.core[a], kind="stable")[:cores]
        self.gpu[a, g] = start + duration
        self.core[a, c] = start + duration
        label = (f"agent {self.names[a]}: cpu={cores},memory=1Gi,gpu={gpus}; gpus {','.join(map(str, sorted(g))) or 'none'}; "
                 f"cores {','.join(map(str, sorted(c)))}")
        return start, label


def create_objects(api_url: str) -> dict:
    """Pools with priority queues, one flow, one deployment per (job, pool)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    out: dict = {"pools": {}, "deployments": {}}
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("launch-job")
        out["flow_id"] = str(flow_id)
        for pool, ptype in POOLS:
            wp = client.create_work_pool(WorkPoolCreate(name=pool, type=ptype, concurrency_limit=8))
            queues = {}
            for prio, q in enumerate(PRIORITIES, start=1):
                wq = client.create_work_queue(name=q, work_pool_name=pool, priority=prio)
                queues[q] = str(wq.id)
            out["pools"][pool] = {"id": str(wp.id), "queues": queues}
            for job in JOBS:
                dep_id = client.create_deployment(flow_id=flow_id, name=job, work_pool_name=pool, work_queue_name="medium")
                out["deployments"][(job, pool)] = str(dep_id)
    return out


def _load_shape(t: dt.datetime) -> float:
    """Relative submission rate: busy on weekday working hours, a nightly sweep burst."""
    hour, wd = t.hour, t.weekday()
    base = 0.25
    if wd < 5 and 9 <= hour < 18:
        base = 1.0
    if hour in (1, 2):
        base = 1.4  # nightly sweeps
    return base


def bulk_insert_runs(db_url: str, objects: dict, n: int, now: dt.datetime, seed: int = 7, days: int = 7) -> list[dict]:
    """Insert n flow runs over the last ``days`` with one current-state row each into the server's database
    (``db_url``, a synchronous SQLAlchemy URL: SQLite or PostgreSQL), foreign keys unchecked while it runs
    (a run and its state row point at each other).

    Runs of the launch-process pools are placed on simulated agents (:class:`Cluster`):
    their start waits for free GPUs and cores, and they carry the agent's placement label
    (``launch.placement``) as real runs do; the kubernetes pool's runs start after a short
    random wait and carry none."""
    import sqlalchemy as sa
    from prefect.server.database import orm_models
    from prefect.server.schemas.states import StateType

    rng = random.Random(seed)
    start = now - dt.timedelta(days=days)
    span = (now - start).total_seconds()
    now_s = now.timestamp()
    expected: list[float] = []
    while len(expected) < n:  # submission times, shaped like a working week
        exp = start + dt.timedelta(seconds=rng.random() * span)
        if rng.random() <= _load_shape(exp) / 1.4:
            expected.append(exp.timestamp())
    expected.sort()
    t0, step = time.perf_counter(), max(n // 10, 1)
    clusters = {p: Cluster(p, max(1, round(k * n / 100_000))) for p, k in AGENTS_PER_100K.items()}
    runs, states, summary = [], [], []
    for exp_s in expected:
        if len(runs) % step == 0 and len(runs):
            print(f"  ... {len(runs)} runs placed ({time.perf_counter() - t0:.0f} s, load {loadavg()})")
        pool = rng.choice(POOLS)[0]
        job = rng.choice(JOBS)
        owner = rng.choice(OWNERS)
        choices = POOL_PRESETS[pool]
        preset = rng.choices(list(choices), weights=list(choices.values()))[0]
        prio = rng.choice(PRIORITIES)
        duration = _duration(rng)
        p = PRESETS[preset]
        due = exp_s + rng.expovariate(1 / 15.0)  # the agent's next poll
        labels = {}
        if pool in clusters:
            start_s, labels["launch.placement"] = clusters[pool].place(due, p["gpu"], p["cpu"], duration)
        else:
            start_s = exp_s + rng.expovariate(1 / 90.0)
        exp = dt.datetime.fromtimestamp(exp_s, dt.timezone.utc)
        st_start = dt.datetime.fromtimestamp(start_s, dt.timezone.utc)
        st_end = st_start + dt.timedelta(seconds=duration)
        roll = rng.random()
        message = None
        if start_s > now_s:
            stype, sname, st_start, st_end, labels = StateType.SCHEDULED, "Scheduled", None, None, {}
        elif st_end > now:
            stype, sname, st_end = StateType.RUNNING, "Running", None
        elif roll < 0.07:
            stype, sname, message = StateType.FAILED, "Failed", f"Flow run encountered an exception: RuntimeError('{job} diverged: loss is NaN')"
        elif roll < 0.09:
            stype, sname, message = StateType.CRASHED, "Crashed", "Flow run infrastructure exited with non-zero status code 137 (OOM killed)"
        elif roll < 0.11:
            stype, sname, message = StateType.CANCELLED, "Cancelled", "Cancelled by user"
        else:
            stype, sname = StateType.COMPLETED, "Completed"
        rid, sid = uuid.uuid4(), uuid.uuid4()
        ts = st_end or st_start or exp
        total = dt.timedelta(seconds=duration) if st_end else dt.timedelta(0)
        jv = {"preset": preset, **p}
        runs.append(
            dict(
                id=rid, created=exp, updated=ts, name=f"{job}-{rid.hex[:8]}", flow_id=uuid.UUID(objects["flow_id"]),
                deployment_id=uuid.UUID(objects["deployments"][(job, pool)]), work_queue_name=prio,
                work_queue_id=uuid.UUID(objects["pools"][pool]["queues"][prio]), state_type=stype, state_name=sname,
                state_timestamp=ts, state_id=sid, expected_start_time=exp, start_time=st_start, end_time=st_end,
                total_run_time=total, run_count=1 if st_start else 0,
                tags=["launch", f"owner:{owner}", f"preset:{preset}"], job_variables=jv, labels=labels,
            )
        )
        states.append(dict(id=sid, flow_run_id=rid, type=stype, name=sname, timestamp=ts, message=message, created=ts, updated=ts))
        summary.append(dict(id=str(rid), pool=pool, job=job, owner=owner, preset=preset, start=st_start, end=st_end, duration=duration))
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
        else:  # PostgreSQL: the bench's own superuser skips the FK triggers for this transaction
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
        for i in range(0, n, 5000):
            conn.execute(sa.insert(orm_models.FlowRun.__table__), runs[i : i + 5000])
            conn.execute(sa.insert(orm_models.FlowRunState.__table__), states[i : i + 5000])
            if (i + 5000) % step < 5000:
                print(f"  ... {i + 5000} runs inserted ({time.perf_counter() - t0:.0f} s, load {loadavg()})")
    engine.dispose()
    return summary


def duration_figures(summary: list[dict]) -> str:
    """What the seeded runs look like: durations, waits and concurrency (for the record)."""
    import statistics as stats

    d = sorted(r["duration"] for r in summary)
    q = lambda f: d[min(len(d) - 1, int(f * len(d)))]  # noqa: E731
    return (f"durations: median {q(0.5) / 60:.0f} min, p90 {q(0.9) / 3600:.1f} h, max {d[-1] / 3600:.1f} h, "
            f"mean {stats.fmean(d) / 60:.0f} min; over 1 h: {sum(x > 3600 for x in d) / len(d):.0%}")


def seed_metrics(summary: list[dict], seed: int = 11) -> bool:
    """Write per-run records and summaries into the run metrics store (default URL under
    PREFECT_HOME), in bulk through the store's own table definitions."""
    try:
        from prefect_launch.blocks import metrics_schema as S
        from prefect_launch.blocks.metrics_repository import to_ms
        from prefect_launch.blocks.metrics_store import RunMetricsStore
    except Exception:
        return False
    rng = random.Random(seed)
    store = RunMetricsStore(url=os.environ.get("LAUNCH_METRICS_URL"))  # the bench's PostgreSQL one, else the default
    runs, sums = [], []
    for i, r in enumerate(summary, start=1):
        p = PRESETS[r["preset"]]
        gpus = p["gpu"]
        started = r["start"]
        runs.append(dict(id=i, flow_run_id=r["id"], flow_run_name=f"{r['job']}-{r['id'][:8]}", queue=r["pool"], work_queue="medium",
                         job=r["job"], flow="launch-job", owner=r["owner"], preset=r["preset"], alloc_cpus=p["cpu"],
                         alloc_memory_bytes=int(p["memory"][:-2]) * 2**30, alloc_gpus=gpus,
                         started_ms=to_ms(started) if started else None, ended_ms=to_ms(r["end"]) if r["end"] else None,
                         submitted_ms=to_ms(started) if started else None, created_ms=to_ms(started) if started else None,
                         state="COMPLETED" if r["end"] else None))
        if r["end"] is None:
            continue
        idle = rng.random() < 0.08
        util = rng.uniform(0, 8) if idle else rng.uniform(40, 99)
        sums.append(dict(run_id=i, duration_s=r["duration"], queue_s=None, cpu_seconds=r["duration"] * p["cpu"] * util / 100,
                         avg_cpu_pct=util * p["cpu"], max_cpu_pct=min(100.0 * p["cpu"], util * p["cpu"] * 1.3),
                         avg_cpu_share_pct=util, avg_rss_bytes=int(p["cpu"] * 2**30 * util / 100),
                         peak_rss_bytes=int(p["cpu"] * 2**30 * (0.2 + util / 80)),
                         avg_gpu_util_pct=util if gpus else None, max_gpu_util_pct=min(100.0, util * 1.2) if gpus else None,
                         peak_gpu_mem_bytes=int(gpus * 80 * 2**30 * util / 110) if gpus else None,
                         gpu_mem_total_bytes=gpus * 80 * 2**30 if gpus else None, samples=int(r["duration"] // 5), lost_samples=0,
                         exit_state="COMPLETED", wasteful=idle, waste_reasons=json.dumps(["GPU idle: avg util < 10%"] if idle and gpus else
                                                                                        (["CPU idle: avg < 10% of allocation"] if idle else [])),
                         written_ms=to_ms(r["end"])))
    with store._write() as conn:  # the store's write transaction (BEGIN IMMEDIATE on SQLite)
        for i in range(0, len(runs), 5000):
            conn.execute(S.runs.insert(), runs[i : i + 5000])
        for i in range(0, len(sums), 5000):
            conn.execute(S.summaries.insert(), sums[i : i + 5000])
    return True


def naive_read(api_url: str, since: dt.datetime, until: dt.datetime, max_runs: Optional[int] = None) -> int:
    """Page through every run in the range with the client, 200 at a time (the API's cap);
    with ``max_runs``, stop once that many are read (the caller extrapolates: the pages cost
    the same all the way down).

    Keyset pages (expected_start_time before the last one seen) keep this linear; offset
    paging measured far worse at 100k runs (783 s, 128 runs/s: each page re-skips the offset).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterExpectedStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    seen: set = set()
    before = until
    with get_client(sync_client=True) as client:
        while True:
            flt = FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since, before_=before))
            page = client.read_flow_runs(flow_run_filter=flt, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)
            new = [r for r in page if r.id not in seen]
            seen.update(r.id for r in page)
            if len(page) < 200 or not new or (max_runs and len(seen) >= max_runs):
                return len(seen)
            before = page[-1].expected_start_time


def cpu_probe() -> float:
    """Seconds one core takes for a fixed pure-Python loop (~0.25 s here at its fastest): the speed the
    machine gave when it was read. On a shared virtual machine it varies by nearly 2x within minutes, which
    no load average shows; compare runs only where their probes agree."""
    t, x = time.process_time(), 0
    for i in range(4_000_000):
        x += i
    return round(time.process_time() - t, 3)


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (the box is shared: timings are upper bounds)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


print = functools.partial(print, flush=True)  # noqa: A001  (progress shows up when piped)


PAGE_TIMEOUT_S = 600
# the first page: the summary (load chart; the hour x weekday heatmap, an Altair chart), job status,
# queued time and the first section (job runs: the Gantt); the other sections are drawn when chosen.
# Its tables (queue summary, idle periods, the runs under the Gantt; who waits and agents when there
# are) are Streamlit's grids (st.dataframe): drawn once each holds its canvas
FIRST_PAGE_CHARTS = 4
# the sidebar drawn: each of its choices as its control (pills or a segmented control, or a multiselect for a long
# list: dashboard/widgets.py) and its last control, Refresh now
SIDEBAR_JS = ("['queues', 'f_jobs', 'f_owners', 'f_statuses', 'f_presets', 'range', 'grouping', 'detail_limit'].every(k => "
              "document.querySelector(`[data-testid=\"stSidebarContent\"] .st-key-${k} [data-testid=\"stButtonGroup\"], "
              "[data-testid=\"stSidebarContent\"] .st-key-${k} [data-testid=\"stMultiSelect\"]`)) "
              "&& !!document.querySelector('[data-testid=\"stSidebarContent\"] .st-key-refresh button')")
FIRST_PAGE_TABLES = 2  # at least: the queue summary and the runs under the Gantt
DRAWN_JS = """() => !!document.querySelector('.st-key-panel-links')
    && !document.querySelector('[data-testid="stStatusWidget"]')
    && !!document.querySelector('.st-key-panel-summary .vega-embed canvas, .st-key-panel-summary .vega-embed svg')
    && %s
    && document.querySelectorAll('[data-testid="stDataFrame"]').length >= %d
    && [...document.querySelectorAll('[data-testid="stDataFrame"]')].every(e => e.querySelector('canvas'))
    && document.querySelectorAll('.lt-chart[data-drawn] canvas').length >= %d""" % (SIDEBAR_JS, FIRST_PAGE_TABLES, FIRST_PAGE_CHARTS)


PREPARE_S: list[float] = []  # each monitor's start until it answered its health check (page_prepare_s)
FLOOR_APP = """import streamlit as st
st.set_page_config(page_title="floor", layout="wide")
st.title("Queue monitor")
with st.container(key="panel-links", border=True):
    st.subheader("External Links")
"""
FLOOR_JS = """() => !!document.querySelector('.st-key-panel-links')
    && !document.querySelector('[data-testid="stStatusWidget"]')"""
# the floor with the monitor's controls: its real sidebar (dashboard/sidebar.py) offering the seed's queues, jobs,
# owners and presets, the section switch and the links toggle, and no data: what a page with these
# controls costs before it draws any figure, chart or table
CONTROLS_APP = """import json
import streamlit as st
from prefect_launch.dashboard import widgets
from prefect_launch.dashboard.sidebar import sidebar
st.set_page_config(page_title="floor", layout="wide")
st.set_option("client.toolbarMode", "minimal")
st.title("Queue monitor")
sidebar(json.loads(%r), lambda: None)
# the section switch and the links switch, as dashboard/app.py draws them
widgets.single("Section", ["Job runs", "Resource use", "Cost and waste", "Errors"], "section", "Job runs", hide_label=True)
with st.container(key="panel-links", border=True):
    st.subheader("External Links")
    st.toggle("Manage Links", key="links_open")
"""
CONTROLS_JS = FLOOR_JS + "\n    && " + SIDEBAR_JS


VIEWPORT = {"width": 1600, "height": 7000}  # the whole page on screen: every part of it rastered too
LAPTOP = {"width": 1600, "height": 1000}  # a person's window: the page below it laid out and drawn, shown on scrolling


def visit(target, url: str, drawn_js: str, viewport: dict = VIEWPORT) -> float:
    """A timed visit of the monitor's page (:func:`_stack.visit`), by default at :data:`VIEWPORT`, so the whole
    page is on screen."""
    return _stack_visit(target, url, drawn_js, viewport, PAGE_TIMEOUT_S)


class Floor(NamedTuple):
    """A Streamlit page timed as the monitor's floor: its name (in file names), what it holds, its
    app's text (given the page's options) and the check that it is drawn."""
    name: str
    what: str
    app: Callable[[], str]
    drawn_js: str


def _controls_app() -> str:
    from prefect_launch.dashboard import page_data

    opts = page_data.options()
    return CONTROLS_APP % json.dumps({k: list(opts[k]) for k in ("queues", "jobs", "owners", "presets")})


BARE = Floor("floor", "title + one empty panel", lambda: FLOOR_APP, FLOOR_JS)
CONTROLS = Floor("floor-controls", "title, the monitor's sidebar and switches, no data", _controls_app, CONTROLS_JS)


def page_floor(home: Path, visits: int = 5, floor: Floor = BARE) -> tuple[list[float], list[float]]:
    """Seconds from navigation to a drawn page for a Streamlit app with a title and one empty panel
    (:data:`CONTROLS`: and the monitor's own sidebar, section switch and links toggle), timed like the
    monitor (same browser flags; the first visit left out): what Streamlit itself costs on this machine
    before the monitor draws anything. Two lists: a new browser profile per visit, and every visit in
    one profile (a returning visitor); ([], []) without Chromium."""
    if not Path(CHROMIUM).exists():
        return [], []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return [], []
    app = home / f"{floor.name.replace('-', '_')}_app.py"
    app.write_text(floor.app())
    out: list[float] = []  # the first visit left out (the browser's caches filled)
    back: list[float] = []
    with streamlit_app(["streamlit", "run", str(app)], home / f"streamlit-{floor.name}.log") as url:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                out = [visit(browser, url, floor.drawn_js) for _ in range(visits + 1)][1:]
                ctx = browser.new_context(viewport=VIEWPORT)
                back = [visit(ctx, url, floor.drawn_js) for _ in range(visits + 1)][1:]
            finally:
                browser.close()
    return out, back


def floor_line(floor: list[float], back: list[float], what: str = "title + one empty panel") -> str:
    return (f"Streamlit floor ({what}, same browser): median {statistics.median(floor):.3f} s "
            f"({', '.join(f'{x:.3f}' for x in floor)}), returning visit median {statistics.median(back):.3f} s"
            if floor and back else "Streamlit floor: not timed")


def page_times(home: Path, repeat: int = 2) -> tuple[list[float], list[float], list[float], list[float]]:
    """(cold, warm, return) seconds from navigation to a fully drawn page in headless Chromium, one
    fresh monitor per repeat: cold, its first visit in a new browser profile; warm, a visit right after
    in another new profile (the monitor warm, the browser's caches empty); return, a visit right after
    in the first profile (a returning visitor: Streamlit's scripts from its cache); laptop, then a warm visit in
    a new profile at :data:`LAPTOP`'s window, the rest of the page drawn below it. ([], [], [], []) without
    Chromium or Playwright."""
    if not Path(CHROMIUM).exists():
        return [], [], [], []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return [], [], [], []
    colds: list[float] = []
    warms: list[float] = []
    returns: list[float] = []
    laptops: list[float] = []
    for k in range(repeat):
        t_start = time.perf_counter()
        # started as `make dashboard` and the demo start it: ready (the default view read) before it takes visits
        with streamlit_app(["prefect_launch.dashboard.serve"], home / f"streamlit-{k}.log", timeout=300) as url:
            PREPARE_S.append(time.perf_counter() - t_start)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                try:
                    first = browser.new_context(viewport=VIEWPORT)
                    for out, target, viewport in ((colds, first, VIEWPORT), (warms, browser, VIEWPORT),
                                                  (returns, first, VIEWPORT), (laptops, browser, LAPTOP)):
                        try:
                            out.append(visit(target, url, DRAWN_JS, viewport))
                        except Exception as exc:  # not drawn in time: said so, the other figures still printed
                            print(f"page not drawn within {PAGE_TIMEOUT_S} s ({type(exc).__name__})")
                            return colds, warms, returns, laptops
                finally:
                    browser.close()
    return colds, warms, returns, laptops


def server_cpu_s() -> float:
    """CPU seconds so far of the Prefect server(s) this benchmark started (its own services included)."""
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            if "server" in p.cmdline() and "start" in p.cmdline():
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:  # gone between the listing and the read
            pass
    return total


def page_figures(home: Path, repeat: int) -> dict:
    """Time the page (:func:`page_times`) and the Streamlit floor, print them, and return their figures
    for the JSON line (None where not timed)."""
    cpu0, t0 = server_cpu_s(), time.perf_counter()
    cold, warm, back, laptop = page_times(home, repeat)
    server_cores = round((server_cpu_s() - cpu0) / (time.perf_counter() - t0), 2)
    print(f"Prefect server CPU while the page was timed: {server_cores:.2f} cores (of {os.cpu_count()})")
    floor, floor_back = page_floor(home, floor=BARE) if cold else ([], [])
    print(floor_line(floor, floor_back, BARE.what))
    controls, controls_back = page_floor(home, floor=CONTROLS) if cold else ([], [])
    print(floor_line(controls, controls_back, CONTROLS.what))
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    if cold:
        line = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"page drawn in Chromium     cold median {med(cold):.3f} s ({line(cold)}), warm (new profile) median "
              f"{med(warm):.3f} s ({line(warm)}), returning visit median {med(back) or float('nan'):.3f} s ({line(back)}), "
              f"warm at a {LAPTOP['width']}x{LAPTOP['height']} window median {med(laptop) or float('nan'):.3f} s ({line(laptop)}); "
              f"monitor ready {', '.join(f'{x:.1f}' for x in PREPARE_S)} s after its start")
    over = lambda xs: round(med(xs) - med(floor), 3) if xs and floor else None  # noqa: E731
    if cold and floor:
        print(f"page over the Streamlit floor  warm {over(warm):+.3f} s, cold {over(cold):+.3f} s "
              "(goals at 100k runs: warm <= 0.8 s, cold <= 2 s)")
    return dict(page_cold_s=med(cold), page_warm_s=med(warm), page_return_s=med(back), page_warm_laptop_s=med(laptop),
                page_prepare_s=round(statistics.median(PREPARE_S), 1) if PREPARE_S else None, page_floor_s=med(floor),
                page_floor_return_s=med(floor_back), page_floor_controls_s=med(controls),
                page_floor_controls_return_s=med(controls_back), page_warm_over_floor_s=over(warm),
                page_cold_over_floor_s=over(cold), page_server_cpu_cores=server_cores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--naive-repeat", type=int, default=1)
    ap.add_argument("--naive-max-runs", type=int, default=None,
                    help="read at most this many runs the naive way and extrapolate its time to every run in range")
    ap.add_argument("--sources", default="index,api", help="data paths to time: index, api or both (the JSON's figures are the index's)")
    ap.add_argument("--days", type=int, default=7, help="days the seeded runs are spread over (the view timed is the last 7)")
    ap.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite",
                    help="the Prefect server's database and the metrics store's (with the run index): SQLite files "
                         "under PREFECT_HOME, or a private PostgreSQL (kept with --keep, reused with --home)")
    ap.add_argument("--keep", action="store_true", help="keep the server's PREFECT_HOME")
    ap.add_argument("--home", help="reuse a PREFECT_HOME kept by --keep (its runs and metrics; no seeding)")
    ap.add_argument("--page-repeat", type=int, default=2, help="fresh `streamlit run`s timed in the browser")
    ap.add_argument("--no-page", action="store_true", help="skip the browser timing (page_cold_s, page_warm_s)")
    ap.add_argument("--page-only", action="store_true",
                    help="time only the page (after the run index is built); the data-layer figures are null")
    ap.add_argument("--no-cancellation-cleanup", action="store_true",
                    help="turn stock Prefect's cancellation-cleanup service off in the bench's server (see page_server_cpu_cores)")
    args = ap.parse_args()
    stop_on_signals()  # SIGTERM / SIGHUP unwind like Ctrl-C: the server and the monitors it started are stopped
    t_start = time.perf_counter()
    load_start, probe_start = loadavg(), cpu_probe()

    def stage(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s, load {loadavg()}] {msg}")

    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    if args.home and (home / "bench-runs.txt").exists():  # the runs the kept home was seeded with, not --runs
        args.runs = int((home / "bench-runs.txt").read_text())
    if args.home and (home / "bench-seed.json").exists():  # ... and its days and database
        args.days, args.database = (json.loads((home / "bench-seed.json").read_text())[k] for k in ("days", "database"))
    stage(f"bench/dashboard.py --runs {args.runs}: load average at start {load_start} ({os.cpu_count()} CPUs), "
          f"CPU probe {probe_start:.3f} s")
    port = free_port()  # the same port for both server starts
    api_url = f"http://127.0.0.1:{port}/api"
    os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    databases = contextlib.ExitStack()  # PostgreSQL (--database postgresql), stopped last
    db_url, seed_url = None, f"sqlite:///{home / 'prefect.db'}"
    if args.database == "postgresql":
        # its data beside the home, not in it: the home is private (0700) and PostgreSQL runs as another user
        pg_base = Path((home / "bench-pg.txt").read_text()) if (home / "bench-pg.txt").exists() else \
            Path(tempfile.mkdtemp(prefix="bench-dashboard-pg-"))
        (home / "bench-pg.txt").write_text(str(pg_base))
        pg_port = databases.enter_context(local_postgres(pg_base, keep=bool(args.keep or args.home)))
        for db in ("prefect", "metrics"):
            create_database(pg_port, db)
        db_url, seed_url = pg_url(pg_port, "prefect", driver="asyncpg"), pg_url(pg_port, "prefect")
        os.environ["LAUNCH_METRICS_URL"] = pg_url(pg_port, "metrics")  # the bench's reads, the seed and the page's monitor
        stage(f"PostgreSQL on 127.0.0.1:{pg_port} (data {pg_base}): the Prefect server's database and the metrics store")
    if args.no_cancellation_cleanup:
        os.environ["PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED"] = "false"
        stage("Prefect's cancellation-cleanup service is off in this run's server (--no-cancellation-cleanup)")
    if args.home:
        now = dt.datetime.fromisoformat((home / "bench-now.txt").read_text().strip())
        stage(f"reusing {home} (seeded at {now:%Y-%m-%d %H:%M} UTC)")
    else:
        now = dt.datetime.now(dt.timezone.utc)
        (home / "bench-now.txt").write_text(now.isoformat())
        (home / "bench-runs.txt").write_text(str(args.runs))
        (home / "bench-seed.json").write_text(json.dumps({"days": args.days, "database": args.database}))
        t0 = time.perf_counter()
        try:
            with local_prefect_server(home, port, db_url=db_url):
                objects = create_objects(api_url)
            summary = bulk_insert_runs(seed_url, objects, args.runs, now, days=args.days)
        except BaseException:  # a failed or interrupted seed stops PostgreSQL too
            databases.close()
            raise
        t_seed = time.perf_counter() - t0
        stage(f"seeded {args.runs} runs over {args.days} days in {t_seed:.1f} s on {args.database} "
              "(bulk insert through Prefect's ORM tables)")
        print(duration_figures(summary))
    server = contextlib.ExitStack()
    server.enter_context(databases)  # closed after the server
    try:
        server.enter_context(local_prefect_server(home, port, db_url=db_url))
    except BaseException:
        server.close()
        raise
    try:
        has_metrics = True if args.home else seed_metrics(summary)
        stage(f"metrics store: {'seeded' if has_metrics else 'not available, metric panels not timed'}")
        from prefect_launch.dashboard import view as V
        from prefect_launch.dashboard.api import get_api
        from prefect_launch.dashboard.metrics_source import metrics_store
        from prefect_launch.dashboard.spec import ViewSpec

        since, until = now - dt.timedelta(days=7), now + dt.timedelta(minutes=1)
        base = ViewSpec(since=since, until=until, grouping="job")
        # a filter change happens on the page some seconds later: its clock (10 s steps) moved on
        later = dict(since=since + dt.timedelta(seconds=10), until=until + dt.timedelta(seconds=10))
        changes = {
            "queue": ViewSpec(**later, grouping="job", queues=("gpu-a100",)),
            "owner": ViewSpec(**later, grouping="job", owners=("alice",)),
            "job": ViewSpec(**later, grouping="job", jobs=("train-llm",)),
            "preset": ViewSpec(**later, grouping="job", presets=("gpu-1",)),
            "status": ViewSpec(**later, grouping="job", statuses=("failed",)),
            "grouping": ViewSpec(**later, grouping="owner"),
        }

        cpu: dict[str, list[float]] = {}  # this process's CPU seconds per timed call, by what was timed

        def timed(fn, what: str = "") -> float:
            """Wall seconds of fn(); its CPU seconds (this process, all threads: the server's are not
            in it) go to ``cpu[what]`` - on a loaded box the wall time is an upper bound, the CPU time
            is what the page's process itself spends."""
            t, c = time.perf_counter(), time.process_time()
            fn()
            cpu.setdefault(what, []).append(time.process_time() - c)
            return time.perf_counter() - t

        # the run index is built once (what the page does in the background on first use)
        from prefect_launch.dashboard import index_sync

        store = metrics_store()
        t = time.perf_counter()
        kept_svc = index_sync.IndexService(index_sync.RunIndex(store), get_api(api_url))
        if args.home and kept_svc.covers(since):  # as the monitor asks (view.index_service)
            # a kept home's index (--home): synced, not rebuilt (a 1M build reads every run again, ~12-16 min)
            index_sync.sync(kept_svc.index, kept_svc.api)
            t_build = None
            stage(f"run index kept from {home} (covers the range), synced in {time.perf_counter() - t:.1f} s")
        else:
            built = index_sync.build(index_sync.RunIndex(store), get_api(api_url), days=8)
            t_build = time.perf_counter() - t
            stage(f"run index built in {t_build:.1f} s ({built.runs_read} runs read, one-off; kept in step by syncs afterwards)")

        if args.page_only:
            page = page_figures(home, args.page_repeat)
            stage("page timed" if page["page_cold_s"] else "page not timed")
            keys = ["runs", "cold_s", "filter_s", "naive_s", "speedup_cold", "speedup_filter", *(f"{k}_s" for k in changes),
                    "refresh_s", "index_build_s", "api_cold_s", "api_filter_s", "naive_extrapolated", "occupancy_s",
                    *page, "cold_cpu_s", "filter_cpu_s", "occupancy_cpu_s", "loadavg_start", "loadavg_end", "cpu_probe_s"]
            out = dict.fromkeys(keys)
            out.update(runs=args.runs, index_build_s=round(t_build, 1) if t_build is not None else None, **page, loadavg_start=load_start, loadavg_end=loadavg(),
                       cpu_probe_s=[probe_start, cpu_probe()], server_cancellation_cleanup=not args.no_cancellation_cleanup,
                       database=args.database, seed_days=args.days)
            if args.keep or args.home:
                print(f"kept {home} (its server stops now)")
            print(json.dumps(out))
            return

        def measure(source: str) -> tuple[list[float], dict[str, list[float]], list[float]]:
            """cold: every cache empty. filter change: from the default view just loaded (what the
            page's process holds), to a filter it has not seen; caches emptied before each pair."""
            colds: list[float] = []
            per: dict[str, list[float]] = {k: [] for k in changes}
            for _ in range(args.repeat):
                for kind, spec in changes.items():
                    V.clear_caches()
                    colds.append(timed(lambda: V.load_view(base, api_url=api_url, use_cache=True, source=source), f"{source} cold"))
                    time.sleep(index_sync.MIN_SYNC_S)  # a person takes longer than this: the change syncs the index first
                    what = f"{source} filter" if kind in ("queue", "owner") else f"{source} {kind}"
                    per[kind].append(timed(lambda: V.load_view(spec, api_url=api_url, use_cache=True, source=source), what))
            V.clear_caches()
            V.load_view(base, api_url=api_url, use_cache=True, source=source)
            refreshes = []
            for _ in range(args.repeat):
                time.sleep(index_sync.MIN_SYNC_S)  # the page re-syncs at most this often
                refreshes.append(timed(lambda: V.load_view(base, api_url=api_url, use_cache=True, source=source)))
            return colds, per, refreshes

        sources = [x for x in ("index", "api") if x in args.sources.split(",")]
        if "index" not in sources:
            sources.insert(0, "index")  # the JSON's figures are the index path's
        results = {}
        for source in sources:
            results[source] = measure(source)
            stage(f"{source} path timed")
        view = V.load_view(base, api_url=api_url, use_cache=False, source="index")
        in_range = int(view.totals["runs"])
        naives = []
        counted = 0
        for _ in range(args.naive_repeat):
            t = time.perf_counter()
            counted = naive_read(api_url, since, until, args.naive_max_runs)
            took = time.perf_counter() - t
            naives.append(took * in_range / counted if counted < in_range else took)
        extrapolated = counted < in_range
        stage(f"naive read: {counted} runs" + (f", extrapolated to the {in_range} in range" if extrapolated else ""))
        # the occupancy panels of the 7-day view (pure computation over the index's rows)
        occ_times, occ_cpu = [], []
        for _ in range(max(args.repeat, 3)):
            v = V.load_view(base, api_url=api_url, use_cache=True, source="index")
            occ_times.append(v.timings["occupancy"])
            occ_cpu.append(v.timings.get("occupancy_cpu", float("nan")))
        occupancy_s = statistics.median(occ_times)
        occupancy_cpu_s = statistics.median(occ_cpu)
        lanes = view.occupancy.lanes
        print(f"occupancy panels (7 days)  median {occupancy_s:.3f} s, CPU {occupancy_cpu_s:.3f} s  "
              f"({', '.join(f'{x:.3f}' for x in occ_times)}; "
              f"{view.occupancy.runs} runs overlap the range; Gantt: "
              + (f"{lanes['lane'].nunique()} lanes, {len(lanes)} segments)" if lanes is not None else "one bar per run)"))
        naive = statistics.median(naives)
        print(f"runs in range: {counted} (naive read{', stopped there' if extrapolated else ''}), {in_range} (index)")
        figures: dict = {}
        for source, (colds, per, refreshes) in results.items():
            med = {k: statistics.median(v) for k, v in per.items()}
            cold, filt = statistics.median(colds), statistics.median(per["queue"] + per["owner"])
            figures[source] = dict(cold=cold, filt=filt, med=med, refresh=statistics.median(refreshes))
            print(f"--- data layer from the {'run index' if source == 'index' else 'Prefect API (server-side aggregation)'}")
            print(f"cold load                  median {cold:.3f} s  ({', '.join(f'{x:.3f}' for x in colds)})")
            for kind, xs in per.items():
                what = "grouping change (to owner)" if kind == "grouping" else f"filter change (one {kind})"
                print(f"{what:26s} median {med[kind]:.3f} s  ({', '.join(f'{x:.3f}' for x in xs)})")
            print(f"filter change (queue and owner together)  median {filt:.3f} s")
            print(f"CPU of this process        cold median {statistics.median(cpu[source + ' cold']):.3f} s, "
                  f"filter change median {statistics.median(cpu[source + ' filter']):.3f} s")
            print(f"refresh (incremental)      median {figures[source]['refresh']:.3f} s")
        ours = figures["index"]
        api = figures.get("api")
        print(f"naive paging (stock client) median {naive:.3f} s  ({in_range / naive:.0f} runs/s"
              + (f"; extrapolated from {counted} runs)" if extrapolated else ")"))
        print(f"speedup: cold {naive / ours['cold']:.1f}x, filter change {naive / ours['filt']:.1f}x"
              + (f" (API-aggregation path: cold {naive / api['cold']:.1f}x, filter {naive / api['filt']:.1f}x)" if api else ""))
        page = page_figures(home, args.page_repeat) if not args.no_page else dict.fromkeys(
            ["page_cold_s", "page_warm_s", "page_return_s", "page_warm_laptop_s", "page_prepare_s", "page_floor_s", "page_floor_return_s",
             "page_floor_controls_s", "page_floor_controls_return_s", "page_warm_over_floor_s", "page_cold_over_floor_s",
             "page_server_cpu_cores"])
        stage("page timed" if page["page_cold_s"] else "page not timed")
        if args.keep or args.home:
            print(f"kept {home} (its server stops now)")
        if not page["page_cold_s"]:
            print("page drawn in Chromium     not timed (" + ("--no-page" if args.no_page else f"{CHROMIUM} or Playwright missing") + ")")
        print(
            json.dumps(
                dict(runs=args.runs, cold_s=round(ours["cold"], 3), filter_s=round(ours["filt"], 3), naive_s=round(naive, 3),
                     speedup_cold=round(naive / ours["cold"], 1), speedup_filter=round(naive / ours["filt"], 1),
                     **{f"{k}_s": round(v, 3) for k, v in ours["med"].items()}, refresh_s=round(ours["refresh"], 3),
                     index_build_s=round(t_build, 1) if t_build is not None else None, api_cold_s=round(api["cold"], 3) if api else None,
                     api_filter_s=round(api["filt"], 3) if api else None, naive_extrapolated=extrapolated,
                     occupancy_s=round(occupancy_s, 3), **page,
                     cold_cpu_s=round(statistics.median(cpu["index cold"]), 3),
                     filter_cpu_s=round(statistics.median(cpu["index filter"]), 3), occupancy_cpu_s=round(occupancy_cpu_s, 3),
                     loadavg_start=load_start, loadavg_end=loadavg(), cpu_probe_s=[probe_start, cpu_probe()],
                     server_cancellation_cleanup=not args.no_cancellation_cleanup,
                     database=args.database, seed_days=args.days)
            )
        )
    finally:
        server.close()
        if not args.keep and not args.home:
            import shutil

            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
