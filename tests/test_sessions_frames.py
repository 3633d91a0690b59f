"""The Sessions page's data shaping (dashboard/sessions_frames.py): pure, no server."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from prefect_launch.dashboard import sessions_frames as F
from prefect_launch.deployments.session_recent import RecentEntry
from prefect_launch.deployments.session_view import SessionRow
from prefect_launch.deployments.sessions import SessionRequest, SessionStarted, check

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=timezone.utc)


def _form(**kw) -> dict:
    return F.empty_form() | {"queue": "q1"} | kw


def test_form_reads_into_a_request_and_back():
    form = _form(type="batch", name="my-run", startup_command="python train.py", timeout="30m", cpu="2",
                 memory="4Gi", gpu="1", count="2", env="A=1\n\n B=two words \n", mounts="/data:/in\n/out:/out",
                 ports="8888, 8889 9000", omp_threads="3")
    req, errors = F.request_from_form(form, owner="alice")
    assert errors == {}
    assert req == SessionRequest(type="batch", queue="q1", name="my-run", startup_command="python train.py",
                                 timeout="30m", cpu=2.0, memory="4Gi", gpu=1, count=2, env=["A=1", "B=two words"],
                                 mounts=["/data:/in", "/out:/out"], ports=[8888, 8889, 9000], omp_threads=3,
                                 owner="alice")
    back = F.form_from_request(req.model_dump(exclude_none=True))
    assert F.request_from_form(back, owner="alice") == (req, {})
    assert back["cpu"] == "2" and back["ports"] == "8888, 8889, 9000"


def test_interactive_drops_batch_only_fields_and_blank_is_none():
    req, errors = F.request_from_form(_form(type="interactive", startup_command="echo hi", starts_at="1h",
                                            timeout="5m", name="  ", preset=""))
    assert errors == {}
    assert (req.startup_command, req.starts_at, req.timeout, req.name, req.preset) == (None,) * 5


def test_unreadable_fields_are_reported_by_field_and_the_rest_still_checked():
    req, errors = F.request_from_form(_form(queue="", cpu="two", gpu="1.5", ports="8888, abc", count="x",
                                            name="x!"))
    assert set(errors) == {"queue", "cpu", "gpu", "ports", "count"}
    assert "'abc'" in errors["ports"][0] and "'two'" in errors["cpu"][0]
    # what could not be read is left at its default; check() still sees the name
    assert req.cpu is None and req.ports == [] and req.count == 1
    problems, _ = check(req, NOW)
    assert F.field_errors(problems)["name"][0].startswith("name 'x!'")


def test_every_check_message_lands_on_its_field():
    bad = SessionRequest(type="interactive", queue="q", name="x!", startup_command="true", starts_at="1h",
                         timeout="5m", ports=[80, 8888, 8888], env=["1BAD=x", "A=1", "A=2", "novalue"],
                         mounts=["relative:/data", "/a:/x", "/b:/x"], omp_threads=0, count=0)
    problems, warnings = check(bad, NOW)
    by_field = F.field_errors(problems)
    assert "general" not in by_field, by_field.get("general")
    assert set(by_field) == {"name", "count", "startup_command", "starts_at", "timeout", "ports", "env", "mounts",
                             "omp_threads"}
    assert len(by_field["ports"]) == 2 and len(by_field["env"]) == 3 and len(by_field["mounts"]) == 2
    batch, _ = check(SessionRequest(type="batch", queue="q", starts_at="soon", timeout="forever"), NOW)
    got = F.field_errors(batch)
    assert set(got) == {"startup_command", "starts_at", "timeout"}, got
    # messages from start_session and the job path (deployments/submit, workers/resolve)
    for msg, field in (
        ("name 'abcd' is taken by another live session of bob; pick another --name or terminate that one", "name"),
        ("--image 'x' needs a docker queue; queue 'q' runs sessions as processes", "image"),
        ("unknown preset 'huge' in the submission for queue 'q'; choose one of: big, small", "preset"),
        ("unknown queue 'nope'; list queues with `prefect-launch queue ls`", "queue"),
        ("queue 'q' has no session deployment; run `prefect-launch queue apply FILE` again", "queue"),
        ("cpu must be positive in the submission, got -1.0", "cpu"),
        ("gpu must be a whole number in the submission, got '1.5'", "gpu"),
        ("malformed memory '4 gigs': use a number with an optional unit, e.g. 512Mi, 4Gi, 2G", "memory"),
        ("shm_size (2147483648 bytes) is larger than memory (1073741824 bytes); lower --shm-size", "shm_size"),
        ("out of bounds for queue 'q': cpu 64 > max 8", "resources"),
        ("beyond any agent's total capacity on queue 'q': needs gpu=4 (agent a has 2 in total)", "resources"),
        ("unknown agent 'z' for queue 'q'; agents serving it: a", "general"),
        ("cluster_size must be at least 1 in the submission, got 0", "cluster_size"),
        ("cluster runs are not supported on kubernetes queues yet; use a process queue", "cluster_size"),
        ("cluster_mode must be one of single-node, multi-node in the submission, got 'x'", "cluster_mode"),
        ("cluster mode 'multi-node' is not supported on docker queues yet; use --cluster-mode single-node",
         "cluster_mode"),
    ):
        assert F.field_of(msg) == field, msg


def test_errors_block_only_their_own_and_earlier_steps():
    errors = {"name": ["n"], "ports": ["p"], "general": ["g"]}
    assert F.errors_through(errors, 0) == {"name": ["n"]}
    assert F.errors_through({"ports": ["p"]}, 2) == {}
    assert F.errors_through(errors, 3) == {"name": ["n"], "ports": ["p"]}
    assert F.first_step_with_errors({"ports": ["p"], "env": ["e"]}) == 1
    assert F.first_step_with_errors({}) is None
    assert F.merge_errors({"a": ["x"]}, {"a": ["x", "y"], "b": ["z"]}) == {"a": ["x", "y"], "b": ["z"]}
    assert [F.FIELD_STEP[f] for f in ("name", "queue", "mounts", "ports")] == [0, 1, 2, 3]


def test_review_rows_show_what_the_dry_run_resolved():
    req = SessionRequest(type="batch", queue="q", name="abc-1", startup_command="true", count=2)
    planned = SessionStarted(run_ids=[], names=["abc-1-1", "abc-1-2"], type="batch", queue="q", preset="small",
                             resources="cpu=1 memory=1Gi", ports=[], timeout_s=30.0, warnings=["no --mount"],
                             dry_run=True)
    rows = dict(F.review_rows(req, planned).itertuples(index=False))
    assert rows["names"] == "abc-1-1, abc-1-2" and rows["preset"] == "small" and rows["timeout"] == "30 s"
    assert rows["mounts"].startswith("none") and rows["count"] == "2"
    before = dict(F.review_rows(SessionRequest(queue="q"), None).itertuples(index=False))
    assert before["preset"] == "(queue default)" and before["names"].startswith("(a readable")
    assert "cluster" not in before and "preemptible" not in before
    # a cluster session, preemptible: read from the form, shown per member, and back for a relaunch
    req, errors = F.request_from_form(_form(type="batch", startup_command="true", cluster_size="3",
                                            cluster_mode="multi-node", preemptible="True"), owner="a")
    assert errors == {} and (req.cluster_size, req.cluster_mode, req.preemptible) == (3, "multi-node", True)
    rows = dict(F.review_rows(req, None).itertuples(index=False))
    assert rows["cluster"].startswith("3 members (multi-node): main1, sub1, sub2") and rows["preemptible"].startswith("yes")
    back = F.form_from_request(req.model_dump(exclude_none=True))
    assert back["cluster_size"] == "3" and back["preemptible"] == "True"
    assert F.request_from_form(back, owner="a") == (req, {})
    bad, errors = F.request_from_form(_form(type="batch", startup_command="true", cluster_size="two"), owner="a")
    assert "cluster_size" in errors and bad.cluster_size is None


def _row(**kw) -> SessionRow:
    base = dict(id="0123456789abcdef", name="calm-otter-0001", owner="alice", status="Running", type="batch",
                queue="q", resources="cpu=1", agent="a1", elapsed_s=75.0)
    return SessionRow(**(base | kw))


def test_sessions_frame_and_labels():
    rows = [_row(), _row(id="ffff0000aaaa", name="wait-here", status="Scheduled", elapsed_s=None, waited_s=200.0,
                         position=2, eta=NOW + timedelta(minutes=3), reason="needs 1 GPU"),
            _row(id="dead", name="<b>x</b>", status="Completed", type=None, elapsed_s=7200.0)]
    df = F.sessions_frame(rows)
    assert list(df.columns) == F.SESSION_COLUMNS
    assert df["time"].tolist() == ["ran 1m15s", "waited 3m20s", "ran 2h"]
    assert df["position"].tolist()[1] == 2 and df["eta"].tolist()[1] == "12:03:00"
    assert df["name"].tolist()[2] == "'<b>x</b>'"  # not a valid name: shown quoted, as data
    assert F.session_label(rows[1]) == "wait-here · Scheduled · ffff0000"
    assert F.sessions_frame([]).empty
    assert F.is_live("Running") and F.is_live("Late") and not F.is_live("Cancelled")


def _fr(**kw):
    state = SimpleNamespace(message=kw.pop("message", None))
    return SimpleNamespace(job_variables={"env": {"A": "1"}}, parameters={"mounts": ["/d:/d"], "startup_command": "x"},
                           labels={"launch.placement": "agent a1: cores 0"}, state=state, **kw)


def test_detail_mirrors_session_show_and_app_links_are_validated():
    good = "http://127.0.0.1:8890/lab?token=Abc_def-123456789"
    bad = ["javascript:alert(1)", "http://0.0.0.0:8890/lab?token=Abc_def-123456789",
           "http://127.0.0.1:80/lab?token=Abc_def-123456789", "http://127.0.0.1:8890/lab?token=a&x=<script>",
           "http://127.0.0.1:8890/tree?token=Abc_def-123456789", "https://127.0.0.1:8890/lab?token=Abc_def-123456789",
           "http://evil.example:8890/lab?token=Abc_def-123456789", "http://127.0.0.1:8890/lab?token=\"><b",
           "http://u@127.0.0.1:8890/lab?token=Abc_def-123456789", "http://127.0.0.1:8890/lab?token=Abc_def-123456789\n"]
    detail = F.session_detail(_fr(), _row(type="interactive", ports=[8890]), [good, *bad], usage={"avg_cpu_pct": 3.5})
    assert detail["env"] == {"A": "1"} and detail["mounts"] == ["/d:/d"] and detail["allocation"] == "agent a1: cores 0"
    assert F.safe_app_url(good) == good and all(F.safe_app_url(b) is None for b in bad)
    assert F.app_links(detail, viewer_is_owner=True) == [{"app": "JupyterLab", "port": "8890", "url": good}]
    assert F.app_links(detail, viewer_is_owner=False)[0]["url"] == "http://127.0.0.1:8890/lab?token=…"
    table = dict(F.detail_frame(detail).itertuples(index=False))
    assert table["env"] == "A=1" and table["elapsed"] == "1m15s" and table["cpu mean %"] == "3.5"
    assert "app_urls" not in table and "token" not in " ".join(table.values())
    assert "launched by" not in table  # launched by its owner
    on_behalf = F.detail_frame(F.session_detail(_fr(), _row(launched_by="root"), []))
    assert dict(on_behalf.itertuples(index=False))["launched by"] == "root"  # an admin launched it for alice


def test_plain_escapes_markdown_and_html():
    s = F.plain('<img src=x onerror="1"> [click](javascript:alert(1)) **b** `c`\x07')
    assert "<img" not in s and "](" not in s and "**" not in s and "`c`" not in s and "\x07" not in s
    assert F.plain("x" * 500, limit=10).endswith("…")
    assert F.one_line("a\nb\tc" + "x" * 200, 10) == "a b cxxxx…"
    assert F.plain("name 'ab': a & b") == "name 'ab'\\: a &amp; b"
    assert F.shown_name("ok-name") == "ok-name" and F.shown_name("a\x1b[31mb") == "'a[31mb'"


def test_idle_rows_from_session_show_and_from_the_end_reason():
    """What `session show` gives (session_view.idle_checks_of on the agent's ``launch.idle`` label)."""
    import json

    from prefect_launch.deployments.session_view import idle_checks_of
    from prefect_launch.workers.metrics.idle_checks import IdleChecker, IdlePolicy, UtilizationPolicy
    from prefect_launch.workers.agent.tags import IDLE_LABEL

    assert F.idle_rows({}).empty and F.idle_note({}) == ""
    t0 = NOW.timestamp()
    checker = IdleChecker(IdlePolicy(max_lifetime="10m", network_idle_timeout="2m",
                                     utilization=UtilizationPolicy(grace_period="1m", window="2m", cpu=5)),
                          started=t0, session_type="interactive")
    fr = SimpleNamespace(labels={IDLE_LABEL: json.dumps(checker.status(t0))},
                         state=SimpleNamespace(type=SimpleNamespace(value="RUNNING"), message=None))
    shown = idle_checks_of(fr, NOW + timedelta(seconds=30))
    rows = F.idle_rows({"idle_checks": shown}).to_dict("records")
    assert [r["check"] for r in rows] == ["session_lifetime", "network_timeout", "utilization"]
    assert [r["time left"] for r in rows] == ["9m30s", "1m30s", "30s"]
    assert rows[0]["status"].startswith("limit 10m") and "grace period" in rows[2]["status"]
    assert F.idle_note({"idle_checks": shown}).startswith("(as judged by the agent")
    ended = F.idle_rows({"state_message": "idle-timeout: no connection to the session's apps for 30s"})
    assert ended["check"].tolist() == ["idle-timeout"] and ended["status"][0].startswith("reclaimed")


def _rec(i, phase, result, attempts=1, subs=(), code=None):
    return {"id": f"r{i}", "run_id": "run", "phase": phase, "result": result, "from_state": "SCHEDULED",
            "to_state": "PENDING" if result == "SUCCESS" else None, "error_code": code, "message": f"m{i}",
            "attempts": attempts, "created": NOW + timedelta(seconds=i), "updated": (NOW + timedelta(seconds=i + 5)).isoformat(),
            "substeps": list(subs)}


def test_history_filter_table_and_substeps():
    subs = [{"name": "capacity check", "result": "FAILURE", "message": "needs 1 GPU, 0 free", "started": NOW,
             "ended": NOW + timedelta(milliseconds=3)}, SimpleNamespace(name="sequencing", result="SUCCESS", message="",
                                                                          started=None, ended=None)]
    recs = [_rec(0, "schedule", "NEED_RETRY", attempts=7, subs=subs, code="capacity"), _rec(1, "schedule", "SUCCESS"),
            SimpleNamespace(**_rec(2, "start", "SUCCESS"))]
    assert F.filter_history(recs) == recs
    assert F.filter_history(recs, phases=["schedule"], results=["SUCCESS"]) == [recs[1]]
    assert F.filter_history(recs, results=["FAILURE"]) == []
    df = F.history_frame(recs)
    assert list(df.columns) == F.HISTORY_COLUMNS
    assert df["attempts"].tolist() == [7, 1, 1] and df["substeps"].tolist() == [2, 0, 0]
    assert df["updated"][0] == NOW + timedelta(seconds=5) and df["to"][1] == "PENDING"
    sub = F.substeps_frame(recs[0])
    assert sub["step"].tolist() == ["capacity check", "sequencing"] and sub["result"][0] == "FAILURE"
    assert F.history_title(recs[0]) == "schedule · NEED_RETRY · capacity · x7 · 12:00:05"
    assert F.record_message(recs[2]) == "m2"


def test_history_of_the_stores_own_records():
    """The records `blocks/scheduling_history.read_history` returns (when that module is installed)."""
    H = pytest.importorskip("prefect_launch.blocks.scheduling_history")
    rec = H.SchedulingRecord(run_id="r", phase="schedule", result="NEED_RETRY", error_code="no-capacity",
                             message="needs 1 GPU, 0 free", attempts=3, created=NOW,
                             sub_steps=[H.SubStep(step="capacity_check", result="FAILURE", message="0 free",
                                                  started=NOW, ended=NOW + timedelta(milliseconds=2))])
    row = F.history_frame([rec]).to_dict("records")[0]
    assert (row["phase"], row["result"], row["attempts"], row["substeps"], row["error code"]) == \
        ("schedule", "NEED_RETRY", 3, 1, "no-capacity")
    sub = F.substeps_frame(rec).to_dict("records")[0]
    assert (sub["step"], sub["result"], sub["message"], round(sub["took ms"])) == ("capacity_check", "FAILURE", "0 free", 2)
    assert F.filter_history([rec], phases=["start"]) == [] and F.filter_history([rec], results=["NEED_RETRY"]) == [rec]


def test_recent_frame_and_relaunch_request():
    e = RecentEntry(id="abcd1234", label="batch nightly on q", created=NOW, pinned=True,
                    request={"type": "batch", "queue": "q", "name": "nightly", "startup_command": "true",
                             "owner": "someone-else"})
    df = F.recent_frame([e])
    assert df.to_dict("records")[0] | {"created": None} == {"id": "abcd1234", "pinned": True, "label": "batch nightly on q",
                                                           "type": "batch", "queue": "q", "name": "nightly",
                                                           "created": None}
    req = F.relaunch_request(e, owner="alice")
    assert req.name is None and req.owner == "alice" and req.startup_command == "true"
    assert F.relaunch_request(e, "alice", name="again-1").name == "again-1"


@pytest.mark.parametrize("s,out", [(None, "-"), (5, "5s"), (600, "10m"), (5400, "1h30m"), (-3, "0s")])
def test_fmt_seconds(s, out):
    assert F.fmt_seconds(s) == out
