"""Every ``LAUNCH_*`` variable is in docs/configuration.md's one table, where the table says it is read,
with one suffix convention, and none is read at import (pure: reads the tree)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE_DIRS = ("workers", "dashboard", "deployments", "flows", "blocks", "prefect_launch")
NAME = re.compile(r"\bLAUNCH_[A-Z0-9_]*[A-Z0-9]\b")
# an environment variable in code: a quoted name, a keyword of env.update(...), or a shell $NAME / NAME=
ENV_USE = re.compile(r"""["'](LAUNCH_[A-Z0-9_]*[A-Z0-9])["'=]|\b(LAUNCH_[A-Z0-9_]*[A-Z0-9])=|\$\{?(LAUNCH_[A-Z0-9_]*[A-Z0-9])""")
# read once per process on purpose: objects the monitor's threads share, built at import (a semaphore's size,
# the page keeper's keep time) cannot change while the process runs
AT_IMPORT_ALLOWED = {("dashboard/api.py", "LAUNCH_DASHBOARD_HISTORY_SLOTS"),
                     ("dashboard/page_data.py", "LAUNCH_MONITOR_KEEP_SECONDS")}


def code_files() -> list[pathlib.Path]:
    """The package, its scripts and the test harness (which has a few of its own, e.g. LAUNCH_DOCKER_CACHE);
    not this checker, whose names are examples."""
    return ([p for d in CODE_DIRS + ("tests",) for p in (ROOT / d).rglob("*.py") if p.name != pathlib.Path(__file__).name]
            + list((ROOT / "scripts").glob("*.sh")))


def rows() -> list[tuple[list[str], str]]:
    """The table's rows: the variables each names, and its 'read (or set) in' cell."""
    out = []
    for line in (ROOT / "docs/configuration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`LAUNCH_"):
            out.append((NAME.findall(cells[0]), cells[3]))
    return out


def table() -> dict[str, str]:
    return {name: where for names, where in rows() for name in names}


def test_every_variable_the_code_reads_is_in_the_table_and_nothing_else():
    in_code = {n for p in code_files() for m in ENV_USE.findall(p.read_text()) for n in m if n}
    documented = set(table())
    assert not in_code - documented, f"add these to docs/configuration.md: {sorted(in_code - documented)}"
    assert not documented - in_code, f"no code reads these any more: {sorted(documented - in_code)}"


def test_the_table_names_files_that_really_read_each_variable():
    wrong = []
    for names, where in rows():
        for path in re.findall(r"`([\w.-]+/[\w/.-]+\.(?:py|sh))`", where):
            f = ROOT / path
            if not f.exists() or not any(n in f.read_text() for n in names):  # a row of several: any of them
                wrong.append(f"{names[0]}: {path}")
    assert not wrong, "docs/configuration.md names files that do not read these: " + ", ".join(wrong)


def test_durations_end_in_seconds():
    odd = [n for n in table() if re.search(r"_(S|SECS|SEC|MS|TIMEOUT)$", n)]
    assert not odd, f"durations are LAUNCH_*_SECONDS: {odd}"


def test_no_launch_variable_is_read_at_import():
    found = []
    for p in code_files():
        if p.suffix != ".py" or p.parts[len(ROOT.parts)] == "tests":
            continue
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                text = ast.get_source_segment(p.read_text(), node.value) or ""
                if "environ" in text or "getenv" in text:
                    for name in NAME.findall(text):
                        rel = str(p.relative_to(ROOT))
                        if (rel, name) not in AT_IMPORT_ALLOWED:
                            found.append(f"{rel}:{node.lineno} {name}")
    assert not found, "read these where they are used (prefect_launch/settings.py), not at import: " + ", ".join(found)


@pytest.mark.parametrize("reader, raw, expected", [
    ("env_seconds", "2.5", 2.5), ("env_seconds", "", 1.0), ("env_seconds", None, 1.0),
    ("env_int", "7", 7), ("env_int", " ", 1), ("env_int", None, 1),
])
def test_settings_read_the_variable_or_its_default(monkeypatch, reader, raw, expected):
    from prefect_launch import settings

    if raw is None:
        monkeypatch.delenv("LAUNCH_TEST_VALUE", raising=False)
    else:
        monkeypatch.setenv("LAUNCH_TEST_VALUE", raw)
    assert getattr(settings, reader)("LAUNCH_TEST_VALUE", 1) == expected


@pytest.mark.parametrize("reader, raw, says", [
    ("env_seconds", "ten", "is not a number of seconds"), ("env_int", "2.5", "is not a whole number"),
])
def test_a_bad_setting_names_the_variable_and_what_to_give(monkeypatch, reader, raw, says):
    from prefect_launch import settings

    monkeypatch.setenv("LAUNCH_TEST_VALUE", raw)
    with pytest.raises(ValueError, match=f"LAUNCH_TEST_VALUE='{raw}' {says}; unset it or give e.g. LAUNCH_TEST_VALUE=1"):
        getattr(settings, reader)("LAUNCH_TEST_VALUE", 1)
