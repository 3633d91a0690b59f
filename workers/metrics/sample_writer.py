"""The store side of a run's sampler: the writer thread's batches, its backoff, and the late write.

`RunSampler` (sampler.py) measures on its sampling thread and appends to a bounded buffer; this half,
its base class, runs on the writer thread: it upserts the run record first, then sends the buffer in
batches, backs off while the store is down (counting what a full buffer pushed out as lost), and after
the run, when the store is still down, keeps trying on a *late writer* thread. Nothing the store does
raises out of it. The shared state (``_buffer``, ``_lock``, ``_wake``, ``_closing``, the counters) is
made by `RunSampler.__init__`; the two halves are one object because both threads update those counters.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from prefect_launch.blocks.metrics_records import MetricSample, RunSummary

if TYPE_CHECKING:
    from prefect_launch.blocks.metrics_store import RunMetricsStore


class StoreWriter:
    """The writer-thread half of `RunSampler` (see the module doc)."""

    store: "RunMetricsStore | None"

    def _writer_loop(self) -> None:
        t0 = time.thread_time()
        try:
            if self.store is None:
                return
            retry_at = 0.0
            closing_failures = 0
            while True:
                closing = self._closing.is_set()
                now = time.monotonic()
                if closing and now >= self._close_deadline:
                    if not self._run_upserted or self._buffer:
                        self._last_flush_ok = False
                    return
                if now >= retry_at or closing:
                    ok = self._flush_once()
                    if ok:
                        retry_at = 0.0
                        if closing:
                            with self._lock:
                                if not self._buffer:
                                    return
                    else:
                        lo, hi = self.retry_backoff_s
                        backoff = min(hi, lo * 2 ** min(self._failures - 1, 20))
                        retry_at = time.monotonic() + backoff
                        if closing:  # short waits: the run is over and stop() is waiting
                            closing_failures += 1
                            time.sleep(min(0.25 * closing_failures, 1.0,
                                           max(0.0, self._close_deadline - time.monotonic())))
                            continue
                wait = self.flush_interval_s
                if retry_at:
                    wait = min(wait, max(0.0, retry_at - time.monotonic()))
                self._wake.wait(wait)
                self._wake.clear()
        finally:
            self.self_cpu_s += time.thread_time() - t0

    def _flush_once(self) -> bool:
        """One attempt to upsert the record (first time) and send the buffer."""
        assert self.store is not None
        try:
            if not self._run_upserted:
                self.store.upsert_run(self.record)
                self._run_upserted = True
            with self._lock:
                batch = list(self._buffer)
            if batch:
                self.store.record_samples(batch)
                with self._lock:
                    # drop what was sent. Samples pushed out of the full buffer while this batch was
                    # in flight were counted lost, but those in the batch were stored after all.
                    sent = set(map(id, batch))
                    kept = set(map(id, self._buffer))
                    self.lost_samples -= sum(1 for s in batch if id(s) not in kept)
                    self._buffer = deque(s for s in self._buffer if id(s) not in sent)
                self.stored_samples += len(batch)
        except Exception as exc:
            self._failures += 1
            self._last_flush_ok = False
            if self._failures == 1 or self._failures % 10 == 0:
                self.log.warning(
                    "metrics store write failed for run %s (attempt %d, %d samples buffered, %d lost): %s",
                    self.record.flow_run_id, self._failures, len(self._buffer), self.lost_samples,
                    str(exc).splitlines()[0][:300],
                )
            return False
        if self._failures:
            self.log.info(
                "metrics store reachable again for run %s after %d failed attempts", self.record.flow_run_id, self._failures
            )
        self._failures = 0
        self._last_flush_ok = True
        return True

    def _late_write(self, left: list[MetricSample], summary: RunSummary) -> None:
        """Store what the end of the run could not, once the store is back (samples are idempotent)."""
        assert self.store is not None and self.late_written is not None
        deadline = time.monotonic() + self.late_write_s
        lo, hi = self.retry_backoff_s
        attempt = 0
        while True:
            try:
                self.store.upsert_run(self.record)
                if left:
                    self.store.record_samples(left)
                self.store.write_summary(self.record.flow_run_id, summary)
            except Exception as exc:
                attempt += 1
                wait = min(hi, lo * 2 ** min(attempt - 1, 20))
                if time.monotonic() + wait > deadline:
                    self.log.error(
                        "metrics store still unreachable %.0f s after run %s ended: its last %d samples "
                        "and its summary are lost (%s)", self.late_write_s, self.record.flow_run_id, len(left),
                        str(exc).splitlines()[0][:300],
                    )
                    return
                time.sleep(wait)
                continue
            self.stored_samples += len(left)
            self.lost_samples = summary.lost_samples
            self.log.info(
                "metrics store reachable again: run %s's last %d samples and its summary stored late "
                "(%d samples lost)", self.record.flow_run_id, len(left), summary.lost_samples,
            )
            self.late_written.set()
            return
