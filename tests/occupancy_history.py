"""A made-up run history for the occupancy tests: runs with fixed times, and the run index
as it reads at any moment (each row written when its run last changed state), with the
faults an index sees: a settled run retried, one deleted, an old run synced late."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd

from prefect_launch.blocks.run_index import IndexRow
from prefect_launch.dashboard import index_view as IV

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
S = 1_000_000
ENDS = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
BLANK = IndexRow(id="").model_dump()  # an index row's fields and defaults


def at(sec: float) -> int:
    return IV.us(T0) + int(sec * S)


class History:
    """Runs with fixed times (seconds from T0); the index as it reads at a moment."""

    def __init__(self, n: int, seed: int = 5) -> None:
        rng = np.random.default_rng(seed)
        self.q0 = rng.uniform(0, 1500, n)
        self.p = self.q0 + rng.exponential(30, n)
        self.pending_seen = rng.random(n) > 0.3
        self.st = self.p + rng.uniform(0, 5, n)
        self.en = self.st + rng.exponential(90, n)
        self.never_started = rng.random(n) < 0.05  # cancelled while waiting
        self.end_type = rng.choice(ENDS, n)
        self.gpu = rng.integers(0, 3, n)
        self.agent = rng.integers(0, 4, n)
        self.dep = rng.integers(0, 3, n)
        self.owner = rng.choice(["ana", "bo", "cy"], n)
        self.deleted: set[int] = set()
        self.late_from: dict[int, float] = {}  # run -> when its row first reached the index
        self.retried: dict[int, float] = {}  # run -> when it was rescheduled after ending

    def row(self, i: int, t: float) -> tuple[dict, float]:
        """(index row of run ``i`` at ``t``, when that row was last written)."""
        q0, p, st, en = self.q0[i], self.p[i], self.st[i], self.en[i]
        r = dict(id=f"r{i}", name=f"run-{i}", queue="q", owner=str(self.owner[i]), deployment_id=f"d{self.dep[i]}",
                 expected_start_us=at(q0), queued_us=at(q0), gpu=float(self.gpu[i]), cpu=1.0)
        if i in self.retried and t >= self.retried[i]:  # back in the queue after its end
            r.update(state_type="SCHEDULED", queued_us=at(self.retried[i]), expected_start_us=at(self.retried[i]))
            return r, self.retried[i]
        if self.never_started[i]:
            if t >= p:
                r.update(state_type="CANCELLED", end_us=at(p), state_us=at(p))
                return r, p
            return dict(r, state_type="SCHEDULED"), q0
        label = f"agent a{self.agent[i]}: cpu=1,memory=1Gi,gpu={self.gpu[i]}; gpus {','.join(str(g) for g in range(self.gpu[i])) or 'none'}; cores {i % 8}"
        if t < p:
            return dict(r, state_type="SCHEDULED"), q0
        r.update(placement=label, pending_us=at(p) if self.pending_seen[i] else None)
        if t < st:
            return dict(r, state_type="PENDING"), p
        r.update(start_us=at(st))
        if t < en:
            return dict(r, state_type="RUNNING"), st
        r.update(state_type=str(self.end_type[i]), end_us=at(en), state_us=at(en))
        return r, en

    def index(self, t: float, deployments: dict) -> pd.DataFrame:
        recs = []
        for i in range(len(self.q0)):
            if self.q0[i] > t or i in self.deleted or self.late_from.get(i, -1) > t:
                continue
            r, written = self.row(i, t)
            written = max(written, self.late_from.get(i, written))
            recs.append(dict(BLANK, **r, synced_ms=int(at(written) // 1000)))  # IndexRow's fields (checked once below)
        return IV.prepare(pd.DataFrame(recs), deployments)
