"""GPU check: detect GPUs with NVML, run a short GPU job pinned to one of them, sample it with RunSampler.

On a machine with an NVIDIA GPU this prints the detected GPUs, the pinned
indices, which GPU library the job used, and the sampled utilisation and memory
(per process when NVML reports it, else device-level); it exits 1 if utilisation
stayed at zero, and 2 (with a clear message) when there is no usable GPU.

The job is a child process with CUDA_VISIBLE_DEVICES pinned (as the launch worker
pins runs). It uses torch if importable, else CuPy, else the CUDA driver API
through ctypes (libcuda.so, always installed with the driver): a PTX kernel of
FMA loops launched repeatedly, plus a device allocation of --mem-mib.

By default the job runs under a real launch agent: a local Prefect server, a queue with a
one-GPU preset, an agent whose capacity is detected (NVML), a submission, and the agent's own
sampler; the script then prints the agent's detected GPUs, the indices the job saw in
CUDA_VISIBLE_DEVICES, and the utilisation and memory the agent recorded (`runs show`).
`--direct` skips the agent and samples a pinned child process with RunSampler directly.

Usage: python bench/gpu_check.py [--direct] [--gpu INDEX] [--seconds 15] [--interval 0.5] [--mem-mib 1024]
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
from uuid import uuid4

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_job.py")


def via_agent(args) -> int:
    """Detect, pin and sample through a launch agent, exactly as users' jobs run."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pathlib import Path

    from _stack import ROOT, background, prefect_server

    from prefect_launch.workers.metrics.nvml import get_nvml

    nvml = get_nvml()
    if not nvml.detect_gpus():
        print(f"gpu_check: no NVIDIA GPU found ({nvml.error or 'NVML reports 0 devices'}); "
              "this check needs a machine with an NVIDIA GPU and driver", file=sys.stderr)
        return 2
    py = sys.executable
    cli = [py, "-m", "prefect_launch.cli"]
    work = Path(tempfile.mkdtemp(prefix="launch-gpu-check-"))
    env = dict(os.environ, LAUNCH_SAMPLE_INTERVAL=str(args.interval))
    with prefect_server():
        env.update(PREFECT_API_URL=os.environ["PREFECT_API_URL"], PREFECT_HOME=os.environ["PREFECT_HOME"])
        (work / "q.yaml").write_text("queues:\n  - name: gpu-check\n    presets: {one-gpu: {cpu: 1, memory: 16Gi, gpu: 1}}\n"
                                     "    default_preset: one-gpu\n")
        subprocess.run([*cli, "queue", "apply", str(work / "q.yaml")], check=True, env=env, capture_output=True)
        code = ("from prefect import flow\n"
                f"flow.from_source(source={str(ROOT / 'bench')!r}, entrypoint='gpu_flow.py:gpu_matmul').deploy("
                "name='gpu-check', work_pool_name='gpu-check', build=False, push=False, print_next_steps=False)")
        subprocess.run([py, "-c", code], check=True, env=env, capture_output=True)
        agent_args = [*cli, "agent", "--queue", "gpu-check", "--name", "gpu-check-agent"]
        with background(agent_args, work / "agent.log", env=env):
            agents = []
            for _ in range(60):
                out = subprocess.run([*cli, "agent", "ls", "--json"], env=env, capture_output=True, text=True)
                agents = [a for a in json.loads(out.stdout or "[]") if a["online"]]
                if agents:
                    break
                time.sleep(1)
            if not agents:
                print(f"gpu_check: the agent did not come online; see {work / 'agent.log'}", file=sys.stderr)
                return 1
            cap = agents[0]["capacity"]
            print(f"agent detected capacity: cpu={cap['cpu']:g} memory={cap['memory'] / 2**30:.0f}GiB gpu={cap['gpu']}")
            sub = subprocess.run([*cli, "submit", "gpu-matmul/gpu-check", "--queue", "gpu-check", "--json",
                                  "--param", f"seconds={args.seconds}", "--param", f"mem_mib={args.mem_mib}",
                                  "--param", f"record_dir={work}"], env=env, capture_output=True, text=True)
            if sub.returncode != 0:
                print(sub.stderr, file=sys.stderr)
                return 1
            run_id = json.loads(sub.stdout)["run_ids"][0]
            from prefect import get_client

            with get_client(sync_client=True) as client:
                deadline = time.time() + args.seconds + 300
                while time.time() < deadline:
                    state = client.read_flow_run(run_id).state
                    if state and state.is_final():
                        break
                    time.sleep(1)
            time.sleep(2)  # the agent writes the summary right after the process exits
            report = json.loads(subprocess.run([*cli, "runs", "show", run_id, "--json"], env=env,
                                               capture_output=True, text=True).stdout or "{}")
    rec = json.loads((work / "gpu_job.json").read_text()) if (work / "gpu_job.json").exists() else {}
    summary = report.get("summary") or {}
    series = report.get("series") or []
    utils = [p["gpu_util_pct"] for p in series if p.get("gpu_util_pct") is not None]
    print(f"run {run_id}: final state {state.type.value if state else '?'}")
    print(f"pinned indices seen by the job: CUDA_VISIBLE_DEVICES={rec.get('cuda_visible_devices')!r}")
    print("job output:", (rec.get("output") or "").replace("\n", " | "))
    print(f"agent-sampled GPU utilisation: avg {summary.get('avg_gpu_util_pct')}%  max {summary.get('max_gpu_util_pct')}%"
          f"  ({len(utils)} samples)")
    peak = summary.get("peak_gpu_mem_bytes")
    print(f"agent-sampled GPU memory: peak {peak / 2**20:.0f} MiB" if peak else "agent-sampled GPU memory: none")
    print(json.dumps({"mode": "agent", "detected_gpus": cap["gpu"], "pinned": rec.get("cuda_visible_devices"),
                      "avg_gpu_util_pct": summary.get("avg_gpu_util_pct"),
                      "max_gpu_util_pct": summary.get("max_gpu_util_pct"), "peak_gpu_mem_bytes": peak,
                      "job_rc": rec.get("rc")}))
    if rec.get("rc") != 0 or not utils or max(utils) <= 0:
        print("gpu_check: the job failed or the sampled GPU utilisation stayed at 0", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direct", action="store_true", help="sample a pinned child directly, without an agent")
    ap.add_argument("--gpu", type=int, default=None, help="NVML index to pin (default: the first)")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--mem-mib", type=int, default=1024)
    args = ap.parse_args()
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
