"""The order in which the suite hands its files to the pytest workers: heaviest first.

pytest-xdist's ``--dist loadfile`` gives each worker one whole file at a time, in the collection's order;
its own reordering (by number of tests) puts a docker or browser file of two tests that take minutes
last, so one worker runs it alone while the others have finished. Longest first (the classic greedy
for balancing jobs over machines) leaves the short files to fill the end. The costs are measured
seconds per file (tests/file_costs.json, written by scripts/test_file_costs.py).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

COSTS = Path(__file__).resolve().parent / "file_costs.json"


def load_costs(path: Path = COSTS) -> dict[str, float]:
    """The recorded seconds per file; empty when the table is missing or unreadable (then the order is
    the collection's)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def heaviest_first(files: list[str], costs: dict[str, float]) -> list[str]:
    """``files`` by recorded cost, heaviest first; a file not in the table counts as the median file.
    Ties keep the given order (a stable sort)."""
    default = statistics.median(costs.values()) if costs else 0.0
    return sorted(files, key=lambda f: -costs.get(f, default))


DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(tests/[^:]+\.py)::")


def file_costs(lines: list[str]) -> dict[str, float]:
    """Seconds per test file from a ``--durations=0`` report: setup, call and teardown of its tests summed
    (a module fixture's start is its first test's setup), heaviest first."""
    costs: dict[str, float] = defaultdict(float)
    for line in lines:
        m = DURATION.match(line)
        if m:
            costs[m.group(3)] += float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(costs.items(), key=lambda kv: -kv[1])}
