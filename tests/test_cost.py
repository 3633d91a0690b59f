"""Cost and waste against the samples a real agent wrote for real runs.

A real server, a real agent (its own process) and real job processes; the only fake is
NVML, given to the agent through ``LAUNCH_FAKE_NVML``: two GPUs at 80 % and 20 %
utilisation drawing 300 W and 100 W, whose energy counters advance with the time that
really passes. Expected figures are worked out here from the stored samples with plain
loops (and, for energy and utilisation, from what the fake devices were told to do).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import time
from pathlib import Path

import pandas as pd
import pytest
import sqlalchemy as sa

from launch_helpers import agent, apply_queue, cli, read_runs, restored_env
from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.metrics_engines import dispose_engines
from prefect_launch.blocks.metrics_records import MetricSample, RunRecord
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.dashboard import cost as C

UTC = dt.timezone.utc
HERE = Path(__file__).resolve().parent
UTIL = {0: 80.0, 1: 20.0}
POWER_W = {0: 300.0, 1: 100.0}
FAKE = {"gpus": [{"name": "Fake H100", "memory_total": 80 << 30}, {"name": "Fake H100", "memory_total": 80 << 30}],
        "util": {str(k): v for k, v in UTIL.items()}, "power_w": {str(k): v for k, v in POWER_W.items()}}
PRESETS = {"gpu1": {"cpu": 1, "memory": "512Mi", "gpu": 1}, "gpu2": {"cpu": 1, "memory": "512Mi", "gpu": 2},
           "cpu2": {"cpu": 2, "memory": "1Gi", "gpu": 0}}
RAPL_READABLE = os.path.exists("/sys/class/powercap/intel-rapl:0/energy_uj") and os.access(
    "/sys/class/powercap/intel-rapl:0/energy_uj", os.R_OK)


def _submit(ref: str, queue: str, preset: str, owner: str, params: dict) -> str:
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit

    with get_client(sync_client=True) as client:
        return submit(client, SubmitRequest(job=ref, queue=queue, preset=preset, owner=owner, params=params)).run_ids[0]


@pytest.fixture(scope="module")
def ran(tmp_path_factory, prefect_server):
    """Three runs measured by a real agent with a fake NVML: (store, ids, since, until)."""
    from prefect import flow

    tmp = tmp_path_factory.mktemp("cost")
    tag = os.urandom(3).hex()
    store = RunMetricsStore(url=f"sqlite:///{tmp / 'cost-metrics.db'}")
    block = f"cost-{tag}"
    store.save(block)
    env = {"LAUNCH_FAKE_NVML": json.dumps(FAKE), "LAUNCH_METRICS_BLOCK": block, "LAUNCH_SAMPLE_INTERVAL": "0.5"}
    with restored_env(*env, "LAUNCH_METRICS_URL"):
        os.environ.update(env)
        os.environ.pop("LAUNCH_METRICS_URL", None)
        q = apply_queue(tmp, {"name": f"cost-{tag}", "presets": PRESETS, "default_preset": "cpu2"})
        flow.from_source(source=str(HERE), entrypoint="cost_job.py:cost_job").deploy(
            name=f"cost-{tag}", work_pool_name=q, work_queue_name="medium", build=False, push=False,
            print_next_steps=False)
        ref = f"cost-job/cost-{tag}"
        since = dt.datetime.now(UTC) - dt.timedelta(seconds=5)
        ids = {
            "alice_gpu1": _submit(ref, q, "gpu1", "alice", dict(seconds=3, burn=True)),
            "bob_gpu2": _submit(ref, q, "gpu2", "bob", dict(seconds=3, burn=False)),
            "alice_cpu2": _submit(ref, q, "cpu2", "alice", dict(seconds=3, burn=True, mib=64)),
        }
        with agent([q], f"cost-{tag}", "cpu=4,memory=4Gi,gpu=2", tmp):
            deadline = time.time() + 180
            while time.time() < deadline:
                runs = read_runs(list(ids.values()))
                if all(r.state.is_final() for r in runs):
                    break
                time.sleep(1)
            else:
                raise AssertionError({str(r.id): r.state_name for r in runs})
            assert all(r.state.is_completed() for r in runs), {str(r.id): r.state_name for r in runs}
            deadline = time.time() + 30  # the summary is written as the agent releases the run
            while time.time() < deadline and not all(store.get_summary(i) for i in ids.values()):
                time.sleep(0.5)
            until = dt.datetime.now(UTC) + dt.timedelta(seconds=5)
            # the agent stays online: the page's capacity figures are against what it publishes
            yield dict(store=store, ids=ids, since=since, until=until, queue=q, job=f"cost-{tag}")


def _expected(store: RunMetricsStore, fid: str, lo: dt.datetime | None = None) -> dict:
    """A run's figures worked out from its stored samples (those at or after ``lo``)."""
    rec, summ = store.get_run(fid), store.get_summary(fid)
    pts = [p for p in store.series(fid) if lo is None or p["ts"] >= lo]
    gpus = rec.gpu or 0
    start = max(rec.started_at, lo) if lo else rec.started_at
    held_h = (rec.ended_at - start).total_seconds() / 3600
    energy = [p["gpu_energy_j"] for p in pts if p["gpu_energy_j"] is not None]
    rss = [p["rss_bytes"] for p in pts if p["rss_bytes"] is not None]
    return dict(
        rec=rec, pts=pts, gpu_alloc_h=gpus * held_h, cpu_alloc_h=rec.cpu * held_h,
        gpu_used_h=sum(gpus * p["gpu_util_pct"] / 100 * p["interval_s"] for p in pts) / 3600 if gpus else None,
        cpu_used_h=sum(p["cpu_pct"] / 100 * p["interval_s"] for p in pts) / 3600,
        gpu_energy_wh=sum(energy) / 3600 if energy else None,
        # the agent also reads the kernel's high-water mark (a spike between two samples): the summary's
        # peak is that, never below the samples' max
        peak_memory_gib=max(rss) / 2**30, peak_summary_gib=(summ.peak_rss_bytes / 2**30 if summ and summ.peak_rss_bytes else None),
        mean_memory_gib=sum(rss) / len(rss) / 2**30,
        sampled_s=sum(p["interval_s"] for p in pts),
    )


def _close(a, b, rel=1e-6):
    return a == pytest.approx(b, rel=rel, abs=1e-9)


def test_per_run_costs_equal_the_stored_samples(ran):
    store, ids = ran["store"], ran["ids"]
    df = C.run_costs(store, ran["since"], ran["until"], queues=[ran["queue"]]).set_index("id")
    assert set(df.index) == set(ids.values())
    for kind, fid in ids.items():
        e, row = _expected(store, fid), df.loc[fid]
        assert len(e["pts"]) >= 4, (kind, len(e["pts"]))
        assert row["source"] == "summary" and row["samples"] == len(e["pts"])  # whole run in range: its summary
        for k in ("gpu_alloc_h", "cpu_alloc_h", "cpu_used_h"):
            assert _close(row[k], e[k]), (kind, k, row[k], e[k])
        assert e["peak_summary_gib"] is not None and e["peak_summary_gib"] >= e["peak_memory_gib"] * (1 - 1e-9), kind
        assert _close(row["peak_memory_gib"], e["peak_summary_gib"]), (kind, row["peak_memory_gib"], e)
        assert _close(row["mean_memory_gib"], e["mean_memory_gib"], rel=1e-3)
        if kind == "alice_cpu2":
            assert row["gpus"] == 0 and row["gpu_alloc_h"] == 0 and row["gpu_used_h"] != row["gpu_used_h"]  # NaN
            assert pd.isna(row["gpu_energy_source"])
            assert 0 < row["cpu_used_h"] < row["cpu_alloc_h"]  # one core busy at most, of two held
        else:
            assert _close(row["gpu_used_h"], e["gpu_used_h"]) and _close(row["gpu_energy_wh"], e["gpu_energy_wh"])
            assert row["gpu_energy_source"] == "nvml energy counter"
        if RAPL_READABLE:
            assert row["cpu_energy_wh"] > 0 and row["cpu_energy_source"].startswith("rapl")
        else:  # this machine: no readable RAPL -> unavailable, and why
            assert row["cpu_energy_wh"] != row["cpu_energy_wh"] and row["cpu_energy_source"].startswith("unavailable")


def test_gpu_use_and_energy_follow_the_devices(ran):
    """Utilisation and energy per run are those of the GPUs the agent gave it."""
    store, ids = ran["store"], ran["ids"]
    for kind in ("alice_gpu1", "bob_gpu2"):
        e = _expected(store, ids[kind])
        idx = e["rec"].gpu_indices
        assert len(idx) == (1 if kind == "alice_gpu1" else 2)
        util = sum(UTIL[i] for i in idx) / len(idx)
        assert all(p["gpu_util_pct"] == pytest.approx(util) for p in e["pts"])
        watts = sum(POWER_W[i] for i in idx)
        # the counters advanced by the devices' power over the time that passed between two samples
        assert e["gpu_energy_wh"] * 3600 == pytest.approx(watts * e["sampled_s"], rel=0.05)
        assert e["gpu_used_h"] / e["gpu_alloc_h"] == pytest.approx(util / 100, rel=0.25)
        assert e["gpu_used_h"] / e["gpu_alloc_h"] <= util / 100 + 1e-9
        assert store.get_run(ids[kind]).extra["gpu_energy"] == "nvml energy counter"


def test_a_range_that_cuts_a_run_counts_only_its_part(ran):
    store, fid = ran["store"], ran["ids"]["bob_gpu2"]
    rec = store.get_run(fid)
    lo = rec.started_at + (rec.ended_at - rec.started_at) / 2
    lo = lo.replace(microsecond=lo.microsecond // 1000 * 1000)  # the store keeps milliseconds
    row = C.run_costs(store, lo, ran["until"], queues=[ran["queue"]]).set_index("id").loc[fid]
    e = _expected(store, fid, lo)
    assert row["source"] == "samples" and row["samples"] == len(e["pts"]) < len(store.series(fid))
    for k in ("gpu_alloc_h", "gpu_used_h", "gpu_energy_wh", "cpu_used_h"):
        assert _close(row[k], e[k]), (k, row[k], e[k])


def test_report_cli_prints_the_same_table(ran):
    store, ids = ran["store"], ran["ids"]
    exp = {k: _expected(store, i) for k, i in ids.items()}
    out = json.loads(cli("report", "--by", "owner", "--since", "1h", "--queue", ran["queue"], "--json").stdout)
    rows = {r["owner"]: r for r in out["rows"]}
    assert set(rows) == {"alice", "bob", "total"} and out["by"] == "owner"
    a, b, t = rows["alice"], rows["bob"], rows["total"]
    assert a["runs"] == 2 and b["runs"] == 1 and t["runs"] == 3
    assert _close(a["gpu_alloc_h"], exp["alice_gpu1"]["gpu_alloc_h"])  # the CPU run held no GPU
    assert _close(a["gpu_used_h"], exp["alice_gpu1"]["gpu_used_h"])
    assert _close(a["cpu_used_h"], exp["alice_gpu1"]["cpu_used_h"] + exp["alice_cpu2"]["cpu_used_h"])
    assert _close(a["gpu_energy_wh"], exp["alice_gpu1"]["gpu_energy_wh"]) and a["gpu_energy_runs"] == "1/1"
    assert _close(b["gpu_energy_wh"], exp["bob_gpu2"]["gpu_energy_wh"])
    assert _close(t["gpu_alloc_h"], sum(e["gpu_alloc_h"] for e in exp.values()))
    assert _close(t["gpu_idle_h"], t["gpu_alloc_h"] - t["gpu_used_h"])
    assert b["gpu_used_pct"] == pytest.approx(50.0, rel=0.25)  # two GPUs at 80 % and 20 %
    if not RAPL_READABLE:
        assert t["cpu_energy_wh"] is None and t["cpu_energy_runs"] == "0/3"
    # CSV by job: the same totals, unavailable figures spelled out
    text = cli("report", "--by", "job", "--since", "1h", "--queue", ran["queue"], "--csv").stdout
    recs = list(csv.DictReader(io.StringIO(text)))
    assert [r["job"] for r in recs] == [ran["job"], "total"]
    assert float(recs[-1]["gpu_alloc_h"]) == pytest.approx(t["gpu_alloc_h"], abs=1e-4)
    if not RAPL_READABLE:
        assert recs[-1]["cpu_energy_wh"] == "unavailable"
    # the human table
    human = cli("report", "--by", "queue", "--since", "1h", "--queue", ran["queue"]).stdout
    assert ran["queue"] in human and "GPU-h held" in human


def test_waste_figures(ran):
    df = C.run_costs(ran["store"], ran["since"], ran["until"], queues=[ran["queue"]])
    w = C.wasters(df)
    # bob's run left half of two GPUs idle: the top waster by idle GPU-hours
    assert w.iloc[0]["id"] == ran["ids"]["bob_gpu2"] and w.iloc[0]["gpu_idle_h"] > 0
    gpu = df[df["gpus"] > 0]
    assert C.idle_share(df) == pytest.approx(100 * (1 - gpu["gpu_used_h"].sum() / gpu["gpu_alloc_h"].sum()))
    with pytest.raises(ValueError):
        C.cost_table(df, "preset-x")


def test_v3_store_with_self_migrated_index_upgrades_to_v4(tmp_path):
    """A store at v3 whose run index already got the occupancy columns (the index's own
    migration before v4 was registered) gets the rest of v4 and keeps its rows."""
    url = f"sqlite:///{tmp_path / 'v3.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        S.ensure_schema(conn, target=3)
        conn.exec_driver_sql("ALTER TABLE launch_run_index ADD COLUMN queued_us BIGINT")
        conn.exec_driver_sql("INSERT INTO launch_run_index (id, queued_us, synced_ms) VALUES ('r1', 5, 1)")
        cols = {c["name"] for c in sa.inspect(conn).get_columns("launch_samples")}
        assert "gpu_energy_j" not in cols
    engine.dispose()
    dispose_engines()
    store = RunMetricsStore(url=url)
    assert store.schema_version() == S.SCHEMA_VERSION == 10
    with store._read() as conn:
        insp = sa.inspect(conn)
        for table, names in S.V4_COLUMNS.items():
            assert set(names) <= {c["name"] for c in insp.get_columns(table)}, table
        assert conn.exec_driver_sql("SELECT queued_us FROM launch_run_index WHERE id='r1'").scalar() == 5
    now = dt.datetime.now(UTC).replace(microsecond=0)
    store.upsert_run(RunRecord(flow_run_id="e1", gpu=1, started_at=now))
    store.record_samples([MetricSample(flow_run_id="e1", ts=now + dt.timedelta(seconds=1), interval_s=1,
                                       gpu_util_pct=50, gpu_energy_j=12.5, cpu_energy_j=None)])
    assert store.series("e1")[0]["gpu_energy_j"] == 12.5 and store.series("e1")[0]["cpu_energy_j"] is None


def test_cost_panel_on_the_page(ran, monkeypatch):
    """The page's "Cost and waste" panel shows the same table for the queue, and says what is unavailable."""
    from fixtures_dashboard import choose, figures, fresh_app, headings, tables

    monkeypatch.setenv("LAUNCH_METRICS_URL", ran["store"].url)
    at = fresh_app().run()
    choose(at, "queues", [ran["queue"]]).run()
    choose(at, "range", ["Last 1 hour"]).run()
    choose(at, "grouping", ["owner"]).run()
    choose(at, "section", ["Cost and waste"]).run()  # one section of the page at a time
    assert not at.exception, [e.value for e in at.exception]
    assert "Cost and waste" in headings(at)
    shown = next(d for d in tables(at) if "gpu_alloc_h" in d.columns)
    # a figure that was not measured reads "unavailable" on the page (an empty cell in the CSV)
    drawn = next(d for d in at.dataframe if "gpu_alloc_h" in d.value.columns)
    assert drawn.proto.placeholder == "unavailable"
    runs = C.run_costs(ran["store"], ran["since"], ran["until"], queues=[ran["queue"]])
    want = C.cost_table(runs, "owner").set_index("owner")
    assert list(shown["owner"]) == list(want.index) and list(shown["owner"])[-1] == "total"  # most GPU-hours held first
    assert set(shown["owner"]) == {"alice", "bob", "total"}
    for _, row in shown.iterrows():
        assert float(row["gpu_alloc_h"]) == pytest.approx(want.loc[row["owner"], "gpu_alloc_h"], rel=1e-3)
        assert float(row["gpu_used_h"]) == pytest.approx(want.loc[row["owner"], "gpu_used_h"], rel=1e-3)
        if not RAPL_READABLE:
            assert pd.isna(row["cpu_energy_wh"])
    metrics = figures(at)
    assert metrics["Held GPU time idle"] == f"{C.idle_share(runs):.0f}%"
    assert metrics["GPU energy"] == f"{want.loc['total', 'gpu_energy_wh']:,.0f} Wh"
    if not RAPL_READABLE:
        assert metrics["CPU energy"] == "n/a"
    wasters = next(d for d in tables(at) if "cpu_idle_h" in d.columns)
    assert wasters.iloc[0]["id"] == ran["ids"]["bob_gpu2"]
    # the agent published 2 GPUs: the capacity figures are percentages, not n/a
    assert metrics["GPU capacity held"].endswith("%") and metrics["GPU capacity used"].endswith("%")
    # the usage panels show what the agent measured: the GPU-use chart's data holds each GPU run's summary
    import pyarrow as pa

    choose(at, "section", ["Resource use"]).run()
    assert not at.exception, [e.value for e in at.exception]
    frames = []
    for el in [*at.get("arrow_vega_lite_chart"), *at.get("vega_lite_chart")]:
        blobs = [d.data.data for d in el.proto.datasets] + ([el.proto.data.data] if el.proto.data.data else [])
        frames += [pa.ipc.open_stream(b).read_all().to_pandas() for b in blobs if b]
    gpu_use = next(f for f in frames if "gpu_util_pct" in f.columns and "id" in f.columns)
    for kind in ("alice_gpu1", "bob_gpu2"):
        s = ran["store"].get_summary(ran["ids"][kind])
        row = gpu_use[gpu_use["id"] == ran["ids"][kind]]
        assert len(row) == 1 and row["gpu_util_pct"].iloc[0] == pytest.approx(s.avg_gpu_util_pct)
        idx = ran["store"].get_run(ran["ids"][kind]).gpu_indices
        assert idx and s.avg_gpu_util_pct == pytest.approx(sum(UTIL[i] for i in idx) / len(idx))
    assert ran["ids"]["alice_cpu2"] not in set(gpu_use["id"])  # no GPU: not on the GPU-use chart
