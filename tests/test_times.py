"""One parser of durations and times (prefect_launch/times.py) and every CLI option that takes a time.

Pure: no Prefect server. The CLI tests walk the Typer app, so a new ``--since`` / ``--until`` /
``--starts-at`` option that does not use the shared parser fails here.
"""

from __future__ import annotations

import inspect
import re
from datetime import datetime, timedelta, timezone

import pytest
import typer
from typer.testing import CliRunner

from prefect_launch.times import (DURATION_FORMS, TIME_FORMS, duration_seconds, format_duration, parse_duration,
                                  parse_when, when_problem)
from prefect_launch.workers.scheduling.resources import LaunchValidationError

UTC = timezone.utc
NOW = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("text, seconds", [
    ("90", 90), ("90s", 90), ("90S", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1h 30m", 5400),
    (" 2d ", 172800), ("2w", 14 * 86400), ("1w2d3h4m5s", 7 * 86400 + 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
    ("1.5h", 5400), ("0.5s", 0.5), ("2.5", 2.5), (45, 45), (2.5, 2.5), (timedelta(minutes=3), 180),
])
def test_parse_duration_reads_every_form(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "", " ", "-5", "-5m", "0", "0s", "5x", "h", "1h-30m", "1h30", "m30",
                                 "1,5h", "1e3", "inf", "nan", "2026-03-01", True, None, -1, 0, float("inf")])
def test_parse_duration_refuses_what_is_not_a_positive_duration(bad):
    with pytest.raises(LaunchValidationError, match=r"^timeout (must be|.* is too long)"):
        parse_duration(bad, "timeout")


def test_bad_duration_says_what_to_write():
    with pytest.raises(ValueError) as exc:  # LaunchValidationError is a ValueError: pydantic validators use it
        parse_duration("soon", "preempt_grace")
    assert str(exc.value) == f"preempt_grace must be a duration like {DURATION_FORMS}, got 'soon'"
    with pytest.raises(LaunchValidationError, match="too long"):
        parse_duration("99999999999w")


def test_duration_seconds_none_is_no_limit():
    assert duration_seconds(None) is None and duration_seconds("") is None
    with pytest.raises(LaunchValidationError, match="^idle duration must be positive"):
        duration_seconds("0m", "idle duration")


@pytest.mark.parametrize("value, text", [
    (0, "0s"), (3, "3s"), (59.6, "1m"), (90, "1m30s"), (5400, "1h30m"), (3600, "1h"), (3601, "1h1s"),
    (2 * 86400, "48h"), (timedelta(minutes=90), "1h30m"),
])
def test_format_duration(value, text):
    assert format_duration(value) == text
    if text != "0s":
        assert parse_duration(text) == timedelta(seconds=round(value.total_seconds() if isinstance(value, timedelta)
                                                               else value))


@pytest.mark.parametrize("text, want", [
    ("2w", NOW - timedelta(weeks=2)),
    ("1h30m", NOW - timedelta(hours=1, minutes=30)),
    ("90s", NOW - timedelta(seconds=90)),
    ("90", NOW - timedelta(seconds=90)),
    ("1.5h", NOW - timedelta(hours=1.5)),
    ("1d 12h", NOW - timedelta(days=1, hours=12)),
    ("7D", NOW - timedelta(days=7)),
    ("0s", NOW),
    ("2026-03-01", datetime(2026, 3, 1, tzinfo=UTC)),
    ("20260301", datetime(2026, 3, 1, tzinfo=UTC)),  # ISO first: a basic date, not seconds
    ("2026", NOW - timedelta(seconds=2026)),  # not a date: a plain number is seconds
    ("2026-03-01T12:00", datetime(2026, 3, 1, 12, tzinfo=UTC)),  # no offset: UTC
    ("2026-03-01 12:00:05", datetime(2026, 3, 1, 12, 0, 5, tzinfo=UTC)),
    ("2026-03-01T12:00Z", datetime(2026, 3, 1, 12, tzinfo=UTC)),
    ("2026-03-01T12:00:00z", datetime(2026, 3, 1, 12, tzinfo=UTC)),
    ("2026-03-01T12:00:00+02:00", datetime(2026, 3, 1, 10, tzinfo=UTC)),
    (" 2026-03-01T12:00:00.250-05:30 ", datetime(2026, 3, 1, 17, 30, 0, 250000, tzinfo=UTC)),
    (datetime(2026, 1, 2), datetime(2026, 1, 2, tzinfo=UTC)),
])
def test_parse_when_reads_iso_times_and_durations_ago(text, want):
    got = parse_when(text, NOW)
    assert got == want and got.tzinfo is not None


def test_parse_when_ahead_reads_a_duration_from_now_and_iso_the_same():
    assert parse_when("1h", NOW, ahead=True) == NOW + timedelta(hours=1)
    assert parse_when("1h30m", NOW, ahead=True) == NOW + timedelta(minutes=90)
    assert parse_when("2026-12-01T09:00:00Z", NOW, ahead=True) == datetime(2026, 12, 1, 9, tzinfo=UTC)
    assert parse_when("2h", NOW.replace(tzinfo=None)) == NOW - timedelta(hours=2)  # a naive now is UTC too


def test_parse_when_defaults_now_to_the_clock():
    before = datetime.now(UTC)
    got = parse_when("1h")
    assert before - timedelta(hours=1) <= got <= datetime.now(UTC) - timedelta(hours=1)


BAD_TIMES = ["soon", "", "   ", "yesterday", "-5d", "+5m", "1h-30m", "5x", "12:00", "2026-13-01", "2026-02-30",
             "2026-3-1", "in 10m", "10m ago", None]


@pytest.mark.parametrize("bad", BAD_TIMES)
def test_parse_when_refuses_with_the_accepted_forms(bad):
    with pytest.raises(LaunchValidationError) as exc:
        parse_when(bad, NOW, what="--since")
    assert str(exc.value) == f"--since {bad!r} is not a time: give {TIME_FORMS} or a duration ago like {DURATION_FORMS}"
    with pytest.raises(LaunchValidationError, match="or a duration from now like"):
        parse_when(bad, NOW, what="starts-at", ahead=True)


def test_parse_when_too_far():
    with pytest.raises(LaunchValidationError, match="too far back"):
        parse_when("99999999w", NOW)


def test_times_module_imports_no_prefect():
    import subprocess
    import sys

    code = ("import sys, prefect_launch.times; "
            "print(sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------- every CLI option
TIME_FLAGS = ("--since", "--until", "--starts-at")
GOOD = {"2w": timedelta(weeks=2), "1h30m": timedelta(minutes=90), "90s": timedelta(seconds=90),
        "2026-03-01": datetime(2026, 3, 1, tzinfo=UTC),
        "2026-03-01T12:00:00+02:00": datetime(2026, 3, 1, 10, tzinfo=UTC)}
# least arguments each command needs to get as far as parsing its options
NEEDS = {"history": ["some-run"], "report": [], "session start": ["--queue", "q", "--type", "batch"]}
# what each command reaches after its options parse (the stub below ends it there): a server or the store
STUB_MESSAGE = "stub: the options parsed"


def _time_options() -> list[tuple[str, str, object]]:
    """(command path, flag, parser) of every time option of the `prefect-launch` app and its sub-apps."""
    from prefect_launch.cli import app

    out = []

    def walk(t: typer.Typer, prefix: str) -> None:
        for cmd in t.registered_commands:
            name = f"{prefix}{cmd.name or cmd.callback.__name__}".strip()
            for p in inspect.signature(cmd.callback).parameters.values():
                decls = getattr(p.default, "param_decls", None) or ()
                for flag in set(decls) & set(TIME_FLAGS):
                    out.append((name, flag, p.default.parser))
        for group in t.registered_groups:
            walk(group.typer_instance, f"{prefix}{group.name} ")

    walk(app, "")
    return sorted(out, key=lambda o: (o[0], o[1]))


def test_every_time_option_uses_the_shared_parser():
    from prefect_launch.cli_common import starts_at_option, time_option

    opts = _time_options()
    found = {(c, f) for c, f, _ in opts}
    assert {("history", "--since"), ("history", "--until"), ("report", "--since"), ("report", "--until"),
            ("session start", "--starts-at")} <= found, found
    for cmd, flag, parser in opts:
        want = starts_at_option if flag == "--starts-at" else time_option
        assert parser is want, f"`{cmd} {flag}` must use prefect_launch.cli_common.{want.__name__}"
        assert cmd in NEEDS, f"add `{cmd}` to NEEDS (the arguments it needs to reach its options)"


@pytest.mark.parametrize("text", list(GOOD))
def test_every_time_option_reads_the_same_inputs(text):
    before = datetime.now(UTC)
    for cmd, flag, parser in _time_options():
        got = parser(text)
        after = datetime.now(UTC)
        want = GOOD[text]
        if flag == "--starts-at":  # kept as written (read at submission), checked as a time ahead
            assert got == text, (cmd, flag, got)
            got = parse_when(got, ahead=True)
            if isinstance(want, timedelta):
                assert before + want <= got <= datetime.now(UTC) + want, (cmd, flag, got)
            else:
                assert got == want, (cmd, flag, got)
        elif isinstance(want, timedelta):
            assert isinstance(got, datetime) and before - want <= got <= after - want, (cmd, flag, got)
        else:
            assert got == want and got.tzinfo is not None, (cmd, flag, got)


def _plain(output: str) -> str:
    """The CLI's output without Rich's box and line wrapping."""
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", output)).strip()


@pytest.fixture
def stubbed(monkeypatch):
    """Commands end with STUB_MESSAGE (exit 2) where they would reach the server or the metrics store."""
    import contextlib

    from prefect_launch import cli, cli_common, session_cli
    from prefect_launch.dashboard import metrics_source

    @contextlib.contextmanager
    def no_server():
        cli_common.fail(STUB_MESSAGE)
        yield

    for mod in (cli, session_cli):
        monkeypatch.setattr(mod, "prefect_client", no_server)
    monkeypatch.setattr(metrics_source, "metrics_store", lambda: cli_common.fail(STUB_MESSAGE))
    from prefect_launch.cli import app

    return app


@pytest.mark.parametrize("text", list(GOOD))
def test_every_time_option_accepts_the_inputs_on_the_command_line(stubbed, text):
    for cmd, flag, _ in _time_options():
        res = CliRunner().invoke(stubbed, [*cmd.split(), *NEEDS[cmd], flag, text])
        out = _plain(res.output)
        assert res.exit_code == 2 and STUB_MESSAGE in out, (cmd, flag, text, out)


def test_every_time_option_refuses_a_bad_input_with_the_same_message(stubbed):
    messages = {}
    for cmd, flag, parser in _time_options():
        with pytest.raises(typer.BadParameter) as exc:
            parser("soon")
        ahead = flag == "--starts-at"
        assert str(exc.value) == when_problem("soon", ahead=ahead)
        res = CliRunner().invoke(stubbed, [*cmd.split(), *NEEDS[cmd], flag, "soon"])
        out = _plain(res.output)
        assert res.exit_code == 2 and STUB_MESSAGE not in out, (cmd, flag, out)
        assert f"Invalid value for '{flag}': {when_problem('soon', ahead=ahead)}" in out, (cmd, flag, out)
        messages[(cmd, flag)] = str(exc.value).replace("from now", "ago")
    assert len(set(messages.values())) == 1, messages


def test_session_checks_read_starts_at_with_the_same_parser():
    """The Sessions page and the Python API go through deployments.sessions.check, not the CLI's parser."""
    from prefect_launch.deployments.sessions import SessionRequest, check

    for text in GOOD:
        problems, _ = check(SessionRequest(type="batch", queue="q", startup_command="true", starts_at=text), NOW)
        assert problems == [], (text, problems)
    problems, _ = check(SessionRequest(type="batch", queue="q", startup_command="true", starts_at="soon"), NOW)
    assert problems == [f"starts-at {when_problem('soon', ahead=True)}"]
