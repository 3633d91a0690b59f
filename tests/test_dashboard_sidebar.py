"""The monitor's sidebar (dashboard/sidebar.py) in Streamlit's own test runner: which control each choice
is drawn as, and that what is picked is the view the page reads."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard.sidebar import PILLS_MAX


def _app() -> None:
    import streamlit as st

    from prefect_launch.dashboard.sidebar import PILLS_MAX, sidebar

    many = [f"job-{i:02d}" for i in range(PILLS_MAX + 1)]  # one more than pills are drawn for
    st.session_state["spec"] = sidebar({"queues": ["q-a", "q-b", "q-c"], "jobs": many, "owners": ["alice", "bob"],
                                        "presets": []}, lambda: st.session_state.update(refreshed=True))


def _kinds(at: AppTest) -> dict[str, str]:
    out = {w.key: "multiselect" for w in at.sidebar.multiselect}
    out.update({w.key: "pills" for w in at.sidebar.pills})
    return out


def test_few_choices_are_pills_and_more_a_multiselect():
    at = AppTest.from_function(_app).run()
    assert not at.exception, [e.value for e in at.exception]
    assert _kinds(at) == {"queues": "pills", "f_jobs": "multiselect", "f_owners": "pills", "f_statuses": "pills",
                          "f_presets": "pills", "range": "pills", "grouping": "pills", "detail_limit": "pills"}
    assert len(S.STATUSES) <= PILLS_MAX  # every status a pill
    spec = at.session_state["spec"]
    assert (spec.grouping, spec.detail_limit, spec.live) == (S.DEFAULT_GROUPING, S.DEFAULT_DETAIL_LIMIT, True)
    assert spec.until - spec.since == S.RANGES[S.DEFAULT_RANGE] and not spec.queues and not spec.jobs


def test_what_is_picked_is_the_view_read():
    at = AppTest.from_function(_app).run()
    at.sidebar.pills(key="queues").set_value(["q-b", "q-c"]).run()
    at.sidebar.multiselect(key="f_jobs").set_value(["job-03"]).run()
    at.sidebar.pills(key="f_statuses").set_value(["failed", "crashed"]).run()
    at.sidebar.pills(key="grouping").set_value("owner").run()
    at.sidebar.pills(key="detail_limit").set_value(5000).run()
    at.sidebar.pills(key="range").set_value("Last 1 hour").run()
    assert not at.exception, [e.value for e in at.exception]
    spec = at.session_state["spec"]
    assert (spec.queues, spec.jobs, spec.statuses) == (("q-b", "q-c"), ("job-03",), ("failed", "crashed"))
    assert (spec.grouping, spec.detail_limit) == ("owner", 5000)
    assert spec.until - spec.since == S.RANGES["Last 1 hour"] and spec.live
    # a single choice emptied (required pills keep one in the browser) still reads a grouping
    at.sidebar.pills(key="grouping").set_value(None).run()
    assert not at.exception and at.session_state["spec"].grouping in S.GROUPINGS
    at.sidebar.button(key="refresh").click().run()
    assert at.session_state["refreshed"] is True
    at.sidebar.pills(key="range").set_value("Custom").run()
    assert not at.exception and not at.session_state["spec"].live
    assert at.sidebar.date_input(key="custom_range") is not None


def _growing() -> None:
    import streamlit as st

    from prefect_launch.dashboard.sidebar import pick

    n = st.session_state.get("n", 3)  # how many queues the server holds at this rerun
    st.session_state["got"] = pick(st.sidebar, "Queues", [f"q{i}" for i in range(n)], "queues", "all queues")


def test_a_choice_stays_when_the_options_cross_the_pills_limit():
    """A queue created elsewhere can take the list past PILLS_MAX: the control becomes a multiselect, and the
    person's choice stays (Streamlit would start the new control empty: every queue shown, unasked)."""
    at = AppTest.from_function(_growing).run()
    at.sidebar.button_group(key="queues").set_value(["q1", "q2"]).run()
    assert at.session_state["got"] == ["q1", "q2"]
    at.session_state["n"] = PILLS_MAX + 4
    at.run()
    assert [w.key for w in at.sidebar.multiselect] == ["queues"] and at.session_state["got"] == ["q1", "q2"]
    at.sidebar.multiselect(key="queues").set_value(["q2", "q9"]).run()
    at.session_state["n"] = 3  # back under the limit: q9 is gone, q2 stays chosen
    at.run()
    assert [w.key for w in at.sidebar.pills] == ["queues"] and at.session_state["got"] == ["q2"]
    assert not at.exception and not at.warning, [w.value for w in at.warning]
