"""Queue position and predicted start (ETA) of waiting runs in `queue ls`, `runs ls` and the monitor.

Pure parts first (position order, the monitor's frame), then one real agent with room for one
run and three runs submitted: the two that wait show positions 1 and 2 with ETAs later than now
and in that order, the same in `queue ls --json`, `runs ls --json` and the monitor's waiting table.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pandas as pd
import pytest

from launch_helpers import agent, apply_queue, cli_json, deploy_probe, read_runs, wait_running
from prefect_launch.dashboard.summary import waiting_frame
from prefect_launch.deployments.wait_order import WaitingRun, positions

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def _fr(i: str, pool: str, prio: str, at: float) -> SimpleNamespace:
    return SimpleNamespace(id=i, work_pool_name=pool, work_queue_name=prio,
                           expected_start_time=NOW + timedelta(seconds=at), created=NOW + timedelta(seconds=at))


def test_positions_follow_priority_then_submit_time_per_queue():
    runs = [_fr("a", "q", "medium", 0), _fr("b", "q", "high", 5), _fr("c", "q", "medium", 1), _fr("d", "r", "low", 9)]
    ranks = {"q": {"high": 2, "medium": 3}, "r": {"low": 4}}
    assert positions(runs, ranks) == {"b": 1, "a": 2, "c": 3, "d": 1}


def test_waiting_frame_has_position_eta_and_why():
    waits = [WaitingRun(run_id="1", name="w1", queue="q", position=1, submitted=NOW - timedelta(seconds=30),
                        eta=NOW + timedelta(seconds=60), reason="waiting: needs cpu=1, agent a has 0 free"),
             WaitingRun(run_id="2", name="w2", queue="q", position=2, submitted=NOW - timedelta(seconds=20)),
             WaitingRun(run_id="3", name="later", queue="q", submitted=NOW + timedelta(hours=1))]
    df = waiting_frame(waits, NOW)
    assert df["position"].tolist()[:2] == [1, 2] and pd.isna(df["position"].iloc[2])
    assert df["eta"].iloc[0] == pd.Timestamp(NOW + timedelta(seconds=60)) and pd.isna(df["eta"].iloc[1])
    assert df["eta_in_s"].iloc[0] == 60 and df["waited_s"].iloc[0] == 30
    assert df["why"].tolist() == ["waiting: needs cpu=1, agent a has 0 free", "waiting: not planned yet (agents plan the oldest due runs of each priority first)",
                                  f"starts at {NOW + timedelta(hours=1):%Y-%m-%d %H:%M:%S} UTC"]


@pytest.mark.usefixtures("prefect_server")
def test_waiting_runs_show_position_and_eta_in_queue_ls_runs_ls_and_the_monitor(tmp_path, unique_name):
    from fixtures_dashboard import choose, fresh_app, tables

    q = apply_queue(tmp_path, {"name": f"eta-{unique_name}", "presets": {"one": {"cpu": 1, "memory": "256Mi"}},
                               "default_preset": "one"})
    job = deploy_probe(q, f"eta-{unique_name}")
    with agent([q], f"eta-{unique_name}", "cpu=1,memory=2Gi", tmp_path):
        # no past runs of this job: each run's expected length is its timeout (60 s)
        ids = cli_json("submit", job, "--queue", q, "--count", "3", "--timeout", "60s",
                       "--param", f"record_dir={tmp_path / 'rec'}", "--param", "seconds=40")["run_ids"]
        wait_running(ids[0])
        deadline = time.time() + 30
        while time.time() < deadline:  # the agent has looked at the other two (reasons written)
            if all((r.labels or {}).get("launch.waiting") for r in read_runs(ids[1:])):
                break
            time.sleep(0.5)
        now = datetime.now(timezone.utc)

        status = cli_json("queue", "ls", q)[0]
        assert status["queued"] == 2 and status["waiting_count"] == 2, status
        shown = {w["run_id"]: w for w in status["waiting"]}
        assert [shown[i]["position"] for i in ids[1:]] == [1, 2], status["waiting"]
        etas = [datetime.fromisoformat(shown[i]["eta"]) for i in ids[1:]]
        assert now < etas[0] < etas[1], (now, etas)
        assert datetime.fromisoformat(status["head_eta"]) == etas[0] == datetime.fromisoformat(status["next_eta"])
        assert etas[1] - etas[0] >= timedelta(seconds=50), "the second waits for the first's whole expected run"

        rows = {r["run_id"]: r for r in cli_json("runs", "ls", "--queue", q)}
        assert rows[ids[0]]["position"] is None and rows[ids[0]]["eta"] is None, "the running run has none"
        assert [rows[i]["position"] for i in ids[1:]] == [1, 2]
        run_etas = [datetime.fromisoformat(rows[i]["eta"]) for i in ids[1:]]
        assert now < run_etas[0] < run_etas[1]
        assert all(abs((a - b).total_seconds()) < 5 for a, b in zip(run_etas, etas)), (run_etas, etas)

        at = fresh_app().run()
        choose(at, "queues", [q]).run()
        assert not at.exception, [e.value for e in at.exception]
        table = next(d for d in tables(at) if {"position", "eta", "why"} <= set(d.columns))
        table = table[table["queue"] == q]
        names = {str(r.id): r.name for r in read_runs(ids)}
        assert table["name"].tolist() == [names[i] for i in ids[1:]]
        assert table["position"].tolist() == [1, 2]
        eta_col = table["eta"].tolist()
        assert now < eta_col[0].to_pydatetime() < eta_col[1].to_pydatetime(), eta_col
        assert all("waiting" in w for w in table["why"])


@pytest.mark.usefixtures("prefect_server")
def test_eta_is_checked_against_the_runs_actual_starts(tmp_path, unique_name):
    """Ground truth for the prediction: after two runs of a job taught the agent its length and overheads,
    the ETAs that `queue ls` shows for two waiting runs are compared with the starts the runs then have
    in their own state history."""
    q = apply_queue(tmp_path, {"name": f"etb-{unique_name}", "presets": {"one": {"cpu": 1, "memory": "256Mi"}},
                               "default_preset": "one"})
    job = deploy_probe(q, f"etb-{unique_name}")
    params = ("--param", f"record_dir={tmp_path / 'rec'}", "--param", "seconds=5")
    with agent([q], f"etb-{unique_name}", "cpu=1,memory=2Gi", tmp_path):
        from launch_helpers import wait_final

        assert all(r.state.is_completed() for r in wait_final(
            cli_json("submit", job, "--queue", q, "--count", "2", *params)["run_ids"], timeout=120))
        ids = cli_json("submit", job, "--queue", q, "--count", "3", *params)["run_ids"]
        wait_running(ids[0])
        etas: dict[str, datetime] = {}
        deadline = time.time() + 20
        while time.time() < deadline and len(etas) < 2:
            waiting = cli_json("queue", "ls", q)[0]["waiting"]
            etas = {w["run_id"]: datetime.fromisoformat(w["eta"]) for w in waiting if w.get("eta")}
            time.sleep(0.5)
        assert set(etas) == set(ids[1:]), etas
        runs = {str(r.id): r for r in wait_final(ids, timeout=120)}
    assert all(r.state.is_completed() for r in runs.values())
    errors = [abs((runs[i].start_time - etas[i]).total_seconds()) for i in ids[1:]]
    # the first waits behind one run, the second behind two: its error may add up over both
    assert errors[0] < 5 and errors[1] < 8, (errors, {i: (etas[i], runs[i].start_time) for i in ids[1:]})
