"""Out-of-process sampler: measures a run's process tree from the worker, with no change to the job.

(The tree's processes are read by process_tree.py, the store side is sample_writer.py, energy is
energy.py; the sampling thread's one tick puts CPU, memory, I/O, network and GPUs into one sample.)

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
import threading
import time
from collections import deque
from datetime import datetime, timezone
from typing import Any, Callable, Optional


from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.workers.agent.limits import MemoryGroup, run_memory
from prefect_launch.workers.cluster.usage import MemberTracker
from prefect_launch.workers.metrics.nvml import Nvml, get_nvml
from prefect_launch.workers.metrics.sample_writer import StoreWriter
from prefect_launch.workers.metrics.energy import EnergyMeter
from prefect_launch.workers.metrics.process_tree import ProcessTree
from prefect_launch.workers.metrics.summary import SummaryAccumulator, WasteThresholds

_DEFAULT_LOG = logging.getLogger("prefect_launch.sampler")

def _next_grid(now: float, interval: float) -> float:
    """The next multiple of ``interval`` at least interval/2 after ``now``."""
    k = int((now + interval / 2) // interval) + 1
    return k * interval


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
        self._tree = ProcessTree(self.pid)
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
        self._tree.add(pid)

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
            self._tree.watch_network()
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

    def _tick(self) -> None:
        now_m = time.monotonic()
        ts = datetime.now(timezone.utc)
        energy_prev, energy_now = self._energy_prev, self._energy.read()
        self._energy_prev = energy_now
        tree = self._tree
        now = tree.read()
        mem = self._read_memory(now.cpu_s)
        if not tree.primed:
            tree.primed = True
            tree.remember(now_m, now)
            tree.net_since()
            return
        wall = now_m - (tree.prev_m or now_m)
        if not now.cpu_s or wall <= 0:
            # nothing alive to measure (the run ended): no sample
            tree.remember(now_m, now)
            return
        cpu = tree.cpu_since(now)
        rd, wr = tree.io_since(now)
        net = tree.net_since()
        cpu_pct = 100.0 * cpu / wall
        share = cpu_pct / self.allocated_cpus if self.allocated_cpus else None
        gpu_util = gpu_mem = None
        if self._nvml is not None and self._nvml.available and self.gpu_indices:
            try:
                usage = self._nvml.usage(self.gpu_indices, now.cpu_s.keys())
                if usage is not None:
                    gpu_util, gpu_mem, self.gpu_source = usage.util_pct, usage.mem_bytes, usage.source
            except Exception as exc:  # pragma: no cover - defensive
                self.log.debug("NVML sample failed: %s", exc)
        gpu_j, cpu_j = self._energy.since(energy_prev, energy_now, wall, cpu)
        if self._members.active:
            try:
                self._members.tick(now.cpu_s, tree.prev.cpu_s, now.parent, tree.prev.parent, tree.procs, wall,
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
            read_bytes=rd if now.io_ok else None,
            write_bytes=wr if now.io_ok else None,
            net_rx_bytes=net[0] if net else None,
            net_tx_bytes=net[1] if net else None,
            gpu_util_pct=gpu_util,
            gpu_mem_bytes=gpu_mem,
            num_procs=len(now.cpu_s),
            gpu_energy_j=gpu_j,
            cpu_energy_j=cpu_j,
        )
        tree.remember(now_m, now)
        self._emit(sample)

    def _read_memory(self, alive: dict[int, float]):
        """The run's memory counted once (see :func:`run_memory`); feeds the kernel's peak to the summary."""
        if not alive:
            return None
        try:
            mem = run_memory(self.pid, MemoryGroup.open(self.record.flow_run_id),
                             [self._tree.procs[pid] for pid in alive if pid in self._tree.procs])
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
