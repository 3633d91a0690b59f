"""Page logic of the queue monitor with Streamlit's AppTest, against a real Prefect server."""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest
from streamlit.testing.v1 import AppTest

from fixtures_dashboard import captions, choose, figures, fresh_app, headings, seed_runs, tables
from prefect_launch.blocks.queue_links import QueueLink, QueueLinks, validate_url

PANELS = ["Queue summary", "Job status", "Queued time", "Job runs", "GPU use by job", "CPU use by job",
          "GPU memory by job", "System memory by job", "Runs that waste hardware", "Cost and waste", "Errors",
          "External Links"]
FIRST = ["Queue summary", "Job status", "Queued time"]  # always drawn, above the section control
# the sections below them, one drawn at a time (the first by default), then External Links
SECTIONS = {"Job runs": ["Job runs"], "Resource use": ["GPU use by job", "CPU use by job", "GPU memory by job",
                                                       "System memory by job", "Runs that waste hardware"],
            "Cost and waste": ["Cost and waste"], "Errors": ["Errors"]}


@pytest.fixture(scope="module")
def seeded(prefect_server):
    return seed_runs(uuid.uuid4().hex[:6])


def _app() -> AppTest:
    return fresh_app()


def _table(at: AppTest, *cols: str):
    """The first dataframe on the page that has these columns."""
    for d in tables(at):
        if all(c in d.columns for c in cols):
            return d
    raise AssertionError(f"no table with columns {cols}")


def _pool_runs(pool: str) -> list:
    """Every flow run of the work pool ``pool``, as Prefect holds it."""
    from prefect import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])), limit=200)


def _captions(at: AppTest) -> str:
    return captions(at)


def _section(at: AppTest, name: str) -> AppTest:
    choose(at, "section", [name])
    return at.run()


def test_page_renders_every_panel_and_follows_the_sidebar(seeded):
    at = _app().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [h for h in headings(at) if h in PANELS] == FIRST + SECTIONS["Job runs"] + ["External Links"]
    assert "grouping job · read at" in _captions(at)  # nothing filtered: no filter named
    seen = set()
    for name, panels in SECTIONS.items():  # every panel one choice away, only the chosen section drawn
        _section(at, name)
        assert not at.exception, [e.value for e in at.exception]
        assert [h for h in headings(at) if h in PANELS] == FIRST + panels + ["External Links"], name
        seen.update(panels)
    assert seen | set(FIRST) | {"External Links"} == set(PANELS)
    _section(at, "Job runs")

    choose(at, "queues", [seeded.pool]).run()
    choose(at, "grouping", ["owner"]).run()
    choose(at, "range", ["Last 1 hour"]).run()
    assert not at.exception, [e.value for e in at.exception]
    caps = _captions(at)
    assert "grouping owner" in caps and "interval 1 min" in caps and f"queues {seeded.pool} · read at" in caps
    runs_table = _table(at, "priority", "link")
    assert set(runs_table["queue"]) == {seeded.pool}
    # the headline figures against the runs' own records in Prefect (state now, expected start in range)
    shown, own = figures(at), _pool_runs(seeded.pool)
    hour_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    assert shown["Running now"] == str(sum(r.state_type.value == "RUNNING" for r in own)) != "0"
    assert shown["Queued now"] == str(sum(r.state_type.value == "SCHEDULED" for r in own)) != "0"
    assert shown["Runs in range"] == f"{sum(r.expected_start_time >= hour_ago for r in own):,}"
    assert shown["Queues busy now"] == "1 / 1"
    assert set(runs_table["owner"]) == set(seeded.owners)
    assert all(link.endswith(f"/runs/flow-run/{i}") for link, i in zip(runs_table["link"], runs_table["link"].str.rsplit("/", n=1).str[-1]))
    errors = _table(_section(at, "Errors"), "message", "link")
    assert len(errors) == len(seeded.failed_ids)

    # a filter narrows the panels
    choose(at, "f_owners", ["alice"]).run()
    choose(at, "f_statuses", ["failed"]).run()
    assert not at.exception
    assert set(_table(at, "message", "link")["owner"]) == {"alice"}
    runs_table = _table(_section(at, "Job runs"), "priority", "link")
    assert set(runs_table["owner"]) == {"alice"} and set(runs_table["state_name"]) == {"Failed"}

    # custom range shows the date picker and still renders
    choose(at, "range", ["Custom"]).run()
    assert not at.exception and at.sidebar.date_input(key="custom_range") is not None


def _submit(at: AppTest, queue: str, label: str, url: str, target: str = "(new link)", button: int = 0) -> AppTest:
    if "links_queue" not in [s.key for s in at.selectbox]:  # the form is drawn once Manage Links is on
        choose(at, "links_open", ["Manage Links"]).run()
    at.selectbox(key="links_queue").set_value(queue)
    at.run()
    at.selectbox(key="link_target").set_value(target)
    at.text_input(key="link_label").input(label)
    at.text_input(key="link_url").input(url)
    at.button[[b.label for b in at.button].index("Save link" if button == 0 else "Remove link")].click()
    return at.run()


def test_manage_links_validates_and_persists(seeded):
    at = _app().run()
    for bad in ("javascript:alert(1)", "ftp://example.com/x", "example.com", "https://", "http://exa mple.com"):
        at = _submit(at, seeded.pool, "Bad", bad)
        assert at.error and "not saved" in at.error[0].value, bad
    assert QueueLinks.for_queue(seeded.pool).links == []

    at = _submit(at, seeded.pool, "Grafana <b>", "https://grafana.example.com/d/gpu?var=a&b=1")
    assert not at.error and at.success
    links = QueueLinks.for_queue(seeded.pool).links
    assert [(x.label, x.url) for x in links] == [("Grafana <b>", "https://grafana.example.com/d/gpu?var=a&b=1")]
    shown = "\n".join(m.value for m in at.markdown)
    at = _app().run()  # shown in External Links, escaped
    shown = "\n".join(m.value for m in at.markdown)
    assert "Grafana &lt;b&gt;" in shown and 'href="https://grafana.example.com/d/gpu?var=a&amp;b=1"' in shown

    # edit: same entry, new label and URL
    at = _submit(at, seeded.pool, "Grafana", "http://grafana.internal:3000/", target="Grafana <b>")
    assert [(x.label, x.url) for x in QueueLinks.for_queue(seeded.pool).links] == [("Grafana", "http://grafana.internal:3000/")]
    # remove
    at.selectbox(key="links_queue").set_value(seeded.pool)
    at.run()
    at.selectbox(key="link_target").set_value("Grafana")
    at.button[[b.label for b in at.button].index("Remove link")].click()
    at.run()
    assert QueueLinks.for_queue(seeded.pool).links == []


def test_links_edited_elsewhere_are_neither_drawn_nor_saved_over(seeded):
    """A queue's links document edited outside the monitor (Prefect's block editor) to hold a URL the
    links refuse: External Links says so instead of drawing it, and Manage Links refuses to edit that
    queue (a form filled with no links would be saved over the document) and says what to do."""
    from prefect_launch.dashboard.api import get_api

    QueueLinks(queue=seeded.pool, links=[QueueLink(label="ok", url="https://ok.example.com/")]).store()
    api = get_api()
    block = QueueLinks.block_name(seeded.pool)
    doc = api.get(f"block_types/slug/{QueueLinks.get_block_type_slug()}/block_documents/name/{block}")
    bad = {"queue": seeded.pool, "links": [{"label": "x", "url": "javascript:alert(1)"}]}
    api.http.patch(f"block_documents/{doc['id']}", json={"data": bad, "merge_existing_data": False}).raise_for_status()
    try:
        at = _app().run()
        shown = "\n".join(m.value for m in at.markdown)
        assert "not shown: the saved links do not validate" in shown and "javascript" not in shown.split("(links.0.url")[0]
        assert 'href="javascript' not in shown
        choose(at, "links_open", ["Manage Links"]).run()
        at.selectbox(key="links_queue").set_value(seeded.pool)
        at.run()
        assert at.error and "Cannot read the links of" in at.error[0].value and "fix or delete the block" in at.error[0].value
        assert "Prefect server answers" not in at.error[0].value  # the fix is the document's, not the server's
        assert "link_label" not in {w.key for w in at.text_input}  # no form to save over them
        assert api.get(f"block_documents/{doc['id']}")["data"] == bad  # untouched
    finally:
        api.http.delete(f"block_documents/{doc['id']}")


def test_queue_link_validation_unit():
    assert validate_url(" https://a.example/x ") == "https://a.example/x"
    for bad in ("javascript:alert(1)", "data:text/html,x", "//a.example", "http:///x", "https://a b"):
        with pytest.raises(ValueError):
            validate_url(bad)
    html = QueueLink(label='<img src=x onerror="1">', url='https://a.example/"onmouseover="x').html()
    assert "<img" not in html and '"onmouseover' not in html


def test_a_second_visit_in_the_same_step_reuses_the_payloads(seeded, monkeypatch):
    """Visits within a step of the page's clock get one View: the second builds no chart payload or runs
    table again and mounts the very charts the first built (dashboard/app.py's _once)."""
    from fixtures_dashboard import ROOT_APP
    from prefect_launch.dashboard import api as A
    from prefect_launch.dashboard import chart_data as CD

    def mounted(at: AppTest) -> list[bytes]:
        return [e.proto.bytes or e.proto.json for e in at.get("bidi_component")]

    def read_at(at: AppTest) -> str:
        return next(c for c in _captions(at).splitlines() if " read at " in c)

    built: list[str] = []
    for name in ("status_payload", "queued_payload", "load_payload", "lanes_payload", "gantt_payload"):
        monkeypatch.setattr(CD, name, lambda *a, _o=getattr(CD, name), _n=name, **k: (built.append(_n), _o(*a, **k))[1])
    run_url = A.run_url  # each runs table links its runs: counted once per table built
    monkeypatch.setattr(A, "run_url", lambda *a, **k: (built.append("run link"), run_url(*a, **k))[1])
    for _attempt in range(3):  # the two visits may straddle a step of the clock: then both build, try again
        first = _app().run()
        assert not first.exception
        n_first = len(built)
        second = AppTest.from_file(ROOT_APP, default_timeout=120).run()  # the caches kept, as for a second visitor
        if read_at(first) == read_at(second):
            break
        del built[:]
    else:
        raise AssertionError("three pairs of visits each straddled a step of the page's clock")
    assert {"status_payload", "queued_payload", "run link"} <= set(built[:n_first])  # the first built them
    assert built[n_first:] == [], built[n_first:]  # the second built none
    assert mounted(first) == mounted(second) and len(mounted(first)) >= 3  # the same charts, as bytes
    # the runs table (Job runs, the default section) is the same frame
    assert _table(first, "priority", "link").equals(_table(second, "priority", "link"))


def test_heatmap_figures_match_occupancy(seeded):
    """The hour x weekday heatmap (an Altair chart) holds the occupancy module's figure for every hour of the
    page's range (that module is checked against the runs' own state histories in test_dashboard_occupancy.py)."""
    import re

    import pyarrow as pa

    from prefect_launch.dashboard import index_sync as X
    from prefect_launch.dashboard import spec as S
    from prefect_launch.dashboard import view as V
    from prefect_launch.dashboard.api import get_api
    from prefect_launch.dashboard.metrics_source import metrics_store

    def builds_done() -> None:
        """A background index build (started by an earlier page of this module whose range the index did
        not cover) empties the index before it refills it: figures read meanwhile are zeros."""
        deadline = time.monotonic() + 60
        while any(svc.building() for svc in list(X._SERVICES.values())) and time.monotonic() < deadline:
            time.sleep(0.1)

    builds_done()
    X.build(X.RunIndex(metrics_store()), get_api(), days=8)  # the page's 7 days from the run index
    at = _app().run()
    assert not at.exception, [e.value for e in at.exception]
    builds_done()
    caption = next(c for c in _captions(at).splitlines() if " read at " in c)
    assert "from the run index" in caption, caption
    frames = []
    for el in [*at.get("arrow_vega_lite_chart"), *at.get("vega_lite_chart")]:
        blobs = [d.data.data for d in el.proto.datasets] + ([el.proto.data.data] if el.proto.data.data else [])
        frames += [pa.ipc.open_stream(b).read_all().to_pandas() for b in blobs if b]
    hm = next(f for f in frames if {"weekday", "hour", "busy"} <= set(f.columns))
    shown = {(r.weekday, int(r.hour)): float(r.busy) for r in hm.itertuples()}
    hms = re.search(r"read at (\d\d):(\d\d):(\d\d) UTC", caption)
    read = dt.datetime.now(dt.timezone.utc).replace(hour=int(hms[1]), minute=int(hms[2]), second=int(hms[3]),
                                                    microsecond=500_000)  # within 0.5 s of the page's read
    if read > dt.datetime.now(dt.timezone.utc):  # read before midnight, checked after it
        read -= dt.timedelta(days=1)
    current = (["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"][read.weekday()], read.hour)

    def off(step_back: int) -> list:
        """The cells that differ from the occupancy figures of the range the page's clock gave ``step_back``
        steps before the read's (a visit's range is fixed when it starts, and its read can end a step later;
        a view read ahead for the next step is read up to a few seconds before it begins)."""
        at = S.page_now(read - dt.timedelta(seconds=S.PAGE_STEP_S * step_back))
        since, until = S.time_window("Last 7 days", at)
        v = V.load_view(S.ViewSpec(since=since, until=until, grouping="job"), now=read, source="index")
        want = {(r.weekday, int(r.hour)): float(r.busy) for r in v.occupancy.heatmap.itertuples()}
        assert set(shown) == set(want) and len(shown) == 168 and any(x > 0 for x in want.values())
        # the hour of the read moves on while runs hold slots: each running run adds the 0.5 s the caption's
        # second leaves open
        tol = {cell: 1.0 / 3600 * max(1, len(seeded.running_ids)) if cell == current else 1e-6 for cell in want}
        return [(cell, shown[cell], val) for cell, val in want.items() if abs(shown[cell] - val) > tol[cell] + 1e-9]

    misses = [off(k) for k in (0, 1, 2, -1)]
    assert [] in misses, misses[0]


def test_the_frame_navigates_between_both_pages(seeded):
    """dashboard/app.py is the frame: st.navigation lists the queue monitor (its default page) and Sessions."""
    at = _app().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [t.value for t in at.title] == ["Queue monitor"]
    at.switch_page("pages/1_Sessions.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert [t.value for t in at.title] == ["Sessions"] and "queues" not in {w.key for w in at.sidebar.pills}
    at.switch_page("app.py").run()
    assert [t.value for t in at.title] == ["Queue monitor"]


def test_every_other_control_of_the_monitor_changes_what_it_shows(seeded):
    """The controls not clicked above, each clicked through AppTest with what it changes: the job and preset
    filters (pills, or a multiselect past a few options), the runs shown per panel, Refresh now, the cost
    panel's By (a segmented control that follows the sidebar's grouping) and Manage Links (a toggle)."""
    from fixtures_dashboard import control

    at = _app().run()
    choose(at, "queues", [seeded.pool]).run()
    choose(at, "range", ["Last 1 hour"]).run()
    assert len(_table(at, "priority", "link")) == len(seeded.run_ids) - len(seeded.queued_ids)  # every run started
    choose(at, "f_jobs", [seeded.jobs[0]]).run()
    assert not at.exception, [e.value for e in at.exception]
    assert set(_table(at, "priority", "link")["job"]) == {seeded.jobs[0]}
    assert f"jobs {seeded.jobs[0]}" in _captions(at)
    choose(at, "f_presets", ["gpu-1"]).run()
    runs = _table(at, "priority", "link")
    assert set(runs["preset"]) == {"gpu-1"} and set(runs["job"]) == {seeded.jobs[0]}
    choose(at, "f_jobs", []).run()  # the job filter off again: both jobs' gpu-1 runs
    assert set(_table(at, "priority", "link")["job"]) == set(seeded.jobs)
    choose(at, "f_presets", []).run()
    choose(at, "detail_limit", [100]).run()
    assert control(at, "detail_limit").value == 100 and not at.exception
    before = figures(at)
    at.sidebar.button(key="refresh").click().run()  # everything read afresh: the same figures
    assert not at.exception and figures(at)["Runs in range"] == before["Runs in range"]
    # the cost panel's By: the sidebar's grouping (job) first, then owner
    _section(at, "Cost and waste")
    by = control(at, "cost_by_job")
    assert by.value == "job" and "job" in _table(at, "gpu_alloc_h").columns
    by.set_value("owner").run()
    assert not at.exception and "owner" in _table(at, "gpu_alloc_h").columns
    assert "Allocated vs used over the range, by owner" in _captions(at)
    # Manage Links: off, then on (the form), then off again
    assert "links_queue" not in {s.key for s in at.selectbox}
    choose(at, "links_open", ["Manage Links"]).run()
    assert "links_queue" in {s.key for s in at.selectbox}
    choose(at, "links_open", []).run()
    assert "links_queue" not in {s.key for s in at.selectbox}
