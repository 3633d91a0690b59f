"""The run-metrics store on SQLite and on a real PostgreSQL; block save/load; schema upgrade; retention."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone
from uuid import uuid4

import pytest
import sqlalchemy as sa

from fixtures_pg import pg_server, pg_url  # noqa: F401  (fixtures)
from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.metrics_engines import dispose_engines
from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary
from prefect_launch.blocks.metrics_store import RunMetricsStore, default_store_url

NOW = datetime.now(timezone.utc).replace(microsecond=0)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.server)])  # pg_url: a private PostgreSQL
def store(request, tmp_path) -> RunMetricsStore:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'metrics.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    return RunMetricsStore(url=url)


def _samples(fid: str, start: datetime, n: int, cpu=50.0, rss=1000, gpu=None) -> list[MetricSample]:
    return [
        MetricSample(
            flow_run_id=fid,
            ts=start + timedelta(seconds=i),
            interval_s=1.0,
            cpu_pct=cpu if not callable(cpu) else cpu(i),
            rss_bytes=rss + i,
            read_bytes=10,
            gpu_util_pct=gpu,
            num_procs=1,
        )
        for i in range(n)
    ]


def test_upsert_merges_and_reads_back(store):
    fid = str(uuid4())
    store.upsert_run(
        RunRecord(
            flow_run_id=fid, queue="gpu-a", job="train", flow="train-flow", owner="ana", preset="small",
            cpu=4, memory_bytes=8 << 30, gpu_indices=[1, 3], agent="w1",
            submitted_at=NOW - timedelta(seconds=30), started_at=NOW, extra={"tags": ["x"]},
        )
    )
    # a later upsert with only a new state keeps everything else
    store.upsert_run(RunRecord(flow_run_id=fid, state="RUNNING"))
    rec = store.get_run(fid)
    assert rec is not None
    assert (rec.queue, rec.job, rec.flow, rec.owner, rec.preset, rec.agent) == ("gpu-a", "train", "train-flow", "ana", "small", "w1")
    assert rec.cpu == 4 and rec.memory_bytes == 8 << 30
    assert rec.gpu == 2 and rec.gpu_indices == [1, 3]
    assert rec.started_at == NOW and rec.submitted_at == NOW - timedelta(seconds=30)
    assert rec.state == "RUNNING" and rec.extra == {"tags": ["x"]}
    assert store.get_run(str(uuid4())) is None


def test_samples_series_idempotent_and_downsampled(store):
    fid = str(uuid4())
    store.upsert_run(RunRecord(flow_run_id=fid, queue="q"))
    batch = _samples(fid, NOW, 120, cpu=lambda i: float(i % 10 * 10))
    assert store.record_samples(batch[:70]) == 70
    # retrying an overlapping batch stores no duplicates
    store.record_samples(batch[60:])
    pts = store.series(fid)
    assert len(pts) == 120
    assert pts[0]["ts"] == NOW and pts[-1]["ts"] == NOW + timedelta(seconds=119)
    assert [p["cpu_pct"] for p in pts[:3]] == [0.0, 10.0, 20.0]
    assert pts[5]["rss_bytes"] == 1005 and pts[5]["interval_s"] == 1.0
    # time window
    win = store.series(fid, since=NOW + timedelta(seconds=10), until=NOW + timedelta(seconds=20))
    assert len(win) == 10
    # downsampled in SQL: buckets of the mean cpu, max rss, summed I/O
    small = store.series(fid, max_points=12)
    assert 10 <= len(small) <= 13
    assert sum(p["read_bytes"] for p in small) == 120 * 10
    assert max(p["rss_bytes"] for p in small) == 1000 + 119
    assert abs(sum(p["cpu_pct"] * p["interval_s"] for p in small) / 120 - 45.0) < 1e-6
    # unknown run: empty; a sample for an unknown run creates a stub run
    assert store.series(str(uuid4())) == []
    other = str(uuid4())
    store.record_samples(_samples(other, NOW, 3))
    assert store.get_run(other) is not None and len(store.series(other)) == 3
    # several runs at once
    both = store.series([fid, other], since=NOW, until=NOW + timedelta(seconds=2))
    assert {p["flow_run_id"] for p in both} == {fid, other} and len(both) == 4


def test_summaries_filters_and_summary_round_trip(store):
    q = "q-" + uuid4().hex[:6]
    done, busy, elsewhere, old = (str(uuid4()) for _ in range(4))
    store.upsert_run(RunRecord(flow_run_id=done, queue=q, job="j", cpu=2, gpu=1, memory_bytes=4 << 30,
                               submitted_at=NOW - timedelta(seconds=100), started_at=NOW - timedelta(seconds=90)))
    store.write_summary(done, RunSummary(
        duration_s=60, queue_s=10, cpu_seconds=60, avg_cpu_pct=100, avg_gpu_util_pct=5.0, peak_rss_bytes=1 << 30,
        ended_at=NOW - timedelta(seconds=30), exit_state="COMPLETED", wasteful=True,
        waste_reasons=["gpu_idle: 1 GPU allocated, average utilisation 5.0% < 10%"],
    ))
    store.upsert_run(RunRecord(flow_run_id=busy, queue=q, cpu=1, submitted_at=NOW - timedelta(seconds=25),
                               started_at=NOW - timedelta(seconds=20), state="RUNNING"))
    store.upsert_run(RunRecord(flow_run_id=elsewhere, queue="other", started_at=NOW))
    store.upsert_run(RunRecord(flow_run_id=old, queue=q, started_at=NOW - timedelta(days=3),
                               ended_at=NOW - timedelta(days=3) + timedelta(minutes=5), state="FAILED"))

    rows = store.summaries(queue=q)
    assert [r["flow_run_id"] for r in rows] == [busy, done, old]  # newest start first
    by = {r["flow_run_id"]: r for r in rows}
    d = by[done]
    assert d["has_summary"] and d["exit_state"] == "COMPLETED" and d["state"] == "COMPLETED"
    assert d["wasteful"] is True and d["waste_reasons"][0].startswith("gpu_idle")
    assert d["ended_at"] == NOW - timedelta(seconds=30) and d["duration_s"] == 60 and d["job"] == "j"
    assert by[busy]["has_summary"] is False and by[busy]["queue_s"] == 5.0 and by[busy]["wasteful"] is None
    # window overlap: the 3-day-old run ended before `since`
    recent = store.summaries(queue=q, since=NOW - timedelta(hours=1), until=NOW + timedelta(hours=1))
    assert {r["flow_run_id"] for r in recent} == {done, busy}
    assert [r["flow_run_id"] for r in store.summaries(flow_run_ids=[elsewhere])] == [elsewhere]
    assert len(store.summaries(queue=[q, "other"])) == 4
    # summary model round trip
    s = store.get_summary(done)
    assert s.allocated_gpus == 1 and s.allocated_cpus == 2 and s.wasteful and s.exit_state == "COMPLETED"
    assert store.get_summary(busy) is None


def test_purge_retention(store):
    q = "q-" + uuid4().hex[:6]
    old, fresh, forgotten = str(uuid4()), str(uuid4()), str(uuid4())
    store.upsert_run(RunRecord(flow_run_id=old, queue=q, started_at=NOW - timedelta(days=40),
                               ended_at=NOW - timedelta(days=39)))
    store.record_samples(_samples(old, NOW - timedelta(days=40), 5))
    store.write_summary(old, RunSummary(duration_s=5, exit_state="COMPLETED", ended_at=NOW - timedelta(days=39)))
    store.upsert_run(RunRecord(flow_run_id=fresh, queue=q, started_at=NOW - timedelta(days=2),
                               ended_at=NOW - timedelta(days=1)))
    store.record_samples(_samples(fresh, NOW - timedelta(days=2), 5))
    # never ended, last seen 50 days ago
    store.upsert_run(RunRecord(flow_run_id=forgotten, queue=q, started_at=NOW - timedelta(days=50)))
    assert store.purge(30) == 2
    assert store.get_run(old) is None and store.get_run(forgotten) is None
    assert store.series(old) == [] and store.get_summary(old) is None
    assert len(store.series(fresh)) == 5
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(S.summaries)).scalar() == 0
    # default = the block's retention_days
    short = store.model_copy(update={"retention_days": 0})
    assert short.purge() == 1 and store.get_run(fresh) is None
    assert store.model_copy(update={"retention_days": None}).purge() == 0


def _make_v1(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        S.ensure_schema(conn, target=1)
    engine.dispose()


@pytest.mark.server  # its PostgreSQL half (pg_url)
def test_schema_upgrade_from_v1_keeps_data(request, tmp_path):
    for kind in ("sqlite", "postgresql"):
        url = f"sqlite:///{tmp_path / 'old.db'}" if kind == "sqlite" else request.getfixturevalue("pg_url")
        _make_v1(url)
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            assert S.current_version(conn) == 1
            cols = {c["name"] for c in sa.inspect(conn).get_columns("launch_samples")}
            assert "num_procs" not in cols and not sa.inspect(conn).has_table("launch_summaries")
            conn.execute(sa.text(
                "INSERT INTO launch_runs (flow_run_id, queue, alloc_cpus, started_ms) VALUES ('old-run', 'q1', 2, :t)"
            ), {"t": int(NOW.timestamp() * 1000)})
            rid = conn.execute(sa.text("SELECT id FROM launch_runs WHERE flow_run_id='old-run'")).scalar()
            conn.execute(sa.text(
                "INSERT INTO launch_samples (run_id, ts_ms, interval_ms, cpu_pct, rss_bytes) VALUES (:r, :t, 1000, 77.5, 123)"
            ), {"r": rid, "t": int(NOW.timestamp() * 1000)})
        engine.dispose()

        store = RunMetricsStore(url=url)
        assert store.schema_version() == S.SCHEMA_VERSION == 10
        with store._read() as conn:  # v3: the monitor's run index tables exist on the upgraded database
            assert sa.inspect(conn).has_table("launch_run_index") and sa.inspect(conn).has_table("launch_index_meta")
            # v8: the index's meta is keyed by the Prefect server's identity
            assert "server_id" in {c["name"] for c in sa.inspect(conn).get_columns("launch_index_meta")}
        rec = store.get_run("old-run")
        assert rec.queue == "q1" and rec.cpu == 2 and rec.started_at == NOW
        pts = store.series("old-run")
        assert len(pts) == 1 and pts[0]["cpu_pct"] == 77.5 and pts[0]["rss_bytes"] == 123 and pts[0]["num_procs"] is None
        # the v2 columns and table work on the upgraded database
        store.record_samples([MetricSample(flow_run_id="old-run", ts=NOW + timedelta(seconds=1), num_procs=3, net_rx_bytes=9)])
        store.write_summary("old-run", RunSummary(duration_s=1, exit_state="COMPLETED"))
        assert store.series("old-run")[1]["num_procs"] == 3
        assert store.summaries(flow_run_ids=["old-run"])[0]["has_summary"]
        with store._read() as conn:  # v7: the row carries its last change's stamp, indexed for readers of changes
            stamp = conn.execute(sa.text("SELECT updated_ms FROM launch_runs WHERE flow_run_id='old-run'")).scalar()
            assert stamp >= int(NOW.timestamp() * 1000)
            assert "ix_launch_runs_updated" in {ix["name"] for ix in sa.inspect(conn).get_indexes("launch_runs")}
        # opening again (fresh engine) is a no-op
        dispose_engines()
        assert RunMetricsStore(url=url).schema_version() == S.SCHEMA_VERSION
        assert len(RunMetricsStore(url=url).series("old-run")) == 2


def test_sqlite_concurrent_writers(tmp_path):
    """Many sampler threads writing at once: no 'database is locked'."""
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'c.db'}")
    errors: list[Exception] = []

    def writer(k: int) -> None:
        fid = f"run-{k}"
        try:
            store.upsert_run(RunRecord(flow_run_id=fid, queue="q"))
            for j in range(10):
                store.record_samples(_samples(fid, NOW + timedelta(seconds=10 * j), 10))
        except Exception as exc:  # pragma: no cover - the assertion reports it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(len(store.series(f"run-{k}")) == 100 for k in range(8))


def test_block_save_load_by_name(prefect_server, unique_name, tmp_path):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    # settings were read when prefect was imported; point them at the session's server
    with temporary_settings(updates={PREFECT_API_URL: prefect_server, PREFECT_HOME: str(tmp_path / "home")}):
        url = f"sqlite:///{tmp_path / 'blk.db'}"
        name = f"metrics-{unique_name}"
        RunMetricsStore(url=url, retention_days=7, password="s3cret").save(name)
        loaded = RunMetricsStore.load(name)
        assert loaded.url == url and loaded.retention_days == 7
        assert loaded.password.get_secret_value() == "s3cret"
        loaded.upsert_run(RunRecord(flow_run_id="blk-run", queue="q"))
        assert RunMetricsStore.load(name).get_run("blk-run").queue == "q"
        # it is the session's server that holds it
        import httpx

        r = httpx.post(f"{prefect_server}/block_documents/filter", json={"block_documents": {"name": {"any_": [name]}}})
        assert r.status_code == 200 and [d["name"] for d in r.json()] == [name]
        # default store: SQLite beside the Prefect DB under PREFECT_HOME
        assert default_store_url() == f"sqlite:///{tmp_path / 'home' / 'launch-metrics.db'}"
        RunMetricsStore().save(f"default-{unique_name}")
        again = RunMetricsStore.load(f"default-{unique_name}")
        assert again.url is None
        again.upsert_run(RunRecord(flow_run_id="d", queue="q"))
        assert (tmp_path / "home" / "launch-metrics.db").exists()


def test_waste_reasons_stored_as_json(tmp_path):
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'w.db'}")
    store.write_summary("r", RunSummary(wasteful=True, waste_reasons=["a: b", "c: d"]))
    with store.engine.connect() as conn:
        raw = conn.execute(sa.select(S.summaries.c.waste_reasons)).scalar()
    assert json.loads(raw) == ["a: b", "c: d"]


def test_newest_runs_are_read_through_the_start_index(store):
    """summaries() lists runs newest start first (started, else submitted, else created); v6 indexes
    that expression, alone and after the queue, so the database walks an index instead of sorting
    every run of the range (the monitor asks on every view). The plan is checked on SQLite."""
    import sqlalchemy as sa

    now = datetime.now(timezone.utc).replace(microsecond=0)
    for i in range(30):
        store.upsert_run(RunRecord(flow_run_id=f"ix-{i}", queue=f"q{i % 3}", started_at=now - timedelta(minutes=i)))
    store.upsert_run(RunRecord(flow_run_id="ix-waiting", queue="q0", submitted_at=now + timedelta(minutes=1)))
    assert [r["flow_run_id"] for r in store.summaries(since=now - timedelta(hours=1), limit=3)] == ["ix-waiting", "ix-0", "ix-1"]
    assert [r["flow_run_id"] for r in store.summaries(queue="q1", limit=2)] == ["ix-1", "ix-4"]
    seen: list[tuple] = []

    def capture(conn, cursor, statement, parameters, context, executemany):
        if "launch_summaries" in statement and "ORDER BY" in statement:
            seen.append((statement, parameters))

    with store._read() as conn:
        sqlite = conn.dialect.name == "sqlite"
        names = set(conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type='index' AND tbl_name='launch_runs'" if sqlite else
            "SELECT indexname FROM pg_indexes WHERE tablename='launch_runs'").scalars())
        assert {"ix_launch_runs_newest", "ix_launch_runs_queue_newest"} <= names
        engine = conn.engine
    if engine.dialect.name != "sqlite":
        return
    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        store.summaries(since=now - timedelta(hours=1), limit=3)
        store.summaries(queue="q1", since=now - timedelta(hours=1), limit=2)
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)
    assert len(seen) == 2
    with store._read() as conn:
        for (statement, params), index in zip(seen, ("ix_launch_runs_newest", "ix_launch_runs_queue_newest")):
            plan = " ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params))
            assert index in plan and "TEMP B-TREE FOR ORDER BY" not in plan, plan
