"""GPU check: a real launch agent's GPU figures against NVML read directly, run by run.

On a machine with an NVIDIA GPU and driver, by default (through a real launch agent):

* a sampler thread of this script reads every GPU through pynvml itself (bench/gpu_truth.py:
  utilisation, memory used, the compute processes' memory, power, the total energy counter), from
  before anything starts until after the last run ends; nothing of prefect-launch is in that path;
* a throw-away Prefect server, a queue with a 1-GPU and a 2-GPU preset, and an agent declared to
  have one GPU (``--capacity gpu=1``; its CPUs and memory detected);
* two 1-GPU runs of bench/gpu_flow.py (bench/gpu_job.py: a matmul or PTX FMA loop and a device
  allocation of --mem-mib) submitted together, then one 2-GPU run;
* per 1-GPU run, over the run's own interval (its Prefect start and end times): the agent's average
  and maximum utilisation (within 10 points), peak GPU memory (5 %), energy (10 %, against the
  counter's delta) and pinned GPU (the device NVML saw busy) against NVML's; the two runs never
  overlap; the 2-GPU run is refused with its reason (scheduling history) and never starts;
  ``report``'s GPU-hours for the queue match the runs' intervals (10 %, or 5 s a run).

Human-readable progress goes to stderr; stdout is one JSON line. Exit 0 when every check holds,
1 when one fails, 2 (with a clear message) when there is no usable GPU.

``--fake-nvml`` rehearses the plumbing on a machine without a GPU: the agent and the sampler each get
the project's NVML fake and the job only waits. It proves nothing about a GPU (the JSON says
``"fake_nvml": true``). ``--direct`` (the older check) skips the agent and samples a pinned child
process with RunSampler.

Usage: python bench/gpu_check.py [--seconds 30] [--mem-mib 1024] [--interval 0.5] [--fake-nvml]
       python bench/gpu_check.py --direct [--gpu INDEX] [--seconds 15] [--interval 0.5] [--mem-mib 1024]
"""


from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional
from uuid import uuid4

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_job.py")


FAKE_SPEC = {"gpus": [{"name": "Fake GPU (rehearsal)", "memory_total": 16 << 30}], "util": {"0": 90},
             "mem_used": {"0": 2 << 30}, "power_w": {"0": 250}}
QUEUE = "gpu-check"
BLOCK = "gpu-check"


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def no_gpu(detail: str) -> int:
    say(f"gpu_check: no usable NVIDIA GPU here ({detail}). This check needs a machine with an NVIDIA GPU "
        "and its driver; nothing was run. (`--fake-nvml` rehearses the plumbing without one.)")
    print(json.dumps({"check": "gpu_check", "ok": False, "error": "no-gpu", "detail": detail}))
    return 2


def via_agent(args) -> int:
    """Two 1-GPU runs and a 2-GPU request through a real 1-GPU agent, each figure checked against NVML."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pathlib import Path

    import gpu_truth as T

    fake = args.fake_nvml
    nv = None
    if fake:
        from prefect_launch.workers.metrics.nvml import FakeNVML

        nv = FakeNVML.from_spec(FAKE_SPEC)
    try:
        truth = T.NvmlTruthSampler(interval_s=args.truth_interval, nv=nv)
    except Exception as exc:
        return no_gpu(f"NVML: {type(exc).__name__}: {exc}")
    if not truth.devices:
        return no_gpu("NVML reports 0 devices")
    for d in truth.devices:
        say(f"NVML GPU [{d['index']}] {d['name']} {d['memory_total'] / 2**30:.1f} GiB {d['uuid']}")
    truth.start()
    time.sleep(2.0)  # idle baseline, before any run
    idle_before = time.time()

    from _stack import ROOT, background, prefect_server

    py = sys.executable
    cli = [py, "-m", "prefect_launch.cli"]
    work = Path(tempfile.mkdtemp(prefix="launch-gpu-check-"))
    env = dict(os.environ, LAUNCH_SAMPLE_INTERVAL=str(args.interval), LAUNCH_METRICS_BLOCK=BLOCK)
    env.pop("LAUNCH_METRICS_URL", None)
    if fake:
        env["LAUNCH_FAKE_NVML"] = json.dumps(FAKE_SPEC)
    memory = "1Gi" if fake else "16Gi"
    out: dict = {"check": "gpu_check", "fake_nvml": fake, "gpus": truth.devices, "seconds": args.seconds,
                 "mem_mib": args.mem_mib}

    def run_cli(*a: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([*cli, *a], env=env, capture_output=True, text=True)
        if check and p.returncode != 0:
            raise RuntimeError(f"prefect-launch {' '.join(a[:2])} failed ({p.returncode}): {p.stderr.strip()[-800:]}")
        return p

    try:
        with prefect_server():
            env.update(PREFECT_API_URL=os.environ["PREFECT_API_URL"], PREFECT_HOME=os.environ["PREFECT_HOME"])
            from prefect import get_client
            from prefect.states import Cancelled

            from prefect_launch.blocks.metrics_store import RunMetricsStore

            RunMetricsStore(url=f"sqlite:///{work / 'metrics.db'}").save(BLOCK, overwrite=True)
            (work / "q.yaml").write_text(
                f"queues:\n  - name: {QUEUE}\n    presets:\n"
                f"      one-gpu: {{cpu: 1, memory: {memory}, gpu: 1}}\n"
                f"      two-gpu: {{cpu: 1, memory: {memory}, gpu: 2}}\n    default_preset: one-gpu\n")
            run_cli("queue", "apply", str(work / "q.yaml"))
            code = ("from prefect import flow\n"
                    f"flow.from_source(source={str(ROOT / 'bench')!r}, entrypoint='gpu_flow.py:gpu_matmul').deploy("
                    f"name='gpu-check', work_pool_name={QUEUE!r}, build=False, push=False, print_next_steps=False)")
            subprocess.run([py, "-c", code], check=True, env=env, capture_output=True)
            agent_args = [*cli, "agent", "--queue", QUEUE, "--name", "gpu-check-agent", "--capacity", "gpu=1"]
            with background(agent_args, work / "agent.log", env=env):
                agents: list = []
                for _ in range(90):
                    p = run_cli("agent", "ls", "--json", check=False)
                    try:
                        agents = [a for a in json.loads(p.stdout or "[]") if a["online"]]
                    except ValueError:
                        agents = []
                    if agents:
                        break
                    time.sleep(1)
                if not agents:
                    raise RuntimeError(f"the agent did not come online; see {work / 'agent.log'}")
                cap = agents[0]["capacity"]
                out["agent_capacity"] = {"cpu": cap["cpu"], "memory": cap["memory"], "gpu": cap["gpu"]}
                say(f"agent capacity: cpu={cap['cpu']:g} memory={cap['memory'] / 2**30:.0f}GiB gpu={cap['gpu']}")

                def submit(preset: str, tag: str, check: bool = True) -> tuple[Optional[str], str]:
                    p = run_cli("submit", "gpu-matmul/gpu-check", "--queue", QUEUE, "--preset", preset, "--json",
                                "--param", f"seconds={args.seconds}", "--param", f"mem_mib={args.mem_mib}",
                                "--param", f"record_dir={work}", "--param", f"tag={tag}",
                                "--param", f"dry_run={json.dumps(fake)}", check=check)
                    if p.returncode != 0:
                        return None, (p.stderr or p.stdout).strip()
                    return json.loads(p.stdout)["run_ids"][0], ""

                ones = {tag: submit("one-gpu", tag)[0] for tag in ("a", "b")}
                # refused at submission (the CLI knows the agents' capacity) or later by the agent
                two, two_error = submit("two-gpu", "two", check=False)
                say(f"submitted 1-GPU runs {ones}; the 2-GPU request: {two or two_error}")
                history: list = []
                deadline = time.time() + 2 * args.seconds + 600
                with get_client(sync_client=True) as client:
                    while time.time() < deadline:
                        runs = {t: client.read_flow_run(i) for t, i in ones.items()}
                        if two and not any(r.get("error_code") in T.REFUSAL_CODES for r in history):
                            p = run_cli("history", two, "--json", check=False)
                            try:
                                history = json.loads(p.stdout or "[]")
                            except ValueError:
                                history = []
                        if all(r.state and r.state.is_final() for r in runs.values()):
                            break
                        time.sleep(1)
                    two_run = client.read_flow_run(two) if two else None
                    ever_started = two_run is not None and two_run.start_time is not None
                    if two_run is not None and not (two_run.state and two_run.state.is_final()):
                        client.set_flow_run_state(two, Cancelled(message="gpu_check: refused on a 1-GPU agent"),
                                                  force=True)
                    time.sleep(3)  # the agent writes each run's summary as it releases the run
                    reports = {t: json.loads(run_cli("runs", "show", i, "--json", check=False).stdout or "{}")
                               for t, i in ones.items()}
                    p = run_cli("report", "--by", "queue", "--queue", QUEUE, "--since", "6h", "--json", check=False)
                    try:
                        report = json.loads(p.stdout or "{}")
                    except ValueError:
                        report = {"error": (p.stdout + p.stderr)[-500:]}
    except Exception as exc:
        truth.stop()
        say(f"gpu_check: {exc}")
        print(json.dumps({**out, "ok": False, "error": str(exc)[:2000]}))
        return 1
    samples = truth.stop()

    checks: list = []
    per_run = []
    intervals = {}
    idle = T.idle_memory(samples, before=idle_before)
    for tag, rid in ones.items():
        fr = runs[tag]
        rep = reports[tag]
        rec = json.loads((work / f"gpu_job-{tag}.json").read_text()) if (work / f"gpu_job-{tag}.json").exists() else {}
        state = fr.state.type.value if fr.state else None
        entry = {"tag": tag, "run_id": rid, "state": state, "job": rec}
        if fr.start_time is None or fr.end_time is None:
            entry["checks"] = [{"what": "run_ran", "ok": False, "agent": state, "truth": "COMPLETED"}]
        else:
            t0, t1 = fr.start_time.timestamp(), fr.end_time.timestamp()
            intervals[tag] = (t0, t1)
            indices = (rep.get("run") or {}).get("gpu_indices") or []
            tr = T.run_truth(samples, indices or [0], t0, t1, idle_mem=idle)
            summary = rep.get("summary") or {}
            entry.update(interval_s=round(t1 - t0, 3), truth=tr,
                         agent={k: summary.get(k) for k in (*T.AGENT_FIELDS.values(), "samples", "gpu_used_s")},
                         agent_window=[(rep.get("run") or {}).get("started_at"), (rep.get("run") or {}).get("ended_at")])
            aw = entry["agent_window"]
            if all(aw):  # diagnosis: NVML over the agent's own window (its process's life), not checked
                from datetime import datetime

                a0, a1 = (datetime.fromisoformat(str(x).replace("Z", "+00:00")).timestamp() for x in aw)
                wide = T.run_truth(samples, indices or [0], a0, a1, idle_mem=idle)
                entry["truth_over_agent_window"] = {"window_s": round(a1 - a0, 3), "energy_j": wide["energy_j"],
                                                    "avg_util_pct": wide["avg_util_pct"]}
            entry["checks"] = [{"what": "run_completed", "ok": state == "COMPLETED", "agent": state,
                                "truth": "COMPLETED"},
                               {"what": "pinned_by_bus_order", "ok": rec.get("cuda_device_order") == "PCI_BUS_ID",
                                "agent": rec.get("cuda_device_order"), "truth": "PCI_BUS_ID"},
                               *T.compare_run(summary, indices, tr)]
        checks += entry["checks"]
        per_run.append(entry)
    pairs = T.overlapping(intervals)
    checks.append({"what": "no_overlap_on_1_gpu", "ok": len(intervals) == 2 and not pairs, "agent": pairs,
                   "truth": "none overlap"})
    checks.append(T.refusal(history, ever_started, submit_error=None if two else two_error))
    rows = [r for r in (report.get("rows") or []) if r.get("queue") == QUEUE]
    expected_h = T.gpu_hours((1, t0, t1) for t0, t1 in intervals.values())
    checks.append(T.check_gpu_hours(rows[0].get("gpu_alloc_h") if rows else None, expected_h, len(intervals)))
    ok = T.verdict(checks)
    for c in checks:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[c["ok"]]
        say(f"  {mark} {c['what']}: agent {c.get('agent')!r} vs truth {c.get('truth')!r} {c.get('tolerance', '')}")
    say(f"gpu_check: {'every check holds' if ok else 'a check failed'}"
        + (" (FAKE NVML rehearsal: proves nothing about a GPU)" if fake else ""))
    failed = [c["what"] for c in checks if c["ok"] is False]
    print(json.dumps({**out, "ok": ok, "failed": failed, "runs": per_run, "no_overlap": {"pairs": pairs},
                      "refusal": checks[-2], "report_gpu_hours": checks[-1], "report_rows": rows,
                      "nvml_errors": truth.errors, "truth_samples": len(samples)}, default=str))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direct", action="store_true", help="sample a pinned child directly, without an agent")
    ap.add_argument("--gpu", type=int, default=None, help="NVML index to pin (default: the first)")
    ap.add_argument("--seconds", type=float, default=None, help="each run's GPU work (default 30; --direct 15)")
    ap.add_argument("--interval", type=float, default=0.5, help="the agent's sampling interval")
    ap.add_argument("--truth-interval", type=float, default=0.25, help="the NVML sampler's interval")
    ap.add_argument("--mem-mib", type=int, default=1024)
    ap.add_argument("--fake-nvml", action="store_true",
                    help="rehearse the plumbing with the NVML fake and a job that only waits (proves nothing)")
    args = ap.parse_args()
    if args.seconds is None:
        args.seconds = 15.0 if args.direct else 30.0
    if not args.direct:
        return via_agent(args)

    from prefect_launch.blocks.metrics_records import RunRecord
    from prefect_launch.blocks.metrics_store import RunMetricsStore
    from prefect_launch.workers.metrics.nvml import get_nvml
    from prefect_launch.workers.metrics.sampler import RunSampler

    nvml = get_nvml()
    gpus = nvml.detect_gpus()
    if not gpus:
        print(f"gpu_check: no NVIDIA GPU found ({nvml.error or 'NVML reports 0 devices'}); "
              "this check needs a machine with an NVIDIA GPU and driver", file=sys.stderr)
        return 2
    print("detected GPUs:")
    for g in gpus:
        print(f"  [{g.index}] {g.name}  {g.memory_total_bytes / 2**30:.1f} GiB  {g.uuid}")
    idx = gpus[0].index if args.gpu is None else args.gpu
    if idx not in {g.index for g in gpus}:
        print(f"gpu_check: GPU index {idx} not among {[g.index for g in gpus]}", file=sys.stderr)
        return 2
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(idx), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    print(f"pinned indices: [{idx}] (CUDA_VISIBLE_DEVICES={idx})")

    with tempfile.TemporaryDirectory(prefix="launch-gpu-check-") as d:
        store = RunMetricsStore(url=f"sqlite:///{d}/m.db")
        rec = RunRecord(flow_run_id=str(uuid4()), queue="gpu-check", job="matmul", gpu_indices=[idx])
        proc = subprocess.Popen([sys.executable, JOB, str(args.seconds), str(args.mem_mib)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = RunSampler(store, rec, proc.pid, [idx], allocated_cpus=1, allocated_memory_bytes=None,
                             interval_s=args.interval, nvml=nvml).start()
        out, _ = proc.communicate(timeout=args.seconds + 180)
        summary = sampler.stop("COMPLETED" if proc.returncode == 0 else "FAILED")
        series = store.series(rec.flow_run_id)
    print("job output:", out.strip().replace("\n", " | "))
    utils = [p["gpu_util_pct"] for p in series if p["gpu_util_pct"] is not None]
    mems = [p["gpu_mem_bytes"] for p in series if p["gpu_mem_bytes"] is not None]
    print(f"samples: {len(series)} stored, GPU data source: {sampler.gpu_source}")
    if utils:
        print(f"sampled GPU utilisation: avg {statistics.mean(utils):.1f}%  max {max(utils):.1f}%  "
              f"median {statistics.median(utils):.1f}%")
    if mems:
        print(f"sampled GPU memory: peak {max(mems) / 2**20:.0f} MiB (allocated by the job: {args.mem_mib} MiB + working set)")
    print(f"summary: avg_gpu_util_pct={summary.avg_gpu_util_pct} peak_gpu_mem_bytes={summary.peak_gpu_mem_bytes} "
          f"gpu_mem_total_bytes={summary.gpu_mem_total_bytes} avg_cpu_pct={summary.avg_cpu_pct}")
    print(json.dumps({
        "gpus": [g.name for g in gpus], "pinned": [idx], "source": sampler.gpu_source,
        "avg_gpu_util_pct": summary.avg_gpu_util_pct, "max_gpu_util_pct": summary.max_gpu_util_pct,
        "peak_gpu_mem_bytes": summary.peak_gpu_mem_bytes, "job_rc": proc.returncode,
    }))
    if proc.returncode != 0:
        print("gpu_check: the GPU job failed (see its output above)", file=sys.stderr)
        return 1
    if not utils or max(utils) <= 0:
        print("gpu_check: sampled GPU utilisation stayed at 0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
