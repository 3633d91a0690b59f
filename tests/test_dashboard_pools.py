"""The monitor's thread pools: a view's reads run on IO_POOL and fan their requests out; a task
that waited on the pool it runs in deadlocked once every worker waited (a page that never drew)."""

from __future__ import annotations

import threading
import time

from prefect_launch.dashboard import api as A


def test_tasks_on_the_io_pool_that_fan_out_all_finish_when_the_pool_is_full():
    """More tasks than IO_POOL has workers, each waiting on its own fan-out (as fetch_workers,
    fetch_runs and fetch_now_counts do under a view's read): every one finishes."""
    started = threading.Barrier(A.IO_WORKERS, timeout=10)

    def task(k: int) -> list[int]:
        if k < A.IO_WORKERS:
            started.wait()  # every worker is busy in a task before any fans out
        return A.fan_out(lambda x: (time.sleep(0.01), x * k)[1], range(4))

    futures = [A.IO_POOL.submit(task, k) for k in range(2 * A.IO_WORKERS)]
    assert [f.result(timeout=30) for f in futures] == [[0, k, 2 * k, 3 * k] for k in range(2 * A.IO_WORKERS)]


def test_a_fan_out_inside_a_fan_out_runs_in_line():
    """A fan-out from a FAN_POOL thread runs on that thread: waiting on its own pool could deadlock."""
    pairs: list[tuple[int, int]] = []  # (outer call's thread, inner call's thread)

    def outer(x: int) -> list[int]:
        me = threading.get_ident()
        return A.fan_out(lambda y: (pairs.append((me, threading.get_ident())), x + y)[1], range(3))

    assert A.fan_out(outer, range(3)) == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert len(pairs) == 9 and all(o == i for o, i in pairs)
    assert threading.get_ident() not in {o for o, _ in pairs}  # the outer calls did run on the pool
