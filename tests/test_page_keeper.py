"""The monitor's page keeper (dashboard/page_keeper.py): when a value is computed, reused and
read ahead of the page's clock. Pure: a fake clock and compute function, no server."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest

from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard.page_keeper import PageKeeper
from prefect_launch.dashboard.page_data import advance


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _live(step: int):
    """Keys are step numbers; step k's view is asked during [10k - 10, 10k) and step k+1 begins at 10k."""
    return lambda k: (k + 1, 10.0 * k)


def test_each_key_is_computed_once_and_served_until_its_ttl():
    clock, calls = Clock(), []
    keeper = PageKeeper(lambda k: calls.append(k) or f"v{k}", lambda k: None, ttl_s=30, clock=clock)
    assert keeper.get(1) == "v1" and keeper.get(1) == "v1"
    assert calls == [1] and (keeper.hits, keeper.misses) == (1, 1)
    clock.t += 31
    assert keeper.get(1) == "v1" and calls == [1, 1]  # expired: read again


def _slow_double():
    """(started, release, calls, compute): ``compute(k)`` records k, says it started, waits for
    ``release`` and returns 2k."""
    started, release, calls = threading.Event(), threading.Event(), []

    def slow(k):
        calls.append(k)
        started.set()
        release.wait(5)
        return k * 2

    return started, release, calls, slow


def test_concurrent_requests_wait_for_one_computation():
    started, release, calls, slow = _slow_double()
    keeper = PageKeeper(slow, lambda k: None)
    out = []
    threads = [threading.Thread(target=lambda: out.append(keeper.get(21))) for _ in range(3)]
    threads[0].start()
    started.wait(5)
    for t in threads[1:]:
        t.start()
    time.sleep(0.05)
    release.set()
    for t in threads:
        t.join(5)
    assert out == [42, 42, 42] and calls == [21]


def test_a_failure_reaches_every_waiter_and_is_not_kept():
    n = {"calls": 0}

    def flaky(k):
        n["calls"] += 1
        if n["calls"] == 1:
            raise RuntimeError("server down")
        return "ok"

    keeper = PageKeeper(flaky, lambda k: None)
    with pytest.raises(RuntimeError, match="server down"):
        keeper.get("a")
    assert not keeper.peek("a")
    assert keeper.get("a") == "ok" and n["calls"] == 2


def test_the_next_step_is_read_ahead_of_the_clock_for_a_key_asked_lately():
    clock = Clock(95.0)  # step 10 is shown during [90, 100); step 11 begins at 100
    calls = []
    keeper = PageKeeper(lambda k: calls.append(k) or k, _live(10), keep_s=300, lead_s=2, clock=clock)
    keeper.get(10)
    assert keeper.keep_ahead() == 0  # 5 s before the step: too early
    clock.t = 98.5
    assert keeper.keep_ahead() == 1 and calls == [10, 11]
    assert keeper.keep_ahead() == 0  # once
    clock.t = 100.5
    assert keeper.peek(11) and keeper.get(11) == 11 and calls == [10, 11]  # the visit in the new step: no wait
    # nobody asks any more: kept ahead for keep_s after the last request, then left alone
    for t in range(100, 420, 1):
        clock.t = t + 0.9
        keeper.keep_ahead()
    read_ahead = [k for k in calls[2:]]
    assert read_ahead == list(range(12, 12 + len(read_ahead)))
    assert 12 + len(read_ahead) - 1 <= 41  # up to ~300 s after the last request (at 100.5): step 40 ends at 400
    assert len(read_ahead) >= 28


def test_a_keeper_behind_the_clock_reads_the_step_now_not_the_steps_gone_by():
    """A read longer than several steps (a cold read at 1M runs): the keeper then reads the step the clock is
    in, not each step that passed meanwhile (nobody can see those any more)."""
    clock = Clock(95.0)
    calls = []
    keeper = PageKeeper(lambda k: calls.append(k) or k, _live(10), keep_s=300, lead_s=2, clock=clock)
    keeper.get(10)
    clock.t = 131.0  # steps 11-13 (to 130) are over; step 14 shows [130, 140)
    assert keeper.keep_ahead() == 1 and calls == [10, 14]
    clock.t = 138.5
    assert keeper.keep_ahead() == 1 and calls == [10, 14, 15]  # and then ahead again as usual


def test_a_slow_view_is_read_ahead_earlier():
    clock = Clock(90.0)

    def compute(k):
        clock.t += 4.0  # takes 4 s of the clock
        return k

    keeper = PageKeeper(compute, _live(10), lead_s=2, clock=clock)
    keeper.get(10)  # finished at 94; took 4 s by the fake clock? took_s is wall time: tiny
    keeper._entries[10].took_s = 4.0  # what a 100k-run view costs here
    clock.t = 93.5  # 6.5 s before the step: 1.5 x 4 s = 6 s lead, too early
    assert keeper.keep_ahead() == 0
    clock.t = 94.5
    assert keeper.keep_ahead() == 1


def test_fixed_keys_are_not_read_ahead_and_entries_are_bounded():
    clock = Clock()
    keeper = PageKeeper(lambda k: k, lambda k: None, max_entries=3, clock=clock)
    for k in range(5):
        clock.t += 1
        keeper.get(k)
    assert keeper.keep_ahead() == 0
    assert sorted(k for k in range(5) if keeper.peek(k)) == [2, 3, 4]


def test_clear_forgets_values_and_values_lists_them():
    keeper = PageKeeper(lambda k: {"k": k}, lambda k: None)
    keeper.get(1), keeper.get(2)
    assert sorted(v["k"] for v in keeper.values()) == [1, 2]
    keeper.clear()
    assert keeper.values() == [] and not keeper.peek(1)


def test_the_keeper_thread_reads_ahead_on_its_own():
    keeper = PageKeeper(lambda k: k, lambda k: (k + 1, time.time() + 1.0), keep_s=60)  # each next step begins within the lead
    keeper.get(1)
    keeper.start(period_s=0.05)
    try:
        deadline = time.time() + 5
        while not keeper.peek(3) and time.time() < deadline:
            time.sleep(0.02)
        assert keeper.peek(2) and keeper.peek(3) and keeper.ahead >= 2
    finally:
        keeper.stop()


def test_a_live_view_moves_with_the_page_clock_and_a_fixed_one_does_not():
    now = dt.datetime(2026, 12, 1, 10, 0, 3, tzinfo=S.UTC)
    spec = S.default_spec(now)
    assert spec.until == dt.datetime(2026, 12, 1, 10, 0, 10, tzinfo=S.UTC) and spec.live
    nxt, starts = advance(spec)
    # the key a visit makes in the next step is exactly the one read ahead
    assert nxt == S.default_spec(now + dt.timedelta(seconds=S.PAGE_STEP_S))
    assert starts == spec.until.timestamp()
    fixed = S.ViewSpec(since=spec.since, until=spec.until)
    assert advance(fixed) is None


def test_the_page_clock_steps_longer_while_pages_take_long_to_read(monkeypatch):
    """A page read in well under a step keeps the 10-s step; a slower one makes the clock move in the
    shortest step at least 2.5 reads long (at once), and it shortens one step at a time with room to spare."""
    assert S.step_for(1.0, 10) == 10 and S.step_for(4.0, 10) == 10
    assert S.step_for(5.0, 10) == 20 and S.step_for(9.0, 10) == 30 and S.step_for(40.0, 10) == 60
    assert S.step_for(7.0, 60) == 30  # 7 x 2.5 x 1.5 = 26 s: room in 30
    assert S.step_for(7.0, 30) == 30  # ... not in 20, though 17.5 s would fit it: no flapping
    assert S.step_for(5.0, 30) == 20 and S.step_for(5.0, 20) == 20 and S.step_for(2.0, 20) == 10
    monkeypatch.setattr(S, "_STEP", [S.PAGE_STEP_S])
    assert S.note_read(9.0) == 30 and S.page_step() == 30
    now = dt.datetime(2026, 12, 1, 10, 0, 3, tzinfo=S.UTC)
    spec = S.default_spec(now)
    assert spec.until == dt.datetime(2026, 12, 1, 10, 0, 30, tzinfo=S.UTC)
    nxt, starts = advance(spec)
    assert nxt == S.default_spec(now + dt.timedelta(seconds=30)) and starts == spec.until.timestamp()
    # a key of the 10-s clock, asked just before the step grew: the read ahead goes to the new clock's next step
    old = S.ViewSpec(since=spec.since - dt.timedelta(seconds=20), until=dt.datetime(2026, 12, 1, 10, 0, 10, tzinfo=S.UTC),
                     live=True, grouping=spec.grouping, detail_limit=spec.detail_limit)
    assert advance(old)[0] == spec and S.RANGES[S.DEFAULT_RANGE] == spec.until - spec.since


def test_request_starts_one_read_in_the_background_and_does_not_wait():
    started, release, calls, slow = _slow_double()
    keeper = PageKeeper(slow, lambda k: None)
    t = time.monotonic()
    assert keeper.request(4) is False and started.wait(5)
    assert keeper.request(4) is False and not keeper.peek(4)  # under way: no second read
    assert time.monotonic() - t < 1.0
    release.set()
    deadline = time.monotonic() + 5
    while not keeper.peek(4) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keeper.request(4) is True and keeper.get(4) == 8 and calls == [4]


def _page(now: dt.datetime, took: float = 20.0):
    from prefect_launch.dashboard.page_data import PageData

    class _View:  # what get_or_newest reads of a view: when it was read, and how long that took
        def __init__(self, now):
            self.now, self.timings = now, {"total": took}

    return PageData(view=_View(now))


def test_a_visit_shows_the_newest_page_of_its_sidebar_state_while_its_view_is_read(monkeypatch):
    """A view slower than a step of the page's clock: the visit gets the newest page of the same sidebar
    state at once (marked stale), one read of that state runs at a time, and newer_than says when to rerun."""
    from prefect_launch.dashboard import page_data as P

    P.clear()
    release, reads = threading.Event(), []

    def read(spec):
        reads.append(spec.until)
        release.wait(5)
        return _page(spec.until)

    monkeypatch.setattr(P, "_read", read)
    monkeypatch.setattr(P, "PAGE", PageKeeper(P.compute, P.advance, ttl_s=30))
    t0 = S.page_now(dt.datetime(2026, 11, 30, 12, 0, 5, tzinfo=S.UTC))
    first = S.default_spec(t0)
    release.set()
    page, stale = P.get_or_newest(first, now=t0)  # nothing read before: waits for it
    assert not stale and page.view.now == first.until
    release.clear()
    later = first.next_step().next_step()
    page, stale = P.get_or_newest(later, now=later.until)  # read under way: the newest page at once
    assert stale and page.view.now == first.until
    assert not P.newer_than(later, page.view.now)
    page2, stale2 = P.get_or_newest(later.next_step(), now=later.until)  # the same state: no second read
    assert stale2 and page2 is page and reads == [first.until, later.until]
    release.set()
    deadline = time.monotonic() + 5
    while not P.newer_than(later, page.view.now) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert P.newer_than(later, first.until)
    # a view read quickly (here in 1 s) is waited for: no older figures in between
    fast = later.next_step().next_step()
    P._remember(fast, _page(fast.until, took=1.0))
    monkeypatch.setattr(P, "_read", lambda spec: _page(spec.until, took=1.0))
    nxt = fast.next_step()
    page, stale = P.get_or_newest(nxt, now=nxt.until)
    assert not stale and page.view.now == nxt.until
    monkeypatch.setattr(P, "_read", read)
    P._remember(nxt, _page(nxt.until))
    # too old to show (past stale_max_s()): the visit waits for its own read
    far = later.until + dt.timedelta(seconds=P.stale_max_s() + 60)
    page3, stale3 = P.get_or_newest(S.default_spec(far), now=far)
    assert not stale3 and page3.view.now == S.default_spec(far).until
    P.clear()


def test_a_failed_read_is_said_not_hidden_behind_older_figures(monkeypatch):
    """While the newest page is shown, the read under way fails (Prefect down): the page is told (newer_than
    turns true, the next visit gets the error to show beside the last good figures), and a later read that
    succeeds clears it."""
    from prefect_launch.dashboard import page_data as P

    P.clear()
    fail, go = threading.Event(), threading.Event()

    def read(spec):
        if fail.is_set():
            go.wait(5)  # a read that takes a while to find Prefect down (an instant failure is said at once)
            if fail.is_set():
                raise ConnectionError("Prefect is down")
        return _page(spec.until)

    monkeypatch.setattr(P, "_read", read)
    monkeypatch.setattr(P, "PAGE", PageKeeper(P.compute, P.advance, ttl_s=30))
    first = S.default_spec(S.page_now(dt.datetime(2026, 11, 30, 12, 0, 5, tzinfo=S.UTC)))
    P.get_or_newest(first, now=first.until)
    fail.set()
    later = first.next_step()
    page, stale = P.get_or_newest(later, now=later.until)  # its read starts (and fails) in the background
    assert stale and page.view.now == first.until and not P.newer_than(later, page.view.now)
    go.set()
    deadline = time.monotonic() + 5
    while not P.newer_than(later, page.view.now) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert P.newer_than(later, page.view.now)  # the page reruns ...
    go.clear()
    with pytest.raises(ConnectionError):  # ... and is told why, while a new read starts
        P.get_or_newest(later.next_step(), now=later.until)
    assert P.last_good(later).view.now == first.until  # what it shows beside the reason
    fail.clear()
    go.set()  # Prefect is back: that read succeeds
    deadline = time.monotonic() + 5
    while P._FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not P._FAILED and P.newer_than(later, first.until)
    page, stale = P.get_or_newest(later.next_step(), now=later.until)
    assert page.view.now == later.next_step().until and not stale
    P.clear()


def test_the_read_ahead_waits_while_a_visit_is_drawn_up_to_the_last_moment():
    """Within the lead, a read ahead does not start within quiet_s of a visit (get), unless it must
    start now to be ready when the step begins (1.2 x its last length before it, at least 0.5 s)."""
    clock = Clock(90.0)
    calls = []
    keeper = PageKeeper(lambda k: calls.append(k) or k, _live(10), lead_s=4, quiet_s=2.5, clock=clock)
    keeper.get(10)  # a visit at 90
    keeper._entries[10].took_s = 1.0  # the read takes 1 s: it must start by 98.8
    clock.t = 96.5  # within the lead (from 96); the last visit 6.5 s ago: quiet
    keeper.get(10)  # another visit: the keeper holds back until 99.0 or the step's last moment
    assert keeper.keep_ahead() == 0
    clock.t = 98.0  # still within 2.5 s of the visit, and there is time left
    assert keeper.keep_ahead() == 0 and calls == [10]
    clock.t = 98.8  # the last moment that is ready in time: it reads though the visit is recent
    assert keeper.keep_ahead() == 1 and calls == [10, 11]
    # after the quiet spell a read starts as soon as the lead allows
    clock.t = 105.0
    keeper.get(11)  # a visit at 105
    clock.t = 107.6  # lead from 106, the visit 2.6 s ago
    assert keeper.keep_ahead() == 1 and calls == [10, 11, 12]


def test_prepare_reads_the_step_its_first_read_ended_in(monkeypatch):
    """The monitor's start: a first read that outlasts its step of the page's clock is followed by a read
    of the step it ended in, so the first visits find the figures of their own step; a read within its
    step is not repeated."""
    from prefect_launch.dashboard import page_data as P

    P.clear()
    t0 = S.page_now(dt.datetime(2026, 11, 30, 12, 0, 5, tzinfo=S.UTC))
    clock = [t0 - dt.timedelta(seconds=5)]
    reads = []

    def read(spec):
        reads.append(spec.until)
        clock[0] += dt.timedelta(seconds=40)  # a cold read at 1M runs: four steps
        return _page(spec.until)

    monkeypatch.setattr(P, "_read", read)
    monkeypatch.setattr(P, "options", lambda: {})
    monkeypatch.setattr(P, "PAGE", PageKeeper(P.compute, P.advance, ttl_s=30))
    real = S.default_spec
    monkeypatch.setattr(S, "default_spec", lambda now=None: real(now or clock[0]))
    page = P.prepare()
    assert reads == [t0, S.page_now(t0 + dt.timedelta(seconds=35))] and page.view.now == reads[-1]
    reads.clear()
    monkeypatch.setattr(P, "_read", lambda spec: reads.append(spec.until) or _page(spec.until))
    P.PAGE.clear()
    P.prepare()
    assert reads == [S.page_now(clock[0])]  # within its step: read once
    P.clear()


def test_out_of_date_sidebar_choices_are_read_in_the_background_while_a_visit_gets_the_last(monkeypatch):
    """The sidebar's choices once a minute old: the visit does not wait for them (the last ones), the read
    runs beside it, and the next visit gets the new ones; the very first visit waits (nothing to show)."""
    from prefect_launch.dashboard import page_data as P

    P.clear()
    release, reads = threading.Event(), []

    def read(_k):
        reads.append(1)
        if len(reads) > 1:
            release.wait(5)
        return {"queues": [f"q{len(reads)}"]}

    clock = Clock(0.0)
    monkeypatch.setattr(P, "_OPTIONS", PageKeeper(read, lambda _k: None, ttl_s=60.0, clock=clock))
    assert P.options() == {"queues": ["q1"]} and len(reads) == 1
    clock.t = 61.0  # out of date
    assert P.options() == {"queues": ["q1"]}  # at once, while the read waits
    release.set()
    deadline = time.monotonic() + 5
    while not P._OPTIONS.peek("options") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert P.options() == {"queues": ["q2"]} and len(reads) == 2
    P.clear()


def test_a_ttl_given_as_a_function_is_asked_at_each_use(monkeypatch):
    """The page's TTL follows the clock's step: a page read in a 60-s step still serves 100 s later, where
    in a 10-s step it is read again after 30 s."""
    from prefect_launch.dashboard import page_data as P

    ttl = [30.0]
    clock = Clock(0.0)
    calls = []
    keeper = PageKeeper(lambda k: calls.append(k) or k, lambda k: None, ttl_s=lambda: ttl[0], clock=clock)
    keeper.get(1)
    clock.t = 35.0
    keeper.get(1)
    assert calls == [1, 1]  # past 30 s: read again
    ttl[0] = 120.0
    clock.t = 135.0
    keeper.get(1)
    assert calls == [1, 1]  # 100 s later, within the longer TTL
    monkeypatch.setattr(S, "_STEP", [S.PAGE_STEP_S])
    assert P.page_ttl_s() == P.CACHE_TTL_S
    monkeypatch.setattr(S, "_STEP", [60])
    assert P.page_ttl_s() == 120.0
