"""Out-of-process sampler: measures a run's process tree from the worker, with no change to the job.

(About 560 lines: the sampling thread's one tick reads CPU, memory, I/O, network and GPUs of one tree
together, and splitting that read would split one consistent sample; the store side is sample_writer.py,
energy is energy.py.)

One :class:`RunSampler` per run, two daemon threads:

* the *sampling* thread reads, every ``interval_s``, the CPU times and disk I/O
  of the run's process tree (the root pid and all its descendants, found
  through one scan of the process table; descendants that get re-parented stay
  tracked), the memory the run holds counted once (its memory cgroup's charge
  when it has one, else the PSS of the tree: :func:`~prefect_launch.workers.agent.limits.run_memory`,
  the figure the agent's memory watch uses; stored as ``rss_bytes``), network
  bytes when the run has its own network namespace, and the allocated GPUs'
  utilisation and memory through NVML;
* energy, where it can be measured: the allocated GPUs' energy counters through NVML
  (``nvmlDeviceGetTotalEnergyConsumption``; power readings integrated over the interval
  on GPUs without the counter) and the run's share of the CPU packages' RAPL energy
  (:mod:`~prefect_launch.workers.metrics.rapl`: package energy x the run's CPU time / the host's
  busy CPU time). Each sample carries the interval's joules, or None; the record's
  ``extra`` says how each figure was measured or why it is unavailable
  (``gpu_energy``, ``cpu_energy``);
* the *writer* thread upserts the :class:`RunRecord` first, then sends the
  buffered samples to the store in batches. When the store is down, samples stay
  in a bounded buffer and are retried with exponential backoff; samples pushed
  out of a full buffer are counted in ``lost_samples`` and logged. When the store
  is still down as the run ends, :meth:`RunSampler.stop` returns the summary at
  once (unsent samples counted as lost in it) and a *late writer* thread keeps
  trying, for up to ``late_write_s``, to store the rest of the samples, the
  record's end state and the summary, whose ``lost_samples`` then counts only
  what was really dropped. Nothing the store does ever raises out of the sampler
  or slows the sampling.

CPU accounting: for every tracked process the sampler reads utime+stime plus the
CPU of children it has reaped (cutime+cstime, one read of /proc/PID/stat), so
the CPU of short-lived children that exit between two ticks is still counted
(minus what was already counted while they lived). A process that appears
during an interval is counted from its start.

Use from async code::

    sampler = RunSampler(store, record, pid=proc.pid, gpu_indices=[0], allocated_cpus=4,
                         allocated_memory_bytes=16 << 30)
    sampler.start()                        # returns at once
    ...
    summary = await sampler.astop("COMPLETED")   # or sampler.stop(...) from a thread
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import psutil

from prefect_launch.compat.psutil import ppid_map
from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.workers.agent.limits import MemoryGroup, run_memory
from prefect_launch.workers.cluster.usage import MemberTracker
from prefect_launch.workers.metrics.nvml import Nvml, get_nvml
from prefect_launch.workers.metrics.sample_writer import StoreWriter
from prefect_launch.workers.metrics.energy import EnergyMeter
from prefect_launch.workers.metrics.summary import SummaryAccumulator, WasteThresholds

# one scan of /proc for all parent links (what Process.children uses internally); None on other psutil builds
_ppid_map = ppid_map

_DEFAULT_LOG = logging.getLogger("prefect_launch.sampler")

# One scan of the process table serves every sampler that ticks within
# _SCAN_MAX_AGE_S of it (ticks are aligned to a common grid, so N runs cost one scan).
_SCAN_MAX_AGE_S = 0.1
_scan_lock = threading.Lock()
_scan_cache: tuple[float, dict[int, list[int]]] = (-1e9, {})


def _children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, from a scan at most _SCAN_MAX_AGE_S old."""
    global _scan_cache
    with _scan_lock:
        t, m = _scan_cache
        now = time.monotonic()
        if now - t <= _SCAN_MAX_AGE_S:
            return m
        children: dict[int, list[int]] = {}
        for child, parent in _ppid_map().items():
            children.setdefault(parent, []).append(child)
        _scan_cache = (time.monotonic(), children)
        return children


def _next_grid(now: float, interval: float) -> float:
    """The next multiple of ``interval`` at least interval/2 after ``now``."""
    k = int((now + interval / 2) // interval) + 1
    return k * interval


def _net_ns(pid: int | str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _net_dev_bytes(pid: int) -> Optional[tuple[int, int]]:
    """(rx, tx) bytes over the non-loopback interfaces of pid's network namespace."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    rx = tx = 0
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            continue
        parts = rest.split()
        if len(parts) >= 9:
            rx += int(parts[0])
            tx += int(parts[8])
    return rx, tx


class RunSampler(StoreWriter):
    """Samples one run's process tree into a :class:`RunMetricsStore`.

    Parameters
    ----------
    store: where to write (None: keep only the in-memory summary).
    record: the run; ``cpu``/``memory_bytes``/``gpu_indices``/``started_at``/``state``
        are filled from the other arguments and the clock when missing.
    pid: root process of the run (the flow-run process or a container's init as
        seen from the worker's pid namespace).
    gpu_indices: NVML indices pinned to the run; no GPU sampling when empty.
    allocated_cpus, allocated_memory_bytes: the allocation, for shares and waste.
    interval_s: sampling period.
    nvml: an :class:`~prefect_launch.workers.metrics.nvml.Nvml`, a pynvml-like module
        (e.g. :class:`~prefect_launch.workers.metrics.nvml.FakeNVML`), or None for the
        shared real NVML (only opened when ``gpu_indices`` is non-empty).
    batch_size: send when this many samples wait (or every ``flush_interval_s``).
    max_buffer: samples kept while the store is unreachable; older ones are lost.
    on_sample: called in the sampling thread with each new sample (idle checks).
    """

    def __init__(
        self,
        store: RunMetricsStore | None,
        record: RunRecord,
        pid: int,
        gpu_indices: list[int] | None = None,
        allocated_cpus: float | None = None,
        allocated_memory_bytes: int | None = None,
        interval_s: float = 1.0,
        nvml: Any = None,
        batch_size: int = 10,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
        *,
        max_buffer: int = 3600,
        flush_interval_s: float | None = None,
        retry_backoff_s: tuple[float, float] = (1.0, 60.0),
        stop_flush_timeout_s: float = 5.0,
        late_write_s: float = 600.0,
        recent: int = 600,
        thresholds: WasteThresholds | None = None,
        on_sample: Callable[[MetricSample], None] | None = None,
    ) -> None:
        self.store = store
        self.pid = int(pid)
        self.gpu_indices = list(gpu_indices or record.gpu_indices or [])
        self.allocated_cpus = allocated_cpus if allocated_cpus is not None else record.cpu
        self.allocated_memory_bytes = (
            allocated_memory_bytes if allocated_memory_bytes is not None else record.memory_bytes
        )
        self.record = record.model_copy(
            update={
                "cpu": self.allocated_cpus,
                "memory_bytes": self.allocated_memory_bytes,
                "gpu_indices": self.gpu_indices,
                "gpu": record.gpu if record.gpu is not None else len(self.gpu_indices),
            }
        )
        self.interval_s = float(interval_s)
        self.batch_size = max(1, int(batch_size))
        self.flush_interval_s = flush_interval_s if flush_interval_s is not None else max(
            self.interval_s * self.batch_size, 1.0
        )
        self.max_buffer = max(1, int(max_buffer))
        self.retry_backoff_s = retry_backoff_s
        self.stop_flush_timeout_s = stop_flush_timeout_s
        self.late_write_s = late_write_s
        self.thresholds = thresholds
        self.on_sample = on_sample
        self.log = logger or _DEFAULT_LOG
        self._nvml_arg = nvml
        self._nvml: Optional[Nvml] = None

        # state shared between the threads
        self._lock = threading.Lock()
        self._buffer: deque[MetricSample] = deque()
        self._wake = threading.Event()
        self._stop_sampling = threading.Event()
        self._closing = threading.Event()
        self._close_deadline = 0.0
        self._run_upserted = False
        self._last_flush_ok = True
        self._failures = 0

        # results
        self.lost_samples = 0
        self.stored_samples = 0
        self.samples_taken = 0
        self.self_cpu_s = 0.0  # CPU time of this sampler's own threads
        self.recent: deque[MetricSample] = deque(maxlen=recent)
        self.summary: Optional[RunSummary] = None
        self.late_written: Optional[threading.Event] = None  # set once a late write succeeded
        self.gpu_source: Optional[str] = None  # "process" / "device" once GPU data was read
        self.gpu_mem_total_bytes: Optional[int] = None
        self.memory_source: Optional[str] = None  # "cgroup" or "pss" once memory was read
        self._energy: Optional[EnergyMeter] = None  # decided once NVML is open (sampling thread)
        self._energy_prev: tuple[Any, Any] = (None, None)  # (GPU reading, RAPL reading) at the last tick

        # sampling-thread state
        self._acc = SummaryAccumulator()
        self._members = MemberTracker()  # a cluster run's figures per member
        self._procs: dict[int, psutil.Process] = {}
        self._prev_tot: dict[int, float] = {}
        self._prev_parent: dict[int, Optional[int]] = {}
        self._prev_io: dict[int, tuple[int, int]] = {}
        self._prev_net: Optional[tuple[int, int]] = None
        self._own_netns = False
        self._prev_m: Optional[float] = None
        self._primed = False
        self._sampler_thread: Optional[threading.Thread] = None
        self._writer_thread: Optional[threading.Thread] = None
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------ lifecycle

    @property
    def latest(self) -> Optional[MetricSample]:
        return self.recent[-1] if self.recent else None

    def start(self) -> "RunSampler":
        """Start both threads and return at once (the record is upserted by the writer)."""
        if self._started:
            return self
        self._started = True
        if self.record.started_at is None:
            self.record = self.record.model_copy(update={"started_at": datetime.now(timezone.utc)})
        if self.record.state is None:
            self.record = self.record.model_copy(update={"state": "RUNNING"})
        name = f"launch-sampler-{self.record.flow_run_id[:8]}"
        self._sampler_thread = threading.Thread(target=self._sample_loop, name=name, daemon=True)
        self._writer_thread = threading.Thread(target=self._writer_loop, name=name + "-w", daemon=True)
        self._writer_thread.start()
        self._sampler_thread.start()
        return self

    def stop(self, exit_state: str) -> RunSummary:
        """Take a final sample, flush (bounded by ``stop_flush_timeout_s``), write the summary.

        Blocks for at most about ``stop_flush_timeout_s`` plus one store round trip;
        never raises for store problems. When the store is still unreachable, the
        unsent samples and the summary go to a late writer (see the module doc).
        Calling it twice returns the same summary.
        """
        if self._stopped and self.summary is not None:
            return self.summary
        self._stopped = True
        ended = datetime.now(timezone.utc)
        if self._sampler_thread is not None:
            self._stop_sampling.set()
            self._sampler_thread.join(timeout=max(10.0, 5 * self.interval_s))
        if self._writer_thread is not None:
            self._close_deadline = time.monotonic() + self.stop_flush_timeout_s
            self._closing.set()
            self._wake.set()
            self._writer_thread.join(timeout=self.stop_flush_timeout_s + 30)
        with self._lock:
            left = list(self._buffer)
            self._buffer.clear()
        dropped = self.lost_samples  # pushed out of a full buffer: gone for good
        self.lost_samples += len(left)
        if self._nvml is not None and self.gpu_mem_total_bytes is None and self.gpu_indices:
            self.gpu_mem_total_bytes = self._nvml.memory_total(self.gpu_indices)
        self.record = self.record.model_copy(update={"ended_at": ended, "state": exit_state})
        if self._members.active:
            self.record = self.record.model_copy(update={"extra": {**self.record.extra,
                                                                   "members": self._members.results()}})
        summary = self._acc.finish(
            self.record,
            exit_state,
            ended_at=ended,
            lost_samples=self.lost_samples,
            gpu_mem_total_bytes=self.gpu_mem_total_bytes,
            thresholds=self.thresholds,
        )
        self.summary = summary
        if self.store is None or not self._started:
            return summary
        stored = False
        if not left and self._last_flush_ok:
            t0 = time.thread_time()
            try:
                self.store.upsert_run(self.record)
                self.store.write_summary(self.record.flow_run_id, summary)
                stored = True
            except Exception as exc:
                self.log.error("could not store the summary of run %s: %s", self.record.flow_run_id,
                               str(exc).splitlines()[0][:300])
            finally:
                self.self_cpu_s += time.thread_time() - t0
        if not stored:
            self.log.error(
                "metrics store unreachable at the end of run %s: %d samples and the summary not stored yet "
                "(%d lost in all so far); retrying for up to %.0f s",
                self.record.flow_run_id, len(left), self.lost_samples, self.late_write_s,
            )
            late = summary.model_copy(update={"lost_samples": dropped})
            self.late_written = threading.Event()
            threading.Thread(target=self._late_write, args=(left, late), daemon=True,
                             name=f"launch-sampler-{self.record.flow_run_id[:8]}-late").start()
        return summary

    def track(self, pid: int, member: Optional[str] = None, gpu_indices: Optional[list[int]] = None) -> None:
        """Also measure ``pid`` and its descendants, e.g. a cluster run's other members (the run's figures
        are then the sum over its members). Named with ``member``, its figures are also kept on their own
        (the run record's ``extra["members"]``, see workers/cluster/usage.py)."""
        if member is not None:
            self._members.add_root(int(pid), member, gpu_indices)
        if int(pid) == self.pid:
            return
        try:
            self._procs.setdefault(int(pid), psutil.Process(int(pid)))
        except psutil.Error:
            pass

    def note_peak_memory(self, peak_bytes: Optional[int]) -> None:
        """A peak seen elsewhere before :meth:`stop` (e.g. ``RunLimits.peak_rss``, read from the kernel
        as the run's memory group is removed); the summary's peak is the larger."""
        if peak_bytes:
            self._acc.note_peak_memory(int(peak_bytes))

    async def astop(self, exit_state: str) -> RunSummary:
        """:meth:`stop` in a thread, for async callers."""
        return await asyncio.to_thread(self.stop, exit_state)

    # ------------------------------------------------------------- sampling

    def _sample_loop(self) -> None:
        t0 = time.thread_time()
        try:
            if self.gpu_indices:
                try:
                    self._nvml = get_nvml(self._nvml_arg)
                    if self._nvml.available:
                        self.gpu_mem_total_bytes = self._nvml.memory_total(self.gpu_indices)
                except Exception as exc:  # pragma: no cover - defensive
                    self.log.warning("NVML unavailable for run %s: %s", self.record.flow_run_id, exc)
            self._energy = EnergyMeter(self._nvml, self.gpu_indices)
            self.record = self.record.model_copy(update={"extra": {**self.record.extra, **self._energy.notes()}})
            own = _net_ns("self")
            theirs = _net_ns(self.pid)
            self._own_netns = bool(own and theirs and own != theirs)
            self._tick()  # prime the baselines
            next_t = _next_grid(time.monotonic(), self.interval_s)
            while not self._stop_sampling.wait(max(0.0, next_t - time.monotonic())):
                self._tick()
                # fell behind (suspended, overloaded): skip ticks, do not burst
                next_t = max(next_t + self.interval_s, _next_grid(time.monotonic(), self.interval_s))
            self._tick()  # final sample
        except Exception:  # pragma: no cover - never let a bug kill the worker
            self.log.exception("sampler for run %s stopped on an error", self.record.flow_run_id)
        finally:
            self.self_cpu_s += time.thread_time() - t0

    def _discover(self) -> None:
        """Add every descendant of the tracked processes (one /proc scan)."""
        # before priming the root is the only known process; afterwards only the processes
        # we track (never a bare pid again: it may have been reused by another process)
        roots = set(self._procs) if self._primed else {self.pid}
        if not roots:
            return
        try:
            if _ppid_map is not None:
                children = _children_map()
                todo = list(roots)
                seen = set(todo)
                while todo:
                    p = todo.pop()
                    for c in children.get(p, ()):
                        if c not in seen:
                            seen.add(c)
                            todo.append(c)
                found = seen
            else:  # pragma: no cover
                found = set(roots)
                for r in list(roots):
                    try:
                        found.update(c.pid for c in psutil.Process(r).children(recursive=True))
                    except psutil.Error:
                        pass
        except Exception:
            found = set(roots)
        for pid in found:
            if pid not in self._procs:
                try:
                    self._procs[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass

    def _tick(self) -> None:
        now_m = time.monotonic()
        ts = datetime.now(timezone.utc)
        energy_prev, energy_now = self._energy_prev, self._energy.read()
        self._energy_prev = energy_now
        self._discover()
        tot_now: dict[int, float] = {}
        parent_now: dict[int, Optional[int]] = {}
        io_now: dict[int, tuple[int, int]] = {}
        io_ok = False
        for pid, p in list(self._procs.items()):
            try:
                with p.oneshot():
                    ct = p.cpu_times()
                    tot_now[pid] = ct.user + ct.system + ct.children_user + ct.children_system
                    parent_now[pid] = p.ppid()
                    try:
                        io = p.io_counters()
                        io_now[pid] = (io.read_bytes, io.write_bytes)
                        io_ok = True
                    except (psutil.AccessDenied, AttributeError, NotImplementedError):
                        pass
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                del self._procs[pid]
            except psutil.AccessDenied:
                del self._procs[pid]
        mem = self._read_memory(tot_now)
        if not self._primed:
            self._primed = True
            self._remember(now_m, tot_now, parent_now, io_now)
            self._read_net()
            return
        wall = now_m - (self._prev_m or now_m)
        if not tot_now or wall <= 0:
            # nothing alive to measure (the run ended): no sample
            self._remember(now_m, tot_now, parent_now, io_now)
            return
        cpu = 0.0
        for pid, tot in tot_now.items():
            cpu += tot - self._prev_tot.get(pid, 0.0)
        for pid, prev in self._prev_tot.items():
            if pid not in tot_now and self._prev_parent.get(pid) in tot_now:
                # reaped by a tracked parent: its full CPU is now in the parent's
                # children times; what we counted while it lived must not count twice
                cpu -= prev
        cpu = max(0.0, cpu)
        rd = wr = 0
        for pid, (r, w) in io_now.items():
            pr, pw = self._prev_io.get(pid, (0, 0))
            rd += max(0, r - pr)
            wr += max(0, w - pw)
        net = self._read_net()
        cpu_pct = 100.0 * cpu / wall
        share = cpu_pct / self.allocated_cpus if self.allocated_cpus else None
        gpu_util = gpu_mem = None
        if self._nvml is not None and self._nvml.available and self.gpu_indices:
            try:
                usage = self._nvml.usage(self.gpu_indices, tot_now.keys())
                if usage is not None:
                    gpu_util, gpu_mem, self.gpu_source = usage.util_pct, usage.mem_bytes, usage.source
            except Exception as exc:  # pragma: no cover - defensive
                self.log.debug("NVML sample failed: %s", exc)
        gpu_j, cpu_j = self._energy.since(energy_prev, energy_now, wall, cpu)
        if self._members.active:
            try:
                self._members.tick(tot_now, self._prev_tot, parent_now, self._prev_parent, self._procs, wall,
                                   self._nvml)
            except Exception as exc:  # pragma: no cover - defensive: the run's own figures come first
                self.log.debug("per-member figures failed for run %s: %s", self.record.flow_run_id, exc)
        sample = MetricSample(
            flow_run_id=self.record.flow_run_id,
            ts=ts,
            interval_s=round(wall, 3),
            cpu_pct=round(cpu_pct, 2),
            cpu_share_pct=round(share, 2) if share is not None else None,
            rss_bytes=mem.used if mem else None,
            read_bytes=rd if io_ok else None,
            write_bytes=wr if io_ok else None,
            net_rx_bytes=net[0] if net else None,
            net_tx_bytes=net[1] if net else None,
            gpu_util_pct=gpu_util,
            gpu_mem_bytes=gpu_mem,
            num_procs=len(tot_now),
            gpu_energy_j=gpu_j,
            cpu_energy_j=cpu_j,
        )
        self._remember(now_m, tot_now, parent_now, io_now)
        self._emit(sample)

    def _read_memory(self, alive: dict[int, float]):
        """The run's memory counted once (see :func:`run_memory`); feeds the kernel's peak to the summary."""
        if not alive:
            return None
        try:
            mem = run_memory(self.pid, MemoryGroup.open(self.record.flow_run_id),
                             [self._procs[pid] for pid in alive if pid in self._procs])
        except Exception as exc:  # pragma: no cover - defensive
            self.log.debug("memory reading failed for run %s: %s", self.record.flow_run_id, exc)
            return None
        if mem.peak > mem.used:  # the kernel's peak, between our ticks
            self._acc.note_peak_memory(mem.peak)
        if self.memory_source != mem.source:
            self.memory_source = mem.source
            extra = {**self.record.extra, "memory_measure": mem.source}
            self.record = self.record.model_copy(update={"extra": extra})
        return mem

    def _remember(self, now_m, tot_now, parent_now, io_now) -> None:
        self._prev_m = now_m
        self._prev_tot = tot_now
        self._prev_parent = parent_now
        self._prev_io = io_now

    def _read_net(self) -> Optional[tuple[int, int]]:
        if not self._own_netns:
            return None
        cur = _net_dev_bytes(self.pid)
        prev, self._prev_net = self._prev_net, cur
        if cur is None or prev is None:
            return None
        return max(0, cur[0] - prev[0]), max(0, cur[1] - prev[1])

    def _emit(self, sample: MetricSample) -> None:
        self.samples_taken += 1
        self._acc.add(sample)
        self.recent.append(sample)
        if self.store is not None:
            with self._lock:
                if len(self._buffer) >= self.max_buffer:
                    self._buffer.popleft()
                    self.lost_samples += 1
                    if self.lost_samples == 1 or self.lost_samples % 100 == 0:
                        self.log.warning(
                            "metrics buffer full for run %s (store unreachable): %d samples lost so far",
                            self.record.flow_run_id, self.lost_samples,
                        )
                self._buffer.append(sample)
                if len(self._buffer) >= self.batch_size:
                    self._wake.set()
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception as exc:
                self.log.warning("on_sample callback failed: %s", exc)
