"""The end-to-end agent tests again, with the Prefect server and the metrics store on PostgreSQL.

Selected tests of test_agent_e2e.py re-run here against a server whose database is a private
PostgreSQL on loopback (fixtures_pg.prefect_server_pg); the metrics store block points at another
database of the same PostgreSQL. Plus two agents with separate declared capacities (standing in for
two hosts) serving one queue: every run exactly once, placement and pinning right on each agent.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fixtures_pg import pg_server, prefect_server_pg  # noqa: F401  (fixtures)
from launch_helpers import agent, apply_queue, cli_json, deploy_probe, records, wait_final
# mixed presets, priority and FIFO are placement logic, the same on either database; on PostgreSQL the
# two-hosts test below covers placement and claims, this one the store's writes
from test_agent_e2e import _claim_times, test_cancel_and_failure_release_capacity_and_metrics_are_recorded  # noqa: F401

pytestmark = pytest.mark.usefixtures("prefect_server_pg")


def test_server_really_is_on_postgres(prefect_server_pg):
    """Guard: the tests in this module talk to the PostgreSQL-backed server and store."""
    import os

    import psycopg

    assert os.environ["PREFECT_API_URL"] == prefect_server_pg["api_url"]
    db = prefect_server_pg["metrics_url"].rsplit("/", 1)[1].replace("metrics_", "prefect_")
    with psycopg.connect(host="127.0.0.1", port=prefect_server_pg["pg_port"], user="launch", dbname=db) as conn:
        (n,) = conn.execute("SELECT count(*) FROM block_document WHERE name = 'default'").fetchone()
    assert n == 1, "the store block that `setup` saved is in Prefect's tables in PostgreSQL"
    assert cli_json("setup")["url"] == prefect_server_pg["metrics_url"]


PRESETS = {
    "cpu1": {"cpu": 1, "memory": "256Mi", "gpu": 0},
    "gpu1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1},
    "gpu2": {"cpu": 0.5, "memory": "256Mi", "gpu": 2},
}


def _gpus(rec: dict) -> set[str]:
    return set(filter(None, (rec["cuda_visible_devices"] or "").split(",")))


def test_two_hosts_one_queue_each_run_once_placement_and_pinning(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"hosts-{unique_name}", "presets": PRESETS, "default_preset": "gpu1"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    caps = {f"big-{unique_name}": {"cpu": 2, "gpu": 2}, f"small-{unique_name}": {"cpu": 2, "gpu": 1}}
    big, small = caps
    common = ("--param", f"record_dir={rec}", "--param", "seconds=1")
    with agent([q], big, "cpu=2,memory=4Gi,gpu=2", tmp_path), agent([q], small, "cpu=2,memory=4Gi,gpu=1", tmp_path):
        ids = []
        ids += cli_json("submit", job, "--queue", q, "--preset", "gpu2", "--count", "2", *common)["run_ids"]
        ids += cli_json("submit", job, "--queue", q, "--preset", "gpu1", "--count", "6", *common)["run_ids"]
        ids += cli_json("submit", job, "--queue", q, "--preset", "cpu1", "--count", "2", *common)["run_ids"]
        pinned = cli_json("submit", job, "--queue", q, "--preset", "gpu1", "--agent", small, "--count", "2",
                          *common)["run_ids"]
        runs = wait_final(ids + pinned, timeout=600)  # a machine shared with other suites can be very slow
    assert all(r.state.is_completed() for r in runs), {r.name: r.state_name for r in runs}
    assert all(r.run_count == 1 for r in runs)
    _claim_times(ids + pinned)  # exactly one Pending claim per run, from Prefect's state histories
    got = records(rec)
    assert sorted(got) == sorted(ids + pinned), "every run recorded exactly once"

    by_agent = {name: [r for r in got.values() if r["launch_agent"] == name] for name in caps}
    assert set(r["launch_agent"] for r in got.values()) == set(caps), "both hosts ran work"
    assert {got[p]["launch_agent"] for p in pinned} == {small}, "pinned runs ran only on their agent"
    gpu2 = ids[:2]
    assert {got[i]["launch_agent"] for i in gpu2} == {big}, "2-GPU runs only fit the 2-GPU host"
    for name, recs in by_agent.items():
        cap = caps[name]
        for r in recs:  # pinned to indices that exist on this host, as many as the preset asks
            assert _gpus(r) <= {str(i) for i in range(cap["gpu"])}, (name, r["cuda_visible_devices"])
            assert len(_gpus(r)) == int(r["launch_gpu"])
        for a, b in itertools.combinations(recs, 2):  # overlapping runs on one host never share a GPU
            if a["start"] < b["end"] and b["start"] < a["end"]:
                assert not (_gpus(a) & _gpus(b)), f"{name}: runs shared GPUs {_gpus(a) & _gpus(b)}"
        for r in recs:
            active = [x for x in recs if x["start"] <= r["start"] < x["end"]]
            assert sum(int(x["launch_gpu"]) for x in active) <= cap["gpu"]
            assert sum(float(x["launch_cpu"]) for x in active) <= cap["cpu"]


def test_store_retention_setting_and_purge_on_postgres(prefect_server_pg, unique_name):
    """`store retention N` sets the block's retention; `store purge` deletes from the PostgreSQL store
    the runs that ended before it and keeps the rest."""
    import uuid
    from datetime import datetime, timedelta, timezone

    from prefect_launch.blocks.metrics_records import RunRecord
    from prefect_launch.blocks.metrics_store import RunMetricsStore

    store = RunMetricsStore(url=prefect_server_pg["metrics_url"])
    now = datetime.now(timezone.utc)
    old, recent = str(uuid.uuid4()), str(uuid.uuid4())
    store.upsert_run(RunRecord(flow_run_id=old, queue=f"p-{unique_name}", started_at=now - timedelta(days=41),
                               ended_at=now - timedelta(days=40), state="COMPLETED"))
    store.upsert_run(RunRecord(flow_run_id=recent, queue=f"p-{unique_name}", started_at=now - timedelta(days=6),
                               ended_at=now - timedelta(days=5), state="COMPLETED"))
    assert cli_json("store", "retention", "30")["retention_days"] == 30
    assert cli_json("store", "retention")["retention_days"] == 30, "the setting is kept in the block"
    out = cli_json("store", "purge")
    assert out["older_than_days"] == 30 and out["deleted_runs"] >= 1
    assert store.get_run(old) is None and store.get_run(recent) is not None
    assert cli_json("store", "purge", "--older-than-days", "2")["deleted_runs"] >= 1
    assert store.get_run(recent) is None
