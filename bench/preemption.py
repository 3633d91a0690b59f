"""Preemptible fill: regular GPU jobs' wait on a box a sweep keeps busy, with preemption on and off.

A 2-GPU declared agent; a sweep of T one-GPU trials (S seconds each) is submitted first; once the
sweep holds both GPUs, B bursts of R regular one-GPU jobs (1 s each) arrive G seconds apart. Each
regular job's wait is its first Running timestamp minus its creation (the runs' own state history).
"On": the trials are `--preemptible` (grace P s); "off": the same trials as regular runs, which is what
stock Prefect or W&B Launch gives (regular jobs queue behind the sweep). The GPU busy share is the
share of GPU-seconds held by some run between the first start and the last end (from the state
histories: Running -> end of that life), and lost trials are those that never completed.

    .venv/bin/python bench/preemption.py [--trials 20] [--trial-seconds 20] [--bursts 3] [--burst-size 2]

Last line JSON: wait_p50_s, wait_p95_s, wait_p50_no_preempt_s, gpu_busy_share, gpu_busy_share_while_waiting,
idle_breakdown_s, lost_trials, speedup_p50 (details: both scenarios, the load average at start and end, the folder
holding each scenario's saved state histories). ``--analyse <folder>/pre-on-histories.json`` prints the breakdown
of a saved run again.

Where the idle GPU-seconds go (`idle_breakdown`, from the same histories, tested in
tests/test_preemption_bench.py): transition gaps while work waited, split at the next run's Pending claim
(``release_to_pending``: the previous process exiting, the release, the placement; ``pending_to_running``: the
engine start), ``preemption_grace``, the ``drain_tail`` (nothing waiting, after the last first start) and
``nothing_waiting``. ``gpu_busy_share_while_waiting`` is the share over the time some run was Scheduled or
Pending. On 2026-12-05 (loaded box) the transition gaps were ~80 % of the idle time and the drain tail ~2 %, so
the whole-interval share stays the goal figure: it measures the scheduler's transitions, not the workload's end.
The histories do not say which GPU a run had: lives are laid on slots by `assign_slots` (totals do not depend
on it; the split between the two transition parts does, a little).

Where a run change went on 2026-12-06 (timestamps written by the engine, the zygote and the agent, 6 x 4.5-s
trials, load ~13-20 on the 2 cores): the engine outlived its Completed state by ~1 s waiting for Prefect's
heartbeat thread (fixed: compat.engine_heartbeats_unjoined) and then 3.2-5.3 s in the interpreter's finalization
(fixed: warm_engine.finish_fast; 0.3-0.5 s after); capacity back -> next placement 0.2-0.8 s (the release already
wakes the intake: tests/test_preemption_run_end.py); placement -> Pending 0.2-0.9 s; Pending -> the engine's order
1-2.7 s (Prefect's submit, then a FlowRunExecutorContext per run: client, control channel, an events websocket,
0.26-0.62 s); order -> Running 2-4.6 s (load_flow ~1 s: deployment read, pull steps, flow import).
Since cf5e8c4 the process worker keeps one FlowRunExecutorContext for its life (workers/backends/executor_context.py):
Pending -> the engine's order 0.34 s (median of 24 changes, load ~2-4; before: 0.88 and 1.07 s at load ~1-7), a whole
change (end -> next Running) 1.04 s (before: 1.87 and 2.88 s); leaving the context no longer delays the capacity's
release either. At load 7-15 the same code's changes took 3.16 s (placement 1.26, Pending 0.36, order 0.85, engine
start 0.88): every step stretches with the box's CPU contention, none stands out. ``--trace <folder>`` (each scenario also reports it as ``transition_steps_s``) gives these steps from a
saved run: previous end -> placement (the agent's log) -> Pending claim -> the engine's order (its first log line)
-> Running.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _stack import percentile, prefect_server  # noqa: E402
from launch_helpers import agent, apply_queue, cli_json, deploy_probe, wait_final  # noqa: E402

PRESETS = {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _submit(job: str, rec: Path, seconds: float, *extra: str) -> str:
    return cli_json("submit", job, "--param", f"record_dir={rec}", "--param", f"seconds={seconds}", *extra)["run_ids"][0]


def _history(run_id: str) -> list[tuple[str, float]]:
    """The run's state history, oldest first: (state type, timestamp)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
    return [(s.type.value, s.timestamp.timestamp()) for s in states]


def lives_of(history: list[tuple[str, float]]) -> list[tuple[float, float]]:
    """(start, end) of each time a run held a GPU: Running -> the next state that is not Running."""
    out, start = [], None
    for kind, ts in history:
        if kind == "RUNNING" and start is None:
            start = ts
        elif kind != "RUNNING" and start is not None:
            out.append((start, ts))
            start = None
    return out


def _lives(run_id: str) -> list[tuple[float, float]]:
    return lives_of(_history(run_id))


# ------------------------------------------------------------------ where the idle GPU-seconds go (pure)
WAITING_TYPES = ("SCHEDULED", "PENDING")


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """Seconds of [a, b] covered by ``spans`` (merged, sorted)."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


def waiting_spans(histories: dict[str, list[tuple[str, float]]]) -> list[tuple[float, float]]:
    """When at least one run was Scheduled or Pending (a state of that type up to the run's next state), merged."""
    spans = []
    for states in histories.values():
        for (kind, ts), (_, nxt) in zip(states, states[1:]):
            if kind in WAITING_TYPES:
                spans.append((ts, nxt))
    return _merge(spans)


def assign_slots(lives: list[tuple[float, float, str, int]], gpus: int = 2) -> list[list[tuple[float, float, str, int]]]:
    """The lives (start, end, run id, life index) laid on ``gpus`` slots: each goes to the free slot that was
    freed last (the run it followed there), or, where none is free yet (timestamps a few ms apart), to the one
    that frees first. The histories do not say which GPU a run had; the total idle time does not depend on it."""
    slots: list[list[tuple[float, float, str, int]]] = [[] for _ in range(gpus)]
    for life in sorted(lives):
        start = life[0]
        free = [s for s in slots if not s or s[-1][1] <= start]
        if free:
            slot = max(free, key=lambda s: s[-1][1] if s else float("-inf"))
        else:
            slot = min(slots, key=lambda s: s[-1][1])
        slot.append(life)
    return slots


def _pending_before(states: list[tuple[str, float]], start: float) -> Optional[float]:
    """The timestamp of the last Pending state before ``start`` (the claim that led to that Running)."""
    pend = [ts for kind, ts in states if kind == "PENDING" and ts <= start]
    return pend[-1] if pend else None


def idle_breakdown(histories: dict[str, list[tuple[str, float]]], gpus: int = 2) -> dict:
    """Where the idle GPU-seconds between the first start and the last end go, from the runs' state histories.

    Each slot's gaps (one run's Running end -> the next Running on that slot; the first start; the slot's last
    end -> the interval's end) are split by what was waiting then:
    - ``release_to_pending``: work waited; from the previous run's end (or the interval's start) to the next
      run's Pending claim - the previous process exiting, capacity released, the next placement;
    - ``pending_to_running``: work waited; from that claim to the next run's Running - the engine start;
    - ``preemption_grace``: work waited and the previous life on the slot was a preempted one (its run has a
      later life): from its Running end (the stop asked) to the next run's Running;
    - ``drain_tail``: nothing waited, after the last run's first start (one GPU idle while the other finishes);
    - ``nothing_waiting``: nothing waited, earlier (the workload left the GPU idle).
    Also ``total`` (= their sum = 2 x interval - busy) and ``busy_share_while_waiting``: GPU-seconds held / GPU-
    seconds available while at least one run was Scheduled or Pending.
    """
    lives = [(s, e, rid, i) for rid, states in histories.items() for i, (s, e) in enumerate(lives_of(states))]
    keys = ("release_to_pending", "pending_to_running", "preemption_grace", "drain_tail", "nothing_waiting")
    out = {k: 0.0 for k in keys}
    if not lives:
        return {**out, "total": 0.0, "interval_s": 0.0, "busy_share": None, "busy_share_while_waiting": None}
    n_lives = {rid: len(lives_of(states)) for rid, states in histories.items()}
    t0, t1 = min(l[0] for l in lives), max(l[1] for l in lives)
    all_started = max(lives_of(states)[0][0] for states in histories.values() if lives_of(states))
    waiting = _merge([(max(a, t0), min(b, t1)) for a, b in waiting_spans(histories)])
    busy_spans = [(s, e) for s, e, _, _ in lives]

    def add_gap(a: float, b: float, prev: Optional[tuple], nxt: Optional[tuple]) -> None:
        if b <= a:
            return
        waited = _merge([(max(a, s), min(b, e)) for s, e in waiting if min(b, e) > max(a, s)])
        # the part nothing waited: drain tail after the last first start, else plain idle
        idle_spans, cur = [], a
        for s, e in waited:
            if s > cur:
                idle_spans.append((cur, s))
            cur = max(cur, e)
        if cur < b:
            idle_spans.append((cur, b))
        for s, e in idle_spans:
            tail = max(0.0, e - max(s, all_started))
            out["drain_tail"] += tail
            out["nothing_waiting"] += (e - s) - tail
        w = sum(e - s for s, e in waited)
        if not w:
            return
        if nxt is None:  # the slot's last end while work waited (it went to the other slot): placement
            out["release_to_pending"] += w
            return
        if prev is not None and prev[3] < n_lives[prev[2]] - 1:
            out["preemption_grace"] += w
            return
        pend = _pending_before(histories[nxt[2]], nxt[0])
        split = b if pend is None else min(b, max(a, pend))
        before = _overlap(a, split, waited)
        out["release_to_pending"] += before
        out["pending_to_running"] += w - before

    for slot in assign_slots(lives, gpus):
        if not slot:
            add_gap(t0, t1, None, None)
            continue
        add_gap(t0, slot[0][0], None, slot[0])
        for prev, nxt in zip(slot, slot[1:]):
            add_gap(prev[1], nxt[0], prev, nxt)
        add_gap(slot[-1][1], t1, slot[-1], None)
    waiting_s = sum(e - s for s, e in waiting)
    held_waiting = sum(_overlap(s, e, waiting) for s, e in busy_spans)
    busy = sum(e - s for s, e in busy_spans)
    out = {k: round(v, 2) for k, v in out.items()}
    out.update(total=round(gpus * (t1 - t0) - busy, 2), interval_s=round(t1 - t0, 2),
               waiting_s=round(waiting_s, 2),
               busy_share=round(min(1.0, busy / (gpus * (t1 - t0))), 3) if t1 > t0 else None,
               busy_share_while_waiting=round(min(1.0, held_waiting / (gpus * waiting_s)), 3) if waiting_s else None)
    return out


def breakdown_figures(histories: dict[str, list[tuple[str, float]]]) -> dict:
    b = idle_breakdown(histories)
    return {"gpu_busy_share_while_waiting": b.pop("busy_share_while_waiting"),
            "idle_breakdown_s": {k: v for k, v in b.items() if k != "busy_share"}}


# ------------------------------------------------------------------ one run change, step by step (pure)
LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) \|")
LOG_VIEW = re.compile(r"Flow run '([\w-]+)' - View at .*/flow-run/([0-9a-f-]+)")
LOG_SUBMITTING = re.compile(r"Worker '[^']+' submitting flow run '([0-9a-f-]+)'")
LOG_ORDER = re.compile(r"Flow run '([\w-]+)' - Running \d+ deployment pull step")
STEPS = ("placed", "pending", "order", "running")


def log_marks(lines: list[str], day_start: float) -> dict[str, dict[str, list[float]]]:
    """From an agent's log (local ``HH:MM:SS.mmm`` times on the day starting at ``day_start``): per run id, when
    the agent placed it (its ``starting flow run`` line, just before Prefect's ``submitting``) and when its engine
    had the order (``Running N deployment pull step(s)``, the engine's first line: load_flow begins)."""
    names = {m[1]: m[2] for line in lines if (m := LOG_VIEW.search(line))}
    marks: dict[str, dict[str, list[float]]] = {}
    last_start: Optional[float] = None
    for line in lines:
        t = LOG_TIME.match(line)
        if t is None:
            continue
        at = day_start + int(t[1]) * 3600 + int(t[2]) * 60 + float(t[3])
        if "starting flow run with" in line:
            last_start = at
        elif (m := LOG_SUBMITTING.search(line)) and last_start is not None:
            marks.setdefault(m[1], {}).setdefault("placed", []).append(last_start)
            last_start = None
        elif (m := LOG_ORDER.search(line)) and m[1] in names:
            marks.setdefault(names[m[1]], {}).setdefault("order", []).append(at)
    return marks


def transition_steps(histories: dict[str, list[tuple[str, float]]], marks: dict[str, dict[str, list[float]]],
                     gpus: int = 2) -> dict:
    """Each run change on a slot (a completed life -> the next life's Running; preempted lives left out: their gap
    is the grace) split at the next run's placement, its Pending claim and its engine's order: medians in s of
    ``placed`` (previous end -> placement), ``pending`` (-> claim), ``order`` (-> engine has the order: Prefect's
    submit, the executor context, the warm engine's hand-over), ``running`` (-> Running: load_flow, the engine's
    start) and ``gap`` (the whole change). A step is left out of a change whose marks are missing or out of order."""
    lives = [(s, e, rid, i) for rid, states in histories.items() for i, (s, e) in enumerate(lives_of(states))]
    n_lives = {rid: len(lives_of(states)) for rid, states in histories.items()}
    steps: dict[str, list[float]] = {k: [] for k in ("gap", *STEPS)}
    for slot in assign_slots(lives, gpus):
        for prev, nxt in zip(slot, slot[1:]):
            if prev[3] < n_lives[prev[2]] - 1:  # preempted: the grace, not a change of ours
                continue
            end, start, rid = prev[1], nxt[0], nxt[2]
            pend = _pending_before(histories[rid], start)
            near = lambda kind: [t for t in marks.get(rid, {}).get(kind, []) if end - 60 <= t <= start + 0.5]
            placed, order = near("placed"), near("order")
            points = [end, placed[-1] if placed else None, pend, order[-1] if order else None, start]
            steps["gap"].append(start - end)
            for i, key in enumerate(STEPS):
                a, b = points[i], points[i + 1]
                if a is not None and b is not None and b >= a - 0.05:
                    steps[key].append(max(0.0, b - a))
    return {k: {"median": round(statistics.median(v), 2), "p90": round(percentile(v, 0.9), 2), "n": len(v)}
            for k, v in steps.items() if v}


def trace_folder(folder: Path, name: str = "pre-on") -> dict:
    """`transition_steps` of a saved run: ``<folder>/<name>-histories.json`` and ``<folder>/agent-<name>.log``."""
    hist = json.loads((folder / f"{name}-histories.json").read_text())
    histories = {r: [tuple(s) for s in h["states"]] for r, h in hist.items()}
    first = min(h["created"] for h in hist.values())
    day = time.localtime(first)
    day_start = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, 0, 0, 0, 0, 0, -1))
    lines = (folder / f"agent-{name}.log").read_text(errors="replace").splitlines()
    return transition_steps(histories, log_marks(lines, day_start))


def _first_running(run_id: str) -> float:
    lives = _lives(run_id)
    return lives[0][0] if lives else float("nan")


def scenario(tmp: Path, preempt: bool, trials: int, trial_s: float, bursts: int, size: int, gap: float,
             grace: str) -> dict:
    name = f"pre-{'on' if preempt else 'off'}"
    q = apply_queue(tmp, {"name": name, "presets": PRESETS, "default_preset": "g1", "preempt_grace": grace})
    job = deploy_probe(q, name)
    rec = tmp / name
    with agent([q], name, "cpu=4,memory=8Gi,gpu=2", tmp):
        extra = ("--preemptible",) if preempt else ()
        sweep = [_submit(job, rec, trial_s, *extra) for _ in range(trials)]
        say(f"{name}: {trials} trials submitted; waiting for them to hold both GPUs")
        deadline = time.time() + 120
        while time.time() < deadline and sum(bool(_lives(r)) or _is_running(r) for r in sweep[:2]) < 2:
            time.sleep(1)
        regular: list[str] = []
        for b in range(bursts):
            regular += [_submit(job, rec, 1.0) for _ in range(size)]
            say(f"{name}: burst {b + 1}/{bursts} of {size} regular jobs")
            time.sleep(gap)
        runs = {str(r.id): r for r in wait_final(sweep + regular, timeout=trials * trial_s * 2 + 900)}
    hist = {r: {"kind": "trial" if r in sweep else "regular", "created": runs[r].created.timestamp(),
                "states": _history(r)} for r in sweep + regular}
    (tmp / f"{name}-histories.json").write_text(json.dumps(hist))
    waits = [_first_running(r) - runs[r].created.timestamp() for r in regular]
    lives = [life for r in sweep + regular for life in _lives(r)]
    t0, t1 = min(s for s, _ in lives), max(e for _, e in lives)
    busy = sum(e - s for s, e in lives) / (2 * (t1 - t0))
    lost = sum(runs[r].state_name != "Completed" for r in sweep)
    preempted = sum(len(_lives(r)) - 1 for r in sweep)
    out = {"wait_p50_s": round(statistics.median(waits), 2), "wait_p95_s": round(percentile(waits, 0.95), 2),
           "gpu_busy_share": round(min(1.0, busy), 3), "lost_trials": lost, "preemptions": preempted,
           "regular_failed": sum(runs[r].state_name != "Completed" for r in regular)}
    out.update(breakdown_figures({r: h["states"] for r, h in hist.items()}))
    try:
        out["transition_steps_s"] = trace_folder(tmp, name)
    except (OSError, ValueError) as exc:  # the log is the agent's; the figures above do not need it
        say(f"{name}: no step trace ({exc})")
    say(f"{name}: {out}")
    return out


def _is_running(run_id: str) -> bool:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state_name == "Running"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--trial-seconds", type=float, default=20.0)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst-size", type=int, default=2)
    ap.add_argument("--gap", type=float, default=15.0, help="seconds between bursts")
    ap.add_argument("--grace", default="5s", help="the queue's preempt_grace")
    ap.add_argument("--analyse", metavar="HISTORIES_JSON",
                    help="only print the breakdown of a run's saved <tmp>/pre-on-histories.json (or pre-off)")
    ap.add_argument("--trace", metavar="FOLDER",
                    help="only print the run changes step by step (transition_steps) of a run's saved folder")
    args = ap.parse_args()
    if args.trace:
        print(json.dumps({n: trace_folder(Path(args.trace), n) for n in ("pre-on", "pre-off")
                          if (Path(args.trace) / f"{n}-histories.json").exists()}))
        return
    if args.analyse:
        hist = json.loads(Path(args.analyse).read_text())
        print(json.dumps(breakdown_figures({r: [tuple(s) for s in h["states"]] for r, h in hist.items()})))
        return
    tmp = Path(tempfile.mkdtemp(prefix="preempt-bench-"))
    loadavg_start = Path("/proc/loadavg").read_text().split()[:3]
    with prefect_server():
        on = scenario(tmp, True, args.trials, args.trial_seconds, args.bursts, args.burst_size, args.gap, args.grace)
        off = scenario(tmp, False, args.trials, args.trial_seconds, args.bursts, args.burst_size, args.gap, args.grace)
    figures = {"wait_p50_s": on["wait_p50_s"], "wait_p95_s": on["wait_p95_s"],
               "wait_p50_no_preempt_s": off["wait_p50_s"], "gpu_busy_share": on["gpu_busy_share"],
               "gpu_busy_share_while_waiting": on["gpu_busy_share_while_waiting"],
               "idle_breakdown_s": on["idle_breakdown_s"], "lost_trials": on["lost_trials"],
               "speedup_p50": round(off["wait_p50_s"] / on["wait_p50_s"], 2) if on["wait_p50_s"] else None,
               "details": {"on": on, "off": off, "args": vars(args),
                           "loadavg": Path("/proc/loadavg").read_text().split()[:3],
                           "loadavg_at_start": loadavg_start, "histories": str(tmp)}}
    print(f"regular jobs' wait p50: {on['wait_p50_s']} s with preemption, {off['wait_p50_s']} s without "
          f"({figures['speedup_p50']}x); GPU busy {on['gpu_busy_share']:.1%} ({on['gpu_busy_share_while_waiting']:.1%} "
          f"while work waited); lost trials {on['lost_trials']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
