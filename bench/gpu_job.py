"""A short GPU job: a matrix-multiply (or PTX FMA) loop plus a device allocation.

Usage: python bench/gpu_job.py SECONDS MEM_MIB. Uses torch if importable, else CuPy, else the
CUDA driver API through ctypes (libcuda.so ships with the driver). Exit 3 when no backend works.
"""

import sys, time
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
