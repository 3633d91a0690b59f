"""Write tests/file_costs.json (each test file's seconds) from the log of a ``--durations=0`` run.

    make test PYTEST_ARGS="-n 2 --dist loadfile --durations=0" | tee /tmp/t.log
    .venv/bin/python scripts/test_file_costs.py /tmp/t.log

The suite hands whole files to its workers (``--dist loadfile``), heaviest first (tests/conftest.py),
so that no worker is left alone at the end with one long file while the others idle. Why a table and
not the test count: a docker file of two tests takes minutes, a file of twenty pure tests a second.
A file missing from the table is placed as a file of median cost; a stale table only costs balance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from file_order import COSTS, file_costs  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    costs = file_costs(Path(sys.argv[1]).read_text(errors="replace").splitlines())
    if not costs:
        sys.exit(f"no durations in {sys.argv[1]}: run pytest with --durations=0 (and without -q -q)")
    for f in sorted(ROOT.glob("tests/test_*.py")):  # pytest hides tests under 5 ms: such a file costs ~0
        costs.setdefault(str(f.relative_to(ROOT)), 0.0)
    COSTS.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"{COSTS}: {len(costs)} files, {sum(costs.values()):.0f} s in all; heaviest "
          + ", ".join(f"{Path(f).name} {s:.0f} s" for f, s in list(costs.items())[:5]))


if __name__ == "__main__":
    main()
