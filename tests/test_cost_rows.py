"""The monitor's incremental cost reader (dashboard/cost_rows.py) against whole reads of a real store.

Every read is compared with :func:`cost.run_costs` over the same store, range and clock (which
``test_cost.py`` checks against the samples a real agent wrote), after the kinds of write a store
sees between two steps of the page's clock: runs starting, samples of running runs, runs ending
with their summary, a run ending before the range, a run deleted, runs of another queue.
"""

from __future__ import annotations

import datetime as dt

import pandas as pd
import sqlalchemy as sa

from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.dashboard import cost as C
from prefect_launch.dashboard.cost_rows import CostRows

UTC = dt.timezone.utc
H = dt.timedelta(hours=1)
M = dt.timedelta(minutes=1)


def _start(store, fid, at, queue="q1", gpus=1, owner="ana"):
    store.upsert_run(RunRecord(flow_run_id=fid, queue=queue, owner=owner, job="train", cpu=2, gpu=gpus,
                               memory_bytes=1 << 30, started_at=at, state="RUNNING"))


def _samples(store, fid, start, n, util=50.0):
    store.record_samples([MetricSample(flow_run_id=fid, ts=start + k * M, interval_s=60, cpu_pct=100.0,
                                       gpu_util_pct=util, rss_bytes=(k + 1) << 20, gpu_energy_j=600.0)
                          for k in range(n)])


def _end(store, fid, start, end, util=50.0):
    n = int((end - start) / M)
    store.write_summary(fid, RunSummary(started_at=start, ended_at=end, duration_s=(end - start).total_seconds(),
                                        cpu_seconds=60.0 * n, gpu_used_s=60.0 * n * util / 100, avg_rss_bytes=1 << 20,
                                        peak_rss_bytes=n << 20, gpu_energy_j=600.0 * n, samples=n, exit_state="COMPLETED"))


def _same(reader: CostRows, store, since, until, now, queues=()):
    got = reader.read(store, since, until, queues, now=now)
    want = C.run_costs(store, since, until, queues, now=now)
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True))
    return got


def test_incremental_reads_equal_whole_reads(tmp_path):
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}")
    now = dt.datetime.now(UTC).replace(microsecond=0)
    t0 = now - 3 * H
    _start(store, "done", t0)  # inside the range, summarised
    _samples(store, "done", t0, 60)
    _end(store, "done", t0, t0 + H)
    _start(store, "cut", now - 5 * H)  # started before the range, ends inside it
    _samples(store, "cut", now - 5 * H, 200)
    _end(store, "cut", now - 5 * H, now - 90 * M)
    _start(store, "going", now - 30 * M, gpus=2)  # still running
    _samples(store, "going", now - 30 * M, 20, util=90.0)
    _start(store, "late", now - 40 * M)  # will end before the next range starts
    _start(store, "gone", now - 2 * H)  # will be deleted
    _start(store, "other", now - H, queue="q2", owner="bo")
    clock = [1000.0]
    # no overlap: the read after the writes must ask for exactly the rows they changed
    reader = CostRows(clock=lambda: clock[0], full_every_s=300, overlap_ms=0)

    first = _same(reader, store, now - 4 * H, now, now)
    assert set(first["id"]) == {"done", "cut", "going", "late", "gone", "other"}
    _same(reader, store, now - 4 * H, now, now, queues=("q1",))
    assert reader.reads == {"whole": 2}  # one per queue choice

    # the next steps: writes, then a range that starts later and a clock that moved on
    _samples(store, "going", now - 10 * M, 12, util=90.0)
    _end(store, "going", now - 30 * M, now + M)
    _start(store, "new", now + 30 * dt.timedelta(seconds=1))
    _samples(store, "new", now + 30 * dt.timedelta(seconds=1), 1)
    store.upsert_run(RunRecord(flow_run_id="late", ended_at=now - 4 * H + M, state="CRASHED"))  # recovered late
    store.upsert_run(RunRecord(flow_run_id="queued", queue="q1", submitted_at=now))  # not started: not a cost row
    clock[0] += 10
    later = _same(reader, store, now - 4 * H + 2 * M, now + 2 * M, now + 2 * M)
    assert reader.reads == {"whole": 2, "changes": 1}
    assert reader.rows_read == 4  # going (its summary), new, late and queued: samples alone stamp nothing
    assert "late" not in set(later["id"]) and {"new", "going"} <= set(later["id"])
    row = later.set_index("id").loc["going"]
    assert row["source"] == "summary" and row["gpu_alloc_h"] == 2 * 31 / 60
    _same(reader, store, now - 4 * H + 2 * M, now + 2 * M, now + 2 * M, queues=("q1",))
    _same(reader, store, now - 2 * H, now + 2 * M, now + 2 * M)  # a shorter range from the same rows
    assert reader.reads == {"whole": 2, "changes": 3} and reader.rows_read == 0

    # a run deleted from the store: no stamp tells of it, the next recheck of every stamp drops it; a write
    # stamped behind the last read (a writer's clock running late) is missed by the change reads, and the
    # recheck reads it again (its stamp differs from the held row's)
    with store._write() as conn:
        key = conn.execute(sa.select(S.runs.c.id).where(S.runs.c.flow_run_id == "gone")).scalar_one()
        conn.execute(sa.delete(S.runs).where(S.runs.c.id == key))
        conn.execute(sa.update(S.runs).where(S.runs.c.flow_run_id == "other").values(owner="cy", updated_ms=1))
    clock[0] += 10
    missed = reader.read(store, now - 4 * H + 3 * M, now + 3 * M, now=now + 3 * M)
    assert missed.set_index("id").loc["other", "owner"] == "bo" and reader.rows_read == 0
    clock[0] += 300
    after = _same(reader, store, now - 4 * H + 3 * M, now + 3 * M, now + 3 * M)
    assert "gone" not in set(after["id"]) and after.set_index("id").loc["other", "owner"] == "cy"
    assert reader.reads["whole"] == 2 and reader.reads["recheck"] == 1 and reader.rows_read == 1  # "other" alone

    # a range reaching further back than the rows held is read whole
    clock[0] += 10
    _same(reader, store, now - 6 * H, now + 3 * M, now + 3 * M)
    assert reader.reads["whole"] == 3

    # the next step with nothing written: the summarised runs' rows are kept, only the others made again
    clock[0] += 10
    again = _same(reader, store, now - 6 * H, now + 3 * M, now + 3 * M)
    assert reader.rows_made == int((again["source"] == "samples").sum()) < len(again)
    # a summarised run's summary written again: its kept row is dropped and made again from the new one
    before = again.set_index("id").loc["done", "gpu_used_h"]
    _end(store, "done", t0, t0 + H, util=20.0)
    clock[0] += 10
    changed = _same(reader, store, now - 6 * H, now + 3 * M, now + 3 * M)
    assert changed.set_index("id").loc["done", "gpu_used_h"] == before * 20 / 50


def test_every_write_moves_the_run_stamp(tmp_path):
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}")
    now = dt.datetime.now(UTC)

    def stamp():
        with store._read() as conn:
            return conn.execute(sa.select(S.runs.c.updated_ms).where(S.runs.c.flow_run_id == "r")).scalar_one()

    before = C.epoch_ms(dt.datetime.now(UTC))
    _start(store, "r", now)
    first = stamp()
    assert first >= before
    import time

    time.sleep(0.01)
    store.upsert_run(RunRecord(flow_run_id="r", state="RUNNING"))
    second = stamp()
    time.sleep(0.01)
    _end(store, "r", now, now + M)
    assert first < second < stamp()


def test_costs_frame_by_key_labels_every_row_with_its_own_store_key(tmp_path):
    """The incremental reader keeps rows by store key; ``by_key`` gives each row its own, whatever the input order."""
    store = RunMetricsStore(url=f"sqlite:///{tmp_path / 'm.db'}")
    now = dt.datetime.now(UTC).replace(microsecond=0)
    for k, fid in enumerate(["c", "a", "d", "b"]):
        _start(store, fid, now - (k + 1) * H, owner=f"o{k}")
        _samples(store, fid, now - (k + 1) * H, 30)
    _end(store, "a", now - 2 * H, now - H)
    lo, hi, now_ms = C.epoch_ms(now - 6 * H), C.epoch_ms(now), C.epoch_ms(now)
    with store._read() as conn:
        x = C.read_rows(conn, *C.in_range(lo, hi, ()))
        agg = C.sample_sums(conn, x, lo, hi)
    shuffled = x.iloc[[2, 0, 3, 1]]
    keyed = C.costs_frame(shuffled, agg, lo, hi, now_ms, by_key=True)
    key_of = dict(zip(x["flow_run_id"], x["id"].astype("int64")))
    assert list(keyed.index) == [key_of[f] for f in keyed["id"]] == sorted(key_of.values())
    pd.testing.assert_frame_equal(keyed.reset_index(drop=True), C.costs_frame(x, agg, lo, hi, now_ms))
    assert list(C.costs_frame(x.iloc[:0], agg, lo, hi, now_ms, by_key=True).index) == []


def test_merged_places_new_rows_in_key_order_as_a_sort_would():
    """The reader's merge of held and new rows (pure): the same frame as concatenating and sorting by key,
    for new keys before, among and after the held ones, and either side empty."""
    import numpy as np

    from prefect_launch.dashboard.cost_rows import merged

    rng = np.random.default_rng(7)
    keys = rng.choice(10_000, size=600, replace=False)
    held_keys, new_keys = np.sort(keys[:500]), np.sort(keys[500:])
    frame = lambda k: pd.DataFrame({"v": k * 2.0, "s": [f"r{i}" for i in k]}, index=pd.Index(k, dtype="int64"))  # noqa: E731
    held, new = frame(held_keys), frame(new_keys)
    want = pd.concat([held, new]).sort_index()
    pd.testing.assert_frame_equal(merged(held, new), want)
    pd.testing.assert_frame_equal(merged(new, held), want)
    edges = frame(np.array([-1, 20_000]))  # before the first and after the last
    pd.testing.assert_frame_equal(merged(held, edges), pd.concat([held, edges]).sort_index())
    assert merged(held, new.iloc[:0]) is held and merged(None, new) is new
    # only some of the held rows (ascending positions), in the same gather
    some = np.sort(rng.choice(len(held), size=300, replace=False))
    pd.testing.assert_frame_equal(merged(held, new, some), pd.concat([held.iloc[some], new]).sort_index())
    pd.testing.assert_frame_equal(merged(held, new.iloc[:0], some), held.iloc[some])
    assert merged(held, new, some[:0]) is new
