"""The monitor's sidebar (dashboard/sidebar.py) in Streamlit's own test runner: which control each choice
is drawn as, and that what is picked is the view the page reads. A click on a button is the browser's
(tests/test_dashboard_browser.py clicks them); here the choice is kept as a click keeps it, and the click's
own message is read by dashboard/choices.applied, tested on its own."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from fixtures_dashboard import choice_groups, choose
from prefect_launch.dashboard import choices as CH
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard.choices import PILLS_MAX


def _app() -> None:
    import streamlit as st

    from prefect_launch.dashboard.choices import PILLS_MAX
    from prefect_launch.dashboard.sidebar import sidebar

    many = [f"job-{i:02d}" for i in range(PILLS_MAX + 1)]  # one more than buttons are drawn for
    st.session_state["spec"] = sidebar({"queues": ["q-a", "q-b", "q-c"], "jobs": many, "owners": ["alice", "bob"],
                                        "presets": []}, lambda: st.session_state.update(refreshed=True))


def _kinds(at: AppTest) -> dict[str, str]:
    out = {w.key: "multiselect" for w in at.sidebar.multiselect}
    out.update({g.key: "buttons" if g.multi else "one of buttons" for g in choice_groups(at)})
    return out


def test_few_choices_are_buttons_and_more_a_multiselect():
    at = AppTest.from_function(_app).run()
    assert not at.exception, [e.value for e in at.exception]
    assert _kinds(at) == {"queues": "buttons", "f_jobs": "multiselect", "f_owners": "buttons", "f_statuses": "buttons",
                          "f_presets": "buttons", "range": "one of buttons", "grouping": "one of buttons",
                          "detail_limit": "one of buttons"}
    assert not at.sidebar.button_group  # no Streamlit pills left: each is an option parsed as markdown
    assert len(S.STATUSES) <= PILLS_MAX  # every status a button
    groups = {g.key: g for g in choice_groups(at)}
    assert groups["range"].selected == [S.DEFAULT_RANGE] and groups["queues"].selected == []
    assert groups["detail_limit"].shown == ["100", "1,000", "5,000", "10,000"]
    assert groups["f_owners"].heading is None and groups["queues"].heading == "Queue monitor"
    spec = at.session_state["spec"]
    assert (spec.grouping, spec.detail_limit, spec.live) == (S.DEFAULT_GROUPING, S.DEFAULT_DETAIL_LIMIT, True)
    assert spec.until - spec.since == S.RANGES[S.DEFAULT_RANGE] and not spec.queues and not spec.jobs


def test_what_is_picked_is_the_view_read():
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
    assert {g.key: g.selected for g in choice_groups(at)}["queues"] == ["q-b", "q-c"]  # drawn pressed
    # a single choice emptied (the buttons keep one pressed in the browser) still reads a grouping
    choose(at, "grouping", []).run()
    assert not at.exception and at.session_state["spec"].grouping == S.DEFAULT_GROUPING
    at.sidebar.button(key="refresh").click().run()
    assert at.session_state["refreshed"] is True
    choose(at, "range", ["Custom"]).run()
    assert not at.exception and not at.session_state["spec"].live
    assert at.sidebar.date_input(key="custom_range") is not None
    # the date picker splits the buttons: the range's run of them, the picker, then the rest
    assert [g.key for g in choice_groups(at)][:3] == ["queues", "range", "grouping"]


def test_a_click_is_applied_once():
    """The browser's message for a click (every group of its component as drawn after it): applied when its
    nonce is new, ignored once applied or when it is not such a message."""
    state = {"picked": {"values": {"queues": ["q-a"], "range": ["Last 1 hour"]}, "nonce": "n1"}}
    assert CH.applied(state, None) == ({"queues": ["q-a"], "range": ["Last 1 hour"]}, "n1")
    assert CH.applied(state, "n1") is None
    assert CH.applied({"picked": None}, None) is None and CH.applied(None, None) is None
    assert CH.applied({"picked": {"values": ["q-a"], "nonce": "n2"}}, "n1") is None
    assert CH.applied({"picked": {"values": {"queues": "x"}, "nonce": "n2"}}, "n1") == ({"queues": []}, "n2")



def _click(at: AppTest, instance: str, nonce: str, **values: list) -> AppTest:
    """The browser's message for a click on the buttons of the component ``instance`` (dashboard/choices.js):
    every group it draws, as drawn after the click (``values``: those changed; the rest as drawn now)."""
    drawn = {g.key: g.selected for g in choice_groups(at)}
    at.session_state[instance] = {"picked": {"values": {**drawn, **values}, "nonce": nonce}}
    return at


def test_clicks_in_two_groups_before_a_rerun_are_both_read():
    """Two quick clicks in one component (a queue, then the range) reach the server as one message: both
    choices are read, and the message is not applied again at the next rerun."""
    at = AppTest.from_function(_app).run()
    _click(at, "choices_queues", "n1", queues=["q-b"], range=["Last 1 hour"]).run()
    assert not at.exception, [e.value for e in at.exception]
    spec = at.session_state["spec"]
    assert spec.queues == ("q-b",) and spec.until - spec.since == S.RANGES["Last 1 hour"]
    drawn = {g.key: g.selected for g in choice_groups(at)}
    assert drawn["queues"] == ["q-b"] and drawn["range"] == ["Last 1 hour"]
    choose(at, "range", ["Last 24 hours"]).run()  # a later choice, made another way, stands
    assert at.session_state["spec"].until - at.session_state["spec"].since == S.RANGES["Last 24 hours"]


def test_a_single_choice_clicked_twice_reads_the_last_click():
    """Two clicks on the range, each a message with its own nonce: the page reads the last; the range is
    never left empty."""
    at = AppTest.from_function(_app).run()
    _click(at, "choices_queues", "n1", range=["Last 1 hour"]).run()
    _click(at, "choices_queues", "n2", range=["Last 24 hours"]).run()
    assert not at.exception, [e.value for e in at.exception]
    spec = at.session_state["spec"]
    assert spec.until - spec.since == S.RANGES["Last 24 hours"]
    assert {g.key: g.selected for g in choice_groups(at)}["range"] == ["Last 24 hours"]
    _click(at, "choices_queues", "n3", range=[]).run()  # not sent by the buttons; read as the default
    assert at.session_state["spec"].until - at.session_state["spec"].since == S.RANGES[S.DEFAULT_RANGE]


def _growing() -> None:
    import streamlit as st

    from prefect_launch.dashboard.choices import Column, pick

    n = st.session_state.get("n", 3)  # how many queues the server holds at this rerun
    col = Column(st.sidebar)
    st.session_state["got"] = pick(col, "Queues", [f"q{i}" for i in range(n)], "queues", "all queues")
    col.flush()


def test_a_choice_stays_when_the_options_cross_the_pills_limit():
    """A queue created elsewhere can take the list past PILLS_MAX: the buttons become a multiselect, and the
    person's choice stays (Streamlit would start the new control empty: every queue shown, unasked), and the
    click that made it is not applied again when the buttons come back."""
    at = AppTest.from_function(_growing).run()
    _click(at, "choices_queues", "n1", queues=["q1", "q2"]).run()
    assert at.session_state["got"] == ["q1", "q2"]
    at.session_state["n"] = PILLS_MAX + 4
    at.run()
    assert [w.key for w in at.sidebar.multiselect] == ["queues"] and at.session_state["got"] == ["q1", "q2"]
    assert at.sidebar.multiselect(key="queues").value == ["q1", "q2"]
    at.sidebar.multiselect(key="queues").set_value(["q2", "q9"]).run()
    at.session_state["n"] = 3  # back under the limit: q9 is gone, q2 stays chosen
    at.run()
    assert [g.key for g in choice_groups(at)] == ["queues"] and at.session_state["got"] == ["q2"]
    assert choice_groups(at)[0].selected == ["q2"]
    assert not at.exception and not at.warning, [w.value for w in at.warning]
