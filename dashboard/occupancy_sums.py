"""A set of runs' occupancy as sums per bucket, which add across sets of runs.

Every history panel but the Gantt is a sum over runs per bucket (:mod:`.occupancy`'s
``*_sums``): runs present, seconds in a phase, runs finished, seconds held. So the sums
of the runs that can no longer change (settled: :mod:`.occupancy_memo`) can be kept on
their buckets, moved to a later range by :meth:`Sums.window`, and added to the sums of
the few runs that still change (:meth:`Sums.plus`), instead of summing a month of runs
again at every step of the page's clock. Pure numpy; no server.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import pandas as pd

from prefect_launch.dashboard import occupancy as OC


@dataclass(frozen=True)
class Sums:
    """Per bucket of ``b`` (and of ``hours``, the heatmap's hourly grid when the range's
    buckets are not hours), sums over one set of runs."""

    b: OC.Buckets
    present: np.ndarray  # (3, n) runs queued / pending / running at any moment
    seconds: np.ndarray  # (3, n) seconds in each phase
    finished: np.ndarray  # (len(FINISHED), n) runs finished in the bucket, by end state
    held: np.ndarray  # (n,) runs holding a slot at any moment
    held_s: np.ndarray  # (3, n) run-, GPU- and CPU-seconds held
    groups: tuple  # the queued panel's group labels
    queued_s: np.ndarray  # (len(groups), n) waiting seconds
    queued_n: np.ndarray  # (len(groups), n) runs that waited
    hours: Optional[OC.Buckets] = None
    hour_s: Optional[np.ndarray] = None  # (2, hours.n) run- and GPU-seconds held per hour

    def window(self, b: OC.Buckets, hours: Optional[OC.Buckets]) -> "Sums":
        """The same sums on a later range of the same step (``b`` may start later and end
        later): buckets before ``b`` dropped, buckets after the sums' own end are zero.
        Only right for runs that end inside the sums' own range (settled runs)."""
        return replace(self, b=b, present=self.b.moved(self.present, b), seconds=self.b.moved(self.seconds, b),
                       finished=self.b.moved(self.finished, b), held=self.b.moved(self.held[None], b)[0],
                       held_s=self.b.moved(self.held_s, b), queued_s=self.b.moved(self.queued_s, b),
                       queued_n=self.b.moved(self.queued_n, b), hours=hours,
                       hour_s=None if hours is None or self.hours is None else self.hours.moved(self.hour_s, hours))

    def plus(self, other: "Sums") -> "Sums":
        """Both sets of runs' sums (the same buckets); group labels united by name."""
        if other.b != self.b or other.hours != self.hours:
            raise ValueError("sums on different buckets do not add: window() them first")
        groups = self.groups + tuple(g for g in other.groups if g not in self.groups)
        at = {g: i for i, g in enumerate(groups)}

        def grouped(a: np.ndarray, b: np.ndarray, b_groups: tuple) -> np.ndarray:
            out = np.zeros((len(groups), self.b.n), dtype=np.result_type(a, b))
            out[: len(self.groups)] += a
            out[[at[g] for g in b_groups]] += b
            return out

        return replace(self, present=self.present + other.present, seconds=self.seconds + other.seconds,
                       finished=self.finished + other.finished, held=self.held + other.held,
                       held_s=self.held_s + other.held_s, groups=groups,
                       queued_s=grouped(self.queued_s, other.queued_s, other.groups),
                       queued_n=grouped(self.queued_n, other.queued_n, other.groups),
                       hour_s=None if self.hour_s is None else self.hour_s + other.hour_s)

    def panels(self) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, Optional[pd.DataFrame]]:
        """(status, queued, load, heatmap) frames as :mod:`.occupancy` makes them; heatmap
        None when the range's buckets are not hours and no hourly sums were made."""
        b = self.b
        load = OC.load_table(self.held, self.present[0], self.held_s, b)
        if b.step_s == 3600:
            hm = OC.heatmap_table(b, load["busy"].to_numpy(), load["gpus"].to_numpy())
        elif self.hours is not None and self.hour_s is not None:
            hm = OC.heatmap_table(self.hours, self.hour_s[0] / 3600.0, self.hour_s[1] / 3600.0)
        else:
            hm = None
        return (OC.status_table(self.present, self.seconds, self.finished, b),
                OC.queued_table(list(self.groups), self.queued_s, self.queued_n, b), load, hm)


def sums(rows: pd.DataFrame, ph: OC.Phases, groups: Optional[pd.Series], b: OC.Buckets,
         hours: Optional[OC.Buckets] = None) -> Sums:
    """The sums of ``rows`` (prepared rows, their phases ``ph`` and queued-panel group labels
    aligned with them) on ``b``, and on ``hours`` if given."""
    pres, secs, fin = OC.status_sums(rows, ph, b)
    held = OC.resources(rows)
    h, held_s = OC.held_sums(ph, b, held)
    names, q_s, q_n = OC.queued_sums(ph, groups, b)
    return Sums(b=b, present=pres, seconds=secs, finished=fin, held=h, held_s=held_s, groups=tuple(names),
                queued_s=q_s, queued_n=q_n, hours=hours, hour_s=None if hours is None else OC.hour_sums(ph, hours, held[0]))
