"""The monitor's sidebar (dashboard/sidebar.py) in Streamlit's own test runner: which control each choice
is drawn as (Streamlit's pills, segmented controls and multiselects, dashboard/widgets.py), and that what is
clicked is the view the page reads."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from fixtures_dashboard import choose, control
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard.widgets import PILLS_MAX


def _app() -> None:
    import streamlit as st

    from prefect_launch.dashboard.sidebar import sidebar
    from prefect_launch.dashboard.widgets import PILLS_MAX

    many = [f"job-{i:02d}" for i in range(PILLS_MAX + 1)]  # one more than pills are drawn for
    st.session_state["spec"] = sidebar({"queues": ["q-a", "q-b", "q-c"], "jobs": many, "owners": ["alice", "bob"],
                                        "presets": []}, lambda: st.session_state.update(refreshed=True))


def _kinds(at: AppTest) -> dict[str, str]:
    out = {w.key: "multiselect" for w in at.sidebar.multiselect}
    out.update({w.key: "pills" for w in at.sidebar.pills})
    out.update({w.key: "segmented" for w in at.sidebar.segmented_control})
    return out


def test_few_choices_are_pills_one_of_few_a_segmented_control_and_more_a_multiselect():
    at = AppTest.from_function(_app).run()
    assert not at.exception, [e.value for e in at.exception]
    assert _kinds(at) == {"queues": "pills", "f_jobs": "multiselect", "f_owners": "pills", "f_statuses": "pills",
                          "f_presets": "pills", "range": "segmented", "grouping": "segmented",
                          "detail_limit": "segmented"}
    assert len(S.STATUSES) <= PILLS_MAX  # every status a pill
    assert control(at, "range").value == S.DEFAULT_RANGE and control(at, "queues").value == []
    assert control(at, "detail_limit").options == ["100", "1,000", "5,000", "10,000"]
    assert [h.value for h in at.sidebar.subheader] == ["Queue monitor", "Filters"]
    spec = at.session_state["spec"]
    assert (spec.grouping, spec.detail_limit, spec.live) == (S.DEFAULT_GROUPING, S.DEFAULT_DETAIL_LIMIT, True)
    assert spec.until - spec.since == S.RANGES[S.DEFAULT_RANGE] and not spec.queues and not spec.jobs


def test_what_is_clicked_is_the_view_read():
    at = AppTest.from_function(_app).run()
    choose(at, "queues", ["q-b", "q-c"]).run()
    choose(at, "f_jobs", ["job-03"]).run()
    choose(at, "f_statuses", ["failed", "crashed"]).run()
    choose(at, "grouping", ["owner"]).run()
    choose(at, "detail_limit", [5000]).run()
    choose(at, "range", ["Last 1 hour"]).run()
    assert not at.exception, [e.value for e in at.exception]
    spec = at.session_state["spec"]
    assert (spec.queues, spec.jobs, spec.statuses) == (("q-b", "q-c"), ("job-03",), ("failed", "crashed"))
    assert (spec.grouping, spec.detail_limit) == ("owner", 5000)
    assert spec.until - spec.since == S.RANGES["Last 1 hour"] and spec.live
    assert control(at, "queues").value == ["q-b", "q-c"]  # drawn chosen
    control(at, "queues").unselect("q-b").run()  # a second click on a pill takes it out
    assert at.session_state["spec"].queues == ("q-c",)
    at.sidebar.button(key="refresh").click().run()
    assert at.session_state["refreshed"] is True
    choose(at, "range", ["Custom"]).run()
    assert not at.exception and not at.session_state["spec"].live
    assert at.sidebar.date_input(key="custom_range") is not None


def test_a_single_choice_always_holds_one():
    """The range, grouping and runs shown are segmented controls that keep one chosen: emptied (as a second
    click on the chosen one would), the page reads the default and draws it chosen."""
    at = AppTest.from_function(_app).run()
    choose(at, "grouping", ["owner"]).run()
    control(at, "grouping").set_value(None).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["spec"].grouping in ("owner", S.DEFAULT_GROUPING)
    assert control(at, "grouping").value is not None


def _growing() -> None:
    import streamlit as st

    from prefect_launch.dashboard.widgets import pick

    n = st.session_state.get("n", 3)  # how many queues the server holds at this rerun
    st.session_state["got"] = pick("Queues", [f"q{i}" for i in range(n)], "queues", "all queues", where=st.sidebar)


def test_a_choice_stays_when_the_options_cross_the_pills_limit():
    """A queue created elsewhere can take the list past PILLS_MAX: the pills become a multiselect, and the
    person's choice stays; an option that goes away is dropped from it."""
    at = AppTest.from_function(_growing).run()
    choose(at, "queues", ["q1", "q2"]).run()
    assert at.session_state["got"] == ["q1", "q2"]
    at.session_state["n"] = PILLS_MAX + 4
    at.run()
    assert [w.key for w in at.sidebar.multiselect] == ["queues"] and at.session_state["got"] == ["q1", "q2"]
    assert at.sidebar.multiselect(key="queues").value == ["q1", "q2"]
    at.sidebar.multiselect(key="queues").set_value(["q2", "q9"]).run()
    at.session_state["n"] = 3  # back under the limit: q9 is gone, q2 stays chosen
    at.run()
    assert [w.key for w in at.sidebar.pills] == ["queues"] and at.session_state["got"] == ["q2"]
    assert control(at, "queues").value == ["q2"]
    assert not at.exception and not at.warning, [w.value for w in at.warning]
