"""Import each dashboard module alone, in a fresh interpreter: an import loop or a missing
name shows up as that module's failure (what importing it first in a process would hit).

    .venv/bin/python scripts/check_dashboard_imports.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

DASH = Path(__file__).resolve().parents[1] / "dashboard"
SKIP = {"app", "__init__"}  # app.py is the Streamlit script (it renders on import)


def main() -> int:
    failed = 0
    for p in sorted(DASH.glob("*.py")):
        if p.stem in SKIP:
            continue
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", f"import prefect_launch.dashboard.{p.stem}"], capture_output=True, text=True)
        took = time.perf_counter() - t
        if r.returncode:
            failed += 1
            print(f"FAIL {p.stem} ({took:.1f} s)\n{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
        else:
            print(f"ok   {p.stem} ({took:.1f} s)")
    print(f"{failed} module(s) failed to import alone")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
