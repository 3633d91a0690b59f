"""Benchmark the queue monitor's data layer against the naive way of reading runs.

    python bench/dashboard.py                 # 10k runs over 7 days
    python bench/dashboard.py --runs 100000   # the target size

It starts its own Prefect server (SQLite, throw-away PREFECT_HOME), creates pools,
queues, a flow and deployments through the API, then stops the server and bulk-inserts
N flow runs (with their current state rows) straight into the server's own tables
through Prefect's ORM table definitions - thousands of times faster than creating them
through the API - and starts the server again. Metrics are written to the run metrics
store when `prefect_launch.blocks.metrics_store` is importable.

The run index (the monitor's copy of the runs' filter columns, in the metrics store)
is built once after seeding and its build time printed; then the data layer is timed
from the index (what the page uses once the index covers the range) and, for
comparison, from Prefect's API alone (server-side aggregation per group). Timed, each
several times (medians printed):
- cold load: the dashboard's data layer for the default view (all queues, last 7 days)
  with empty caches;
- filter change: from the default view just loaded (its caches held, as the page's
  process holds them) to a view it has not seen, 10 s later on the page's clock (and
  after a real pause long enough that the index syncs with the server first): one
  queue, one owner, one job, one preset, one status, and grouping by owner. filter_s is
  the median over the queue and owner changes; each kind is printed (and in the JSON as
  <kind>_s);
- naive: page through every flow run in the range with the Prefect client (200 per
  request, the API's cap) - what a dashboard without server-side aggregation does.

The last line printed is one JSON object: runs, cold_s, filter_s, naive_s, speedup_cold (the
index path), and queue_s, owner_s, job_s, preset_s, status_s, grouping_s, refresh_s,
index_build_s, api_cold_s, api_filter_s (the API-only path), occupancy_s (the occupancy panels of
the 7-day view, computed from the index's rows), and page_cold_s, page_warm_s: what a person waits
for, from navigation to a fully drawn page (every panel there, every chart drawn, the script done)
in headless Chromium through Playwright - cold: the first visit after `streamlit run` started
(its caches empty, the run index already built); warm: a new visit (new session) right after
(null where Chromium or Playwright is missing, or with --no-page).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path


from prefect_launch.local_server import background_process, free_port, local_prefect_server, wait_healthy

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


def bulk_insert_runs(db_path: Path, objects: dict, n: int, now: dt.datetime, seed: int = 7) -> list[dict]:
    """Insert n flow runs with one current-state row each into the server's SQLite DB."""
    import sqlalchemy as sa
    from prefect.server.database import orm_models
    from prefect.server.schemas.states import StateType

    rng = random.Random(seed)
    start = now - dt.timedelta(days=7)
    span = (now - start).total_seconds()
    runs, states, summary = [], [], []
    while len(runs) < n:
        exp = start + dt.timedelta(seconds=rng.random() * span)
        if rng.random() > _load_shape(exp) / 1.4:
            continue
        pool = rng.choice(POOLS)[0]
        job = rng.choice(JOBS)
        owner = rng.choice(OWNERS)
        preset = rng.choice(list(PRESETS))
        prio = rng.choice(PRIORITIES)
        queued = rng.expovariate(1 / 90.0)
        duration = rng.lognormvariate(6.0, 1.0)
        st_start = exp + dt.timedelta(seconds=queued)
        st_end = st_start + dt.timedelta(seconds=duration)
        roll = rng.random()
        message = None
        if st_start > now:
            stype, sname, st_start, st_end = StateType.SCHEDULED, "Scheduled", None, None
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
        jv = {"preset": preset, **PRESETS[preset]}
        runs.append(
            dict(
                id=rid, created=exp, updated=ts, name=f"{job}-{rid.hex[:8]}", flow_id=uuid.UUID(objects["flow_id"]),
                deployment_id=uuid.UUID(objects["deployments"][(job, pool)]), work_queue_name=prio,
                work_queue_id=uuid.UUID(objects["pools"][pool]["queues"][prio]), state_type=stype, state_name=sname,
                state_timestamp=ts, state_id=sid, expected_start_time=exp, start_time=st_start, end_time=st_end,
                total_run_time=total, run_count=1 if st_start else 0,
                tags=["launch", f"owner:{owner}", f"preset:{preset}"], job_variables=jv, labels={},
            )
        )
        states.append(dict(id=sid, flow_run_id=rid, type=stype, name=sname, timestamp=ts, message=message, created=ts, updated=ts))
        summary.append(dict(id=str(rid), pool=pool, job=job, owner=owner, preset=preset, start=st_start, end=st_end, duration=duration))
    engine = sa.create_engine(f"sqlite:///{db_path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
        for i in range(0, n, 5000):
            conn.execute(sa.insert(orm_models.FlowRun.__table__), runs[i : i + 5000])
            conn.execute(sa.insert(orm_models.FlowRunState.__table__), states[i : i + 5000])
    engine.dispose()
    return summary


def seed_metrics(summary: list[dict], seed: int = 11) -> bool:
    """Write per-run records and summaries into the run metrics store (default URL under
    PREFECT_HOME), in bulk through the store's own table definitions."""
    try:
        from prefect_launch.blocks import metrics_schema as S
        from prefect_launch.blocks.metrics_store import RunMetricsStore, to_ms
    except Exception:
        return False
    rng = random.Random(seed)
    store = RunMetricsStore()
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


def naive_read(api_url: str, since: dt.datetime, until: dt.datetime) -> int:
    """Page through every run in the range with the client, 200 at a time (the API's cap).

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
            if len(page) < 200 or not new:
                return len(seen)
            before = page[-1].expected_start_time


print = functools.partial(print, flush=True)  # noqa: A001  (progress shows up when piped)


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DRAWN_JS = """() => !!document.querySelector('.st-key-panel-links')
    && !document.querySelector('[data-testid="stStatusWidget"]')
    && document.querySelectorAll('.vega-embed').length >= 9
    && [...document.querySelectorAll('.vega-embed')].every(e => e.querySelector('canvas, svg'))"""


def page_times(home: Path, repeat: int = 2) -> tuple[list[float], list[float]]:
    """(cold, warm) seconds from navigation to a fully drawn page in headless Chromium, one fresh
    `streamlit run` per repeat; ([], []) without Chromium or Playwright."""
    if not Path(CHROMIUM).exists():
        return [], []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return [], []
    colds: list[float] = []
    warms: list[float] = []
    for k in range(repeat):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"), "--server.port", str(port),
                "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
                "--server.fileWatcherType", "none"]
        log = home / f"streamlit-{k}.log"
        with background_process(args, log, cwd=ROOT) as proc:
            wait_healthy(url, proc, timeout=120, log=log, health_path="/_stcore/health", what="streamlit")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                try:
                    for out in (colds, warms):
                        page = browser.new_page(viewport={"width": 1600, "height": 7000})
                        t = time.perf_counter()
                        page.goto(url, wait_until="commit")
                        page.wait_for_function(DRAWN_JS, timeout=300_000, polling=50)
                        out.append(time.perf_counter() - t)
                        page.close()
                finally:
                    browser.close()
    return colds, warms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--naive-repeat", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the server's PREFECT_HOME")
    ap.add_argument("--page-repeat", type=int, default=2, help="fresh `streamlit run`s timed in the browser")
    ap.add_argument("--no-page", action="store_true", help="skip the browser timing (page_cold_s, page_warm_s)")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    port = free_port()  # the same port for both server starts
    api_url = f"http://127.0.0.1:{port}/api"
    os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    now = dt.datetime.now(dt.timezone.utc)

    t0 = time.perf_counter()
    with local_prefect_server(home, port):
        objects = create_objects(api_url)
    summary = bulk_insert_runs(home / "prefect.db", objects, args.runs, now)
    t_seed = time.perf_counter() - t0
    print(f"seeded {args.runs} runs over 7 days in {t_seed:.1f} s (bulk insert through Prefect's ORM tables)")
    server = contextlib.ExitStack()
    server.enter_context(local_prefect_server(home, port))
    try:
        has_metrics = seed_metrics(summary)
        print(f"metrics store: {'seeded' if has_metrics else 'not available, metric panels not timed'}")
        from prefect_launch.dashboard import data

        since, until = now - dt.timedelta(days=7), now + dt.timedelta(minutes=1)
        base = data.ViewSpec(since=since, until=until, grouping="job")
        # a filter change happens on the page some seconds later: its clock (10 s steps) moved on
        later = dict(since=since + dt.timedelta(seconds=10), until=until + dt.timedelta(seconds=10))
        changes = {
            "queue": data.ViewSpec(**later, grouping="job", queues=("gpu-a100",)),
            "owner": data.ViewSpec(**later, grouping="job", owners=("alice",)),
            "job": data.ViewSpec(**later, grouping="job", jobs=("train-llm",)),
            "preset": data.ViewSpec(**later, grouping="job", presets=("gpu-1",)),
            "status": data.ViewSpec(**later, grouping="job", statuses=("failed",)),
            "grouping": data.ViewSpec(**later, grouping="owner"),
        }

        def timed(fn) -> float:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

        # the run index is built once (what the page does in the background on first use)
        from prefect_launch.dashboard import index_sync

        store = data.metrics_store()
        t = time.perf_counter()
        built = index_sync.build(index_sync.RunIndex(store), data.get_api(api_url), days=8)
        t_build = time.perf_counter() - t
        print(f"run index built in {t_build:.1f} s ({built.runs_read} runs read, one-off; kept in step by syncs afterwards)")

        def measure(source: str) -> tuple[list[float], dict[str, list[float]], list[float]]:
            """cold: every cache empty. filter change: from the default view just loaded (what the
            page's process holds), to a filter it has not seen; caches emptied before each pair."""
            colds: list[float] = []
            per: dict[str, list[float]] = {k: [] for k in changes}
            for _ in range(args.repeat):
                for kind, spec in changes.items():
                    data.clear_caches()
                    colds.append(timed(lambda: data.load_view(base, api_url=api_url, use_cache=True, source=source)))
                    time.sleep(index_sync.MIN_SYNC_S)  # a person takes longer than this: the change syncs the index first
                    per[kind].append(timed(lambda: data.load_view(spec, api_url=api_url, use_cache=True, source=source)))
            data.clear_caches()
            data.load_view(base, api_url=api_url, use_cache=True, source=source)
            refreshes = []
            for _ in range(args.repeat):
                time.sleep(index_sync.MIN_SYNC_S)  # the page re-syncs at most this often
                refreshes.append(timed(lambda: data.load_view(base, api_url=api_url, use_cache=True, source=source)))
            return colds, per, refreshes

        results = {source: measure(source) for source in ("index", "api")}
        naives = []
        counted = 0
        for _ in range(args.naive_repeat):
            t = time.perf_counter()
            counted = naive_read(api_url, since, until)
            naives.append(time.perf_counter() - t)
        view = data.load_view(base, api_url=api_url, use_cache=False, source="index")
        # the occupancy panels of the 7-day view (pure computation over the index's rows)
        occ_times = [data.load_view(base, api_url=api_url, use_cache=True, source="index").timings["occupancy"]
                     for _ in range(max(args.repeat, 3))]
        occupancy_s = statistics.median(occ_times)
        print(f"occupancy panels (7 days)  median {occupancy_s:.3f} s  ({', '.join(f'{x:.3f}' for x in occ_times)}; "
              f"{view.occupancy.runs} runs overlap the range)")
        naive = statistics.median(naives)
        print(f"runs in range: {counted} (naive read), {int(view.totals['runs'])} (index)")
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
            print(f"refresh (incremental)      median {figures[source]['refresh']:.3f} s")
        ours = figures["index"]
        print(f"naive paging (stock client) median {naive:.3f} s  ({counted / naive:.0f} runs/s)")
        print(f"speedup: cold {naive / ours['cold']:.1f}x, filter change {naive / ours['filt']:.1f}x "
              f"(API-aggregation path: cold {naive / figures['api']['cold']:.1f}x, filter {naive / figures['api']['filt']:.1f}x)")
        page_cold, page_warm = page_times(home, args.page_repeat) if not args.no_page else ([], [])
        page_cold_s = round(statistics.median(page_cold), 3) if page_cold else None
        page_warm_s = round(statistics.median(page_warm), 3) if page_warm else None
        if page_cold:
            print(f"page drawn in Chromium     cold median {page_cold_s:.3f} s ({', '.join(f'{x:.3f}' for x in page_cold)}), "
                  f"warm median {page_warm_s:.3f} s ({', '.join(f'{x:.3f}' for x in page_warm)})")
        else:
            print("page drawn in Chromium     not timed (" + ("--no-page" if args.no_page else f"{CHROMIUM} or Playwright missing") + ")")
        print(
            json.dumps(
                dict(runs=args.runs, cold_s=round(ours["cold"], 3), filter_s=round(ours["filt"], 3), naive_s=round(naive, 3),
                     speedup_cold=round(naive / ours["cold"], 1), speedup_filter=round(naive / ours["filt"], 1),
                     **{f"{k}_s": round(v, 3) for k, v in ours["med"].items()}, refresh_s=round(ours["refresh"], 3),
                     index_build_s=round(t_build, 1), api_cold_s=round(figures["api"]["cold"], 3),
                     api_filter_s=round(figures["api"]["filt"], 3), occupancy_s=round(occupancy_s, 3),
                     page_cold_s=page_cold_s, page_warm_s=page_warm_s)
            )
        )
    finally:
        server.close()
        if not args.keep:
            import shutil

            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"kept {home} (api {api_url} is stopped)", file=sys.stderr)


if __name__ == "__main__":
    main()
