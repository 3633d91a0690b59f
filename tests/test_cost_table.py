"""The cost panel's table and top wasters (dashboard/cost.py) against the raw cost rows, run by run.

Pure: random cost rows with the holes real stores have (GPU use not measured, no energy reading, no
memory peak, a group with none of a figure), every figure recomputed here from the rows one at a time.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from prefect_launch.dashboard import cost as C


def _rows(n: int = 400, seed: int = 5) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    gpus = rng.choice([0, 1, 2, 4], n).astype(float)
    hours = rng.choice([0.5, 1.0, 2.0], n)  # few values: equal idle figures (ties) happen
    cpus = rng.choice([1, 2, 4], n).astype(float)
    owner = rng.choice(["ana", "bo", "cy", "dee"], n)
    df = pd.DataFrame(dict(
        id=[f"run-{k}" for k in range(n)], run=[f"r{k}" for k in range(n)], job=rng.choice(["train", "eval", "tune"], n),
        owner=owner, queue=rng.choice(["q1", "q2"], n), gpus=gpus, cpus=cpus, hours=hours,
        gpu_alloc_h=gpus * hours, gpu_used_h=np.where(rng.random(n) < 0.7, gpus * hours * rng.choice([0.0, 0.5, 1.0], n), np.nan),
        cpu_alloc_h=cpus * hours, cpu_used_h=np.where(rng.random(n) < 0.8, cpus * hours * rng.choice([0.25, 1.0], n), np.nan),
        gpu_energy_wh=np.where(rng.random(n) < 0.6, 50.0, np.nan), cpu_energy_wh=np.where(rng.random(n) < 0.3, 5.0, np.nan),
        peak_memory_gib=np.where(rng.random(n) < 0.9, rng.random(n), np.nan), memory_request_gib=rng.choice([1.0, 2.0], n)))
    df.loc[df["owner"] == "dee", ["gpu_used_h", "peak_memory_gib", "cpu_energy_wh"]] = np.nan  # a group without them
    return df


def _by_hand(rows: list[dict]) -> dict:
    """One row of the table, summed run by run."""
    def total(key, ok=lambda r: True):
        got = [r[key] for r in rows if ok(r) and not math.isnan(r[key])]
        return (sum(got), len(got))
    gpu = lambda r: r["gpus"] > 0  # noqa: E731
    measured = lambda r: gpu(r) and not math.isnan(r["gpu_used_h"])  # noqa: E731
    used, n_used = total("gpu_used_h", measured)
    m_alloc, _ = total("gpu_alloc_h", measured)
    cpu_m = lambda r: not math.isnan(r["cpu_used_h"]) and not math.isnan(r["cpu_alloc_h"])  # noqa: E731
    c_used, n_c = total("cpu_used_h", cpu_m)
    c_alloc, _ = total("cpu_alloc_h", cpu_m)
    ge, n_ge = total("gpu_energy_wh", gpu)
    ce, n_ce = total("cpu_energy_wh")
    peaks = [r["peak_memory_gib"] for r in rows if not math.isnan(r["peak_memory_gib"])]
    return dict(runs=len(rows), gpu_alloc_h=total("gpu_alloc_h")[0], gpu_used_h=used if n_used else None,
                gpu_idle_h=m_alloc - used if n_used else None, gpu_used_pct=100 * used / m_alloc if n_used and m_alloc else None,
                gpu_unmeasured_h=total("gpu_alloc_h", lambda r: gpu(r) and not measured(r))[0],
                cpu_used_h=c_used if n_c else None, cpu_used_pct=100 * c_used / c_alloc if n_c and c_alloc else None,
                gpu_energy_wh=ge if n_ge else None, gpu_energy_runs=f"{n_ge}/{sum(map(gpu, rows))}",
                cpu_energy_wh=ce if n_ce else None, cpu_energy_runs=f"{n_ce}/{len(rows)}",
                peak_memory_gib=max(peaks) if peaks else None)


@pytest.mark.parametrize("by", C.BY)
def test_each_row_of_the_table_is_the_sum_of_its_runs(by):
    df = _rows()
    table = C.cost_table(df, by).set_index(by)
    records = df.to_dict("records")
    groups = {k: [r for r in records if r[by] == k] for k in df[by].unique()}
    assert list(table.index)[-1] == "total" and set(table.index) == {*groups, "total"}
    order = sorted(groups, key=lambda k: (-sum(r["gpu_alloc_h"] for r in groups[k]),
                                          -sum(r["cpu_alloc_h"] for r in groups[k]), k))
    assert list(table.index)[:-1] == order  # most GPU-hours held first
    for k, rows in [*groups.items(), ("total", records)]:
        got, want = table.loc[k], _by_hand(rows)
        for col, v in want.items():
            if v is None:
                assert got[col] is None or pd.isna(got[col]), (k, col, got[col])
            elif isinstance(v, str):
                assert got[col] == v, (k, col)
            else:
                assert float(got[col]) == pytest.approx(v, rel=1e-9, abs=1e-12), (k, col)
    if by == "owner":  # dee's runs have no GPU reading: nothing measured, all their GPU time unmeasured
        assert pd.isna(table.loc["dee", "gpu_used_h"]) and table.loc["dee", "gpu_unmeasured_h"] > 0


def test_wasters_are_the_runs_with_most_idle_time_in_order():
    df = _rows()
    got = C.wasters(df, 25)
    keyed = []
    for pos, r in enumerate(df.to_dict("records")):
        g, c = r["gpu_alloc_h"] - r["gpu_used_h"], r["cpu_alloc_h"] - r["cpu_used_h"]
        if (0 if math.isnan(g) else g) > 0 or (0 if math.isnan(c) else c) > 0:
            # idle GPU-hours descending, then idle core-hours, a missing figure after every number, then row order
            keyed.append(((math.isnan(g), -g if not math.isnan(g) else 0), (math.isnan(c), -c if not math.isnan(c) else 0),
                          pos, r["id"], g))
    keyed.sort()
    assert list(got["id"]) == [k[3] for k in keyed[:25]]
    assert np.allclose(got["gpu_idle_h"], [k[4] for k in keyed[:25]], equal_nan=True)
    assert C.wasters(df.iloc[:0]).empty and len(C.wasters(df, 3)) == 3


def test_filter_runs_keeps_the_runs_with_every_label_chosen_and_all_rows_without_a_choice():
    df = _rows()
    assert C.filter_runs(df) is df  # nothing chosen: the rows themselves, not a copy of a month of them
    got = C.filter_runs(df, owners=["ana", "bo"], jobs=["train"])
    want = [r.id for r in df.itertuples() if r.owner in ("ana", "bo") and r.job == "train"]
    assert list(got["id"]) == want and 0 < len(want) < len(df)
