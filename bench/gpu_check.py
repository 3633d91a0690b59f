"""GPU check: detect GPUs with NVML, run a short GPU job pinned to one of them, sample it with RunSampler.

On a machine with an NVIDIA GPU this prints the detected GPUs, the pinned
indices, which GPU library the job used, and the sampled utilisation and memory
(per process when NVML reports it, else device-level); it exits 1 if utilisation
stayed at zero, and 2 (with a clear message) when there is no usable GPU.

The job is a child process with CUDA_VISIBLE_DEVICES pinned (as the launch worker
pins runs). It uses torch if importable, else CuPy, else the CUDA driver API
through ctypes (libcuda.so, always installed with the driver): a PTX kernel of
FMA loops launched repeatedly, plus a device allocation of --mem-mib.

Usage: python bench/gpu_check.py [--gpu INDEX] [--seconds 15] [--interval 0.5] [--mem-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from uuid import uuid4

JOB = r'''
import os, sys, time
secs = float(sys.argv[1]); mem_mib = int(sys.argv[2])
deadline = time.time() + secs

def with_torch():
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch without CUDA")
    keep = torch.empty(mem_mib * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    a = torch.randn(4096, 4096, device="cuda"); b = torch.randn(4096, 4096, device="cuda")
    while time.time() < deadline:
        for _ in range(20):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()
    return "torch " + torch.__version__

def with_cupy():
    import cupy as cp
    keep = cp.empty(mem_mib * 1024 * 1024 // 4, dtype=cp.float32)
    a = cp.random.randn(4096, 4096, dtype=cp.float32); b = cp.random.randn(4096, 4096, dtype=cp.float32)
    while time.time() < deadline:
        for _ in range(20):
            a = cp.clip(a @ b, -1, 1)
        cp.cuda.Device().synchronize()
    return "cupy " + cp.__version__

PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry spin(.param .u64 out, .param .u32 iters)
{
  .reg .pred p;
  .reg .f32 f<4>;
  .reg .b32 r<5>;
  .reg .b64 rd<5>;
  ld.param.u64 rd1, [out];
  ld.param.u32 r1, [iters];
  mov.u32 r2, %tid.x;
  cvt.rn.f32.u32 f1, r2;
  mov.f32 f2, 0f3F7FFFFF;
  mov.u32 r3, 0;
LOOP:
  fma.rn.f32 f1, f1, f2, f2;
  add.u32 r3, r3, 1;
  setp.lt.u32 p, r3, r1;
  @p bra LOOP;
  cvta.to.global.u64 rd2, rd1;
  mul.wide.u32 rd3, r2, 4;
  add.s64 rd4, rd2, rd3;
  st.global.f32 [rd4], f1;
  ret;
}
\0"""

def with_ctypes():
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    def ck(rc, what):
        if rc != 0:
            msg = ctypes.c_char_p()
            cu.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: {rc} {msg.value}")
    ck(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p(); ck(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
    mod = ctypes.c_void_p(); ck(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)), "cuModuleLoadData")
    fn = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    keep = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(keep), ctypes.c_size_t(mem_mib << 20)), "cuMemAlloc")
    ck(cu.cuMemsetD8_v2(keep, 1, ctypes.c_size_t(mem_mib << 20)), "cuMemset")
    out = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(4096)), "cuMemAlloc")
    iters = ctypes.c_uint32(200000)
    params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(out), ctypes.c_void_p), ctypes.cast(ctypes.byref(iters), ctypes.c_void_p))
    while time.time() < deadline:
        ck(cu.cuLaunchKernel(fn, 4096, 1, 1, 256, 1, 1, 0, None, params, None), "cuLaunchKernel")
        ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    return "CUDA driver API via ctypes (PTX FMA loop)"

errors = []
for f in (with_torch, with_cupy, with_ctypes):
    try:
        used = f()
        print("JOB-BACKEND:", used, flush=True)
        sys.exit(0)
    except ImportError as e:
        errors.append(f"{f.__name__}: {e}")
    except Exception as e:
        errors.append(f"{f.__name__}: {type(e).__name__}: {e}")
print("JOB-FAILED:", "; ".join(errors), flush=True)
sys.exit(3)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=None, help="NVML index to pin (default: the first)")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--mem-mib", type=int, default=1024)
    args = ap.parse_args()

    from prefect_launch.blocks.metrics_store import RunMetricsStore, RunRecord
    from prefect_launch.workers.nvml import get_nvml
    from prefect_launch.workers.sampler import RunSampler

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
        proc = subprocess.Popen([sys.executable, "-c", JOB, str(args.seconds), str(args.mem_mib)], env=env,
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
