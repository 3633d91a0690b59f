"""A cache that computes each key once and keeps the keys people look at ready ahead of the page's clock.

Why: the monitor's view is keyed by its time range, and a live range ("last 7 days") ends at the
page's clock (:func:`prefect_launch.dashboard.spec.page_now`), which moves every
``PAGE_STEP_S``. With a plain TTL cache every visit in a new step computes the view afresh
(index sync, occupancy, cost rows: seconds at 100k runs) while the person waits. Here a
background thread computes the *next* step's value of each live key a little before that step
begins (``lead`` seconds, at least the last computation's length), for the keys asked for in the
last ``keep_s`` seconds, so a visit finds its value ready. Figures are then at most one step plus
the lead old, as before at most one step. Within the lead it waits while a visit is being drawn
(``quiet_s`` after the last :meth:`PageKeeper.get`), up to the last moment that still finishes before
the step begins: on a small machine a read running beside a visit slowed the visit by most of its
own length.

Pure of Streamlit and of the dashboard's I/O: ``compute`` and ``advance`` are given, and the
clock can be, so the timing rules are tested without a server.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Optional, TypeVar, Union

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    value: Any = None
    error: Optional[BaseException] = None
    computed_at: float = 0.0  # clock when the computation finished
    took_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class PageKeeper(Generic[K, V]):
    """Values of ``compute(key)``, each computed once (callers asking while it runs wait for it).

    ``advance(key)`` gives the key the same view has in the next clock step, and when that step
    begins (``(next_key, starts_at)``), or None for a key that does not move (a fixed range).
    ``ttl_s``: how long a value serves (a live key's value is replaced when its step ends anyway), or a
    function giving it (asked at each use: a TTL that follows the page clock's step).
    ``keep_s``: how long after its last request a key is kept ready. ``max_entries``: oldest
    entries beyond it are dropped. ``quiet_s``: how long after a :meth:`get` (a visit) the keeper
    holds back a read it could still start later (see the module doc).
    """

    def __init__(self, compute: Callable[[K], V], advance: Callable[[K], Optional[tuple[K, float]]], *,
                 ttl_s: Union[float, Callable[[], float]] = 30.0, keep_s: float = 300.0, lead_s: float = 2.0, max_entries: int = 16,
                 quiet_s: float = 0.0, clock: Callable[[], float] = time.time) -> None:
        self._compute, self._advance = compute, advance
        self._ttl = ttl_s if callable(ttl_s) else (lambda: float(ttl_s))
        self.keep_s, self.lead_s, self.max_entries = keep_s, lead_s, max_entries
        self.quiet_s = quiet_s
        self._visited_at = float("-inf")  # clock of the last get: a visit being drawn
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[K, _Entry] = {}
        self._asked: dict[K, float] = {}  # key -> clock of its last request (or its predecessor's)
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.hits = self.misses = self.ahead = 0  # counters for the page's footer and the tests

    # ------------------------------------------------------------------ reads

    def get(self, key: K) -> V:
        """The value of ``key``: ready, being computed (waited for), or computed now."""
        with self._lock:
            self._visited_at = now = self._clock()
            entry, owner = self._claim(key, now)
            if owner:
                self.misses += 1
            else:
                self.hits += 1
        if owner:
            self._run(key, entry)
        else:
            entry.done.wait()
        self._wake.set()  # the keeper looks at the newly asked key
        if entry.error is not None:
            raise entry.error
        return entry.value

    def request(self, key: K) -> bool:
        """Ask for ``key`` without waiting: True if its value is ready; else its computation is under
        way (started now, in a thread of its own, if nothing computes it yet) and :meth:`peek` tells
        when it is done."""
        with self._lock:
            entry, owner = self._claim(key, self._clock())
            if not owner:
                if entry.done.is_set():
                    self.hits += 1
                return entry.done.is_set()
            self.misses += 1
        threading.Thread(target=self._run, args=(key, entry), name="monitor-read", daemon=True).start()
        self._wake.set()
        return False

    def peek(self, key: K) -> bool:
        """Whether ``key`` has a finished, unexpired value (no computation)."""
        with self._lock:
            e = self._entries.get(key)
            return e is not None and e.done.is_set() and self._serves(e, self._clock())

    def values(self) -> list:
        """The finished values held now (to amend in place, e.g. a saved link)."""
        with self._lock:
            return [e.value for e in self._entries.values() if e.done.is_set() and e.error is None]

    def clear(self) -> None:
        """Forget every value (the page's Refresh button, a saved link); requests are kept."""
        with self._lock:
            self._entries.clear()

    # ------------------------------------------------------------------ the keeper

    def keep_ahead(self) -> int:
        """One pass of the keeper: compute the next step's value of every live key asked for within
        ``keep_s`` whose next step starts within the lead. Returns how many it computed."""
        now = self._clock()
        todo: list[tuple[K, _Entry]] = []
        with self._lock:
            for key, asked in list(self._asked.items()):
                if now - asked > self.keep_s:
                    del self._asked[key]
                    continue
                nxt = self._advance(key)
                if nxt is None:
                    continue
                next_key, starts_at = nxt
                for _ in range(10_000):  # a step over already is not read: on to the step now (the keeper fell behind)
                    later = self._advance(next_key)
                    if later is None or later[1] > now:
                        break
                    next_key, starts_at = later
                cur = self._entries.get(key)
                took = cur.took_s if cur else 0.0
                lead = max(self.lead_s, 1.5 * took)
                last_start = starts_at - max(0.5, 1.2 * took)  # the latest start that is ready in time
                if next_key in self._entries:  # read already (ahead, or by a visit)
                    if now >= starts_at:  # and this key's step is over: the chain goes on from its successor
                        del self._asked[key]
                    continue
                if now < starts_at - lead:
                    continue
                if now - self._visited_at < self.quiet_s and now < last_start:  # a visit is being drawn
                    continue
                entry = self._entries[next_key] = _Entry()
                # the successor inherits the request (kept as long as this key would be); this key is
                # asked for again only by a visit before its step ends
                self._asked[next_key] = max(asked, self._asked.get(next_key, 0.0))
                del self._asked[key]
                todo.append((next_key, entry))
            self._trim()
        for key, entry in todo:
            self._run(key, entry)
            self.ahead += 1
        return len(todo)

    def start(self, period_s: float = 0.5) -> None:
        """Run the keeper in a daemon thread (once per process)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()

            def loop() -> None:
                while not self._stop.is_set():
                    try:
                        self.keep_ahead()
                    except Exception:  # a failed computation is stored on its entry; the keeper goes on
                        pass
                    self._wake.wait(period_s)
                    self._wake.clear()

            self._thread = threading.Thread(target=loop, name="monitor-page-keeper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ internals

    def _claim(self, key: K, now: float) -> tuple[_Entry, bool]:
        """Under the lock: ``key``'s entry if it is being computed or may be served, else a new one
        (True: the caller computes it). Marks ``key`` asked for."""
        self._asked[key] = now
        entry = self._entries.get(key)
        if entry is not None and (not entry.done.is_set() or self._serves(entry, now)):
            return entry, False
        entry = self._entries[key] = _Entry()
        self._trim()
        return entry, True

    def _serves(self, entry: _Entry, now: float) -> bool:
        """Whether a finished entry's value may still be served (no error, within the TTL)."""
        return entry.error is None and now - entry.computed_at < self._ttl()

    def _run(self, key: K, entry: _Entry) -> None:
        t = time.perf_counter()
        try:
            entry.value = self._compute(key)
        except BaseException as exc:  # stored for every waiter; a later request computes again
            entry.error = exc
        finally:
            entry.took_s = time.perf_counter() - t
            entry.computed_at = self._clock()
            entry.done.set()

    def _trim(self) -> None:
        """Drop the oldest finished entries beyond ``max_entries`` (caller holds the lock)."""
        extra = len(self._entries) - self.max_entries
        if extra <= 0:
            return
        done = sorted((k for k, e in self._entries.items() if e.done.is_set()), key=lambda k: self._entries[k].computed_at)
        for k in done[:extra]:
            del self._entries[k]
