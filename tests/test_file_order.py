"""The suite's file order (tests/file_order.py): heaviest first, unknown files as the median, stable."""

from __future__ import annotations

import json

from file_order import file_costs, heaviest_first, load_costs


def test_heaviest_files_first_unknown_as_median_ties_stable():
    costs = {"a.py": 5.0, "b.py": 300.0, "c.py": 40.0, "d.py": 40.0}
    # median 40: the unknown file sits with the 40-s files, after them (stable: it came last)
    assert heaviest_first(["a.py", "c.py", "new.py", "d.py", "b.py"], costs) == ["b.py", "c.py", "new.py", "d.py", "a.py"]
    assert heaviest_first(["x.py", "y.py"], {}) == ["x.py", "y.py"]  # no table: the collection's order


def test_costs_table_read_and_a_broken_one_ignored(tmp_path):
    good = tmp_path / "costs.json"
    good.write_text(json.dumps({"tests/test_a.py": 12.5}))
    assert load_costs(good) == {"tests/test_a.py": 12.5}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert load_costs(bad) == {} and load_costs(tmp_path / "missing.json") == {}


def test_the_recorded_table_names_files_that_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    costs = load_costs()
    assert costs, "tests/file_costs.json is missing or empty: scripts/test_file_costs.py writes it"
    gone = [f for f in costs if not (root / f).exists()]
    assert not gone, f"tests/file_costs.json names files that no longer exist: {gone}; rerun scripts/test_file_costs.py"


def test_file_costs_sum_each_files_phases_from_a_durations_report():
    report = [
        "============================= slowest durations =============================",
        "40.50s setup    tests/test_a.py::test_one",
        "12.25s call     tests/test_a.py::test_one",
        "0.25s teardown tests/test_a.py::test_one",
        "60.00s call     tests/test_b.py::test_two[param-x]",
        "3.00s call     tests/test_a.py::Klass::test_three",
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)",
        "580 passed in 1107.92s",
    ]
    costs = file_costs(report)
    assert costs == {"tests/test_b.py": 60.0, "tests/test_a.py": 56.0}
    assert list(costs) == ["tests/test_b.py", "tests/test_a.py"]  # heaviest first
