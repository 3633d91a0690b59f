"""An example cluster job: a real all-reduce (sum) over TCP between the run's members, stdlib only.

Submit it with ``--cluster-size N``: every member runs this function with the same parameters and
finds the others from the env the agent sets (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; also ``LAUNCH_CLUSTER_*``). Rank 0 listens, gathers one vector from each
rank, sums them and broadcasts the sum; each member checks it against the closed form and writes
``<out_dir>/<flow run id>-<member>.json``. It imports nothing from prefect-launch; with torch
installed the same env works for ``torch.distributed.init_process_group("gloo")``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from prefect import flow


def _send(sock: socket.socket, obj: object) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def _recv(f) -> object:
    line = f.readline()
    if not line:
        raise ConnectionError("peer closed the connection")
    return json.loads(line)


def all_reduce_sum(vector: list[float], rank: int, world: int, addr: str, port: int,
                   timeout_s: float = 120.0) -> list[float]:
    """Sum ``vector`` element-wise over all ranks; every rank gets the sum (gather to rank 0, broadcast)."""
    if world == 1:
        return list(vector)
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((addr, port))
            srv.listen(world)
            srv.settimeout(timeout_s)
            peers = []
            total = list(vector)
            for _ in range(world - 1):
                conn, _ = srv.accept()
                conn.settimeout(timeout_s)
                f = conn.makefile("r")
                msg = _recv(f)
                total = [a + b for a, b in zip(total, msg["vector"])]
                peers.append((conn, f))
            for conn, f in peers:
                _send(conn, {"sum": total})
                f.close()
                conn.close()
            return total
    deadline = time.monotonic() + timeout_s
    while True:  # rank 0 may not listen yet
        try:
            sock = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with sock:
        sock.settimeout(timeout_s)
        _send(sock, {"rank": rank, "vector": vector})
        with sock.makefile("r") as f:
            return _recv(f)["sum"]


def _write_record(path: Path, record: dict) -> None:
    """Whole or not at all (written aside, then renamed): a test polling for the file never reads half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


@flow(name="allreduce")
def allreduce(out_dir: str, length: int = 4, hold_s: float = 0.0, burn_s: float = 0.0, release_file: str = "") -> dict:
    """Rank r contributes [r+1, 2(r+1), ...]; the sum is checked against world*(world+1)/2 * [1, 2, ...].

    ``hold_s``: wait that long before the collective (``release_file``: until that file exists, ``hold_s`` at
    most, so a test holds the run through a fault without guessing a length).

    ``burn_s``: rank r first spins the CPU for (r+1) x burn_s seconds of its own CPU time, so each
    member's measured CPU differs by a known amount (per-member metrics tests)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    member = os.environ.get("LAUNCH_CLUSTER_MEMBER", "main1")
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID", "local")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                          "CUDA_VISIBLE_DEVICES", "LAUNCH_CLUSTER_SIZE", "LAUNCH_CLUSTER_RANK",
                                          "LAUNCH_CLUSTER_MEMBER", "LAUNCH_CLUSTER_HOSTS", "LAUNCH_CLUSTER_ADDRS",
                                          "LAUNCH_CLUSTER_MAIN_ADDR", "LAUNCH_CLUSTER_MODE", "LAUNCH_AGENT",
                                          "OMP_NUM_THREADS", "LAUNCH_CPU_CORES")}
    _write_record(out / f"{run_id}-{member}.started.json", {"pid": os.getpid(), "env": env})
    deadline = time.monotonic() + hold_s  # e.g. to be killed by a test before the collective; with release_file,
    while time.monotonic() < deadline and not (release_file and os.path.exists(release_file)):  # until it exists
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    spin_until = time.process_time() + burn_s * (rank + 1)
    while time.process_time() < spin_until:
        pass
    mine = [float((rank + 1) * (i + 1)) for i in range(length)]
    got = all_reduce_sum(mine, rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         int(os.environ.get("MASTER_PORT", "29500")))
    want = [world * (world + 1) / 2 * (i + 1) for i in range(length)]
    record = {"member": member, "rank": rank, "world": world, "sum": got, "expected": want, "ok": got == want,
              "pid": os.getpid(), "env": env, "cpu_s": time.process_time()}
    _write_record(out / f"{run_id}-{member}.json", record)
    if got != want:
        raise ValueError(f"all-reduce gave {got}, expected {want}")
    return record
