"""Warm containers: a docker queue's runs start in a container whose Python and Prefect are already loaded.

A cold container spends about 2 s of its start on Python and Prefect's imports and the
engine's set-up before the run is Running (measured by bench/docker_dispatch.py). A docker
queue with ``warm_containers: N`` keeps up to N containers per *shape* started ahead of the
runs that will use them, each running `workers/backends/warm_engine.py` and waiting for its order. A
shape is everything Docker fixes at creation (image, volumes, shm size, network, ports,
privileges); everything it can change on a running container is set at hand-over: CPUs
(a CFS quota), cores (``CpusetCpus``) and memory (``Memory``/``MemorySwap``) through docker-py's
``Container.update``, the run's environment through a file the engine reads and removes, and
the container's name, which becomes ``launch-<run id>`` (labels cannot change after creation,
so the agent finds a warm-started run's container again by that name).

Where a run cannot start warm it starts cold, as prefect-docker does: a job with its own
``command``, or GPUs sent to Docker as device requests (those are fixed at creation).
A shape whose warm container exits before any run used it (an image without prefect-launch,
for one) is not warmed again by this agent.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import tarfile
import threading
import time
import uuid
from typing import Any, Optional

from pydantic import BaseModel

ORDER_PATH = "/tmp/.launch-warm-order.json"
# Written after the order, in the same archive: Docker extracts an archive's files in order, each with its owner,
# mode and times set before the next begins, so once this exists the order file is whole and Docker is done
# with it; the engine may then read and remove the order (removed earlier, while Docker still sets its owner,
# the upload fails with "lchown ...: no such file or directory", and the run with it). The marker is empty
# and stays.
ORDER_DONE_PATH = ORDER_PATH + ".done"
WARM_LABEL = "io.prefect-launch.warm"  # the agent that keeps it
WARM_NAME_PREFIX = "launch-warm-"
READY_RE = re.compile(rb"launch-warm-ready uid=(\d+) gid=(\d+)")
PER_RUN = ("environment", "labels", "name", "command", "nano_cpus", "cpuset_cpus", "mem_limit", "memswap_limit",
           "auto_remove", "rendered_device_requests")
ENGINE_COMMAND = ["python", "-m", "prefect_launch.workers.backends.warm_engine"]

logger = logging.getLogger("prefect_launch.warm_containers")


def run_container_name(run_id: str) -> str:
    return f"launch-{run_id}"


def shape_of(settings: dict[str, Any], command_configured: bool) -> Optional[dict[str, Any]]:
    """What Docker fixes at creation for these container settings, or None when the run must start cold (pure)."""
    if command_configured or settings.get("device_requests"):
        return None
    return {k: v for k, v in settings.items() if k not in PER_RUN and v is not None}


def shape_key(shape: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warm_settings(shape: dict[str, Any], agent: str, queue: str, labels: dict[str, str]) -> dict[str, Any]:
    """docker-py ``containers.create`` arguments for a warm container of ``shape`` (pure)."""
    return {**shape, "init": True, "command": ENGINE_COMMAND, "name": f"{WARM_NAME_PREFIX}{uuid.uuid4().hex[:12]}",
            "environment": {"LAUNCH_WARM_ORDER": ORDER_PATH, "LAUNCH_WARM_ORDER_DONE": ORDER_DONE_PATH,
                            "LAUNCH_WARM_APPS": "0"},
            "labels": {**labels, WARM_LABEL: agent}, "auto_remove": False}


CPU_PERIOD_US = 100_000  # the CFS period of a run's CPU quota (Docker's own default)


def update_args(settings: dict[str, Any]) -> dict[str, Any]:
    """docker-py ``Container.update`` arguments for the run's CPU, core and memory limits (pure).

    ``update`` has no NanoCpus; a CFS quota over Docker's default period is the same limit (``--cpus`` is
    defined as that quota), and warm containers are created without either, so the two never conflict.
    """
    from prefect_launch.workers.scheduling.resources import parse_size

    args: dict[str, Any] = {}
    if settings.get("nano_cpus"):
        args["cpu_period"] = CPU_PERIOD_US
        args["cpu_quota"] = max(1000, int(settings["nano_cpus"]) * CPU_PERIOD_US // 10**9)
    if settings.get("cpuset_cpus"):
        args["cpuset_cpus"] = str(settings["cpuset_cpus"])
    if settings.get("mem_limit"):
        args["mem_limit"] = parse_size(str(settings["mem_limit"]))
        args["memswap_limit"] = parse_size(str(settings.get("memswap_limit") or settings["mem_limit"]))
    return args


def order_archive(env: dict[str, Any], uid: int, gid: int) -> bytes:
    """A tar holding the order file, then its done marker (see :data:`ORDER_DONE_PATH`), both owned by the
    engine's user so it can read and remove them."""
    data = json.dumps({"env": {k: v for k, v in env.items() if v is not None}, "replace_env": False,
                       "cwd": None}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for path, body in ((ORDER_PATH, data), (ORDER_DONE_PATH, b"")):
            info = tarfile.TarInfo(path.rsplit("/", 1)[1])
            info.size, info.mode, info.uid, info.gid, info.mtime = len(body), 0o600, uid, gid, int(time.time())
            tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


class WarmEntry(BaseModel):
    """One warm container: its id, the shape it was made for, when, and its engine's user once ready."""

    container_id: str
    key: str
    created: float
    uid: Optional[int] = None
    gid: Optional[int] = None


class WarmContainers:
    """The warm containers one docker queue's worker keeps (docker-py calls: run these in a thread)."""

    def __init__(self, docker: Any, size: int, agent: str, queue: str, ttl_s: float = 600.0):
        self.docker = docker
        self.size = size
        self.agent = agent
        self.queue = queue
        self.ttl_s = ttl_s
        self._ready: list[WarmEntry] = []
        self._failed: set[str] = set()  # shapes whose warm container died unused: start those cold
        self._lock = threading.RLock()  # take, fill and expire run in worker threads

    def take(self, key: str) -> Optional[WarmEntry]:
        """A warm container of this shape whose engine said it is ready, or None."""
        with self._lock:
            return self._take(key)

    def _take(self, key: str) -> Optional[WarmEntry]:
        for entry in [e for e in self._ready if e.key == key]:
            self._ready.remove(entry)
            try:
                c = self.docker.containers.get(entry.container_id)
                if c.status != "running":
                    self._failed.add(key)
                    logger.warning("warm container %s exited before any run used it (%s); runs of this shape "
                                   "start cold from now on", c.name, _tail(c))
                    c.remove(force=True)
                    continue
                if entry.uid is None and not self._read_ready(entry, c):
                    self._ready.insert(0, entry)  # still loading: a cold start is sooner
                    return None
                return entry
            except Exception as exc:
                logger.warning("warm container %s is gone: %s", entry.container_id[:12], exc)
        return None

    def _read_ready(self, entry: WarmEntry, c: Any) -> bool:
        m = READY_RE.search(c.logs(stdout=True, stderr=False, tail=20) or b"")
        if m:
            entry.uid, entry.gid = int(m.group(1)), int(m.group(2))
        return m is not None

    def fill(self, key: str, shape: dict[str, Any], labels: dict[str, str]) -> None:
        """Start warm containers of this shape up to ``size``; drop expired ones of every shape."""
        with self._lock:
            self._fill(key, shape, labels)

    def _fill(self, key: str, shape: dict[str, Any], labels: dict[str, str]) -> None:
        self.expire()
        if key in self._failed:
            return
        while sum(1 for e in self._ready if e.key == key) < self.size:
            c = self.docker.containers.create(**warm_settings(shape, self.agent, self.queue, labels))
            c.start()
            self._ready.append(WarmEntry(container_id=c.id, key=key, created=time.time()))

    def expire(self, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            expired = [e for e in self._ready if now - e.created > self.ttl_s]
            for entry in expired:
                self._ready.remove(entry)
        for entry in expired:
            self._remove(entry.container_id)

    def hand_over(self, entry: WarmEntry, settings: dict[str, Any], run_id: str) -> Any:
        """Give the warm container the run's limits, name and environment; it becomes the run."""
        c = self.docker.containers.get(entry.container_id)
        limits = update_args(settings)
        if limits:
            c.update(**limits)
        c.rename(run_container_name(run_id))
        c.put_archive(ORDER_PATH.rsplit("/", 1)[0],
                      order_archive(settings.get("environment") or {}, entry.uid or 0, entry.gid or 0))
        c.reload()
        return c

    def close(self) -> None:
        with self._lock:
            entries, self._ready = self._ready, []
        for entry in entries:
            self._remove(entry.container_id)

    def remove_stale(self) -> int:
        """Remove warm containers an earlier life of this agent left unused (never one a run holds)."""
        n = 0
        for c in self.docker.containers.list(all=True, filters={"label": f"{WARM_LABEL}={self.agent}"}):
            if c.name.startswith(WARM_NAME_PREFIX):
                self._remove(c.id)
                n += 1
        return n

    def _remove(self, container_id: str) -> None:
        try:
            self.docker.containers.get(container_id).remove(force=True)
        except Exception:
            pass


def _tail(c: Any) -> str:
    try:
        return (c.logs(tail=3) or b"").decode(errors="replace").strip().replace("\n", " | ")[-300:]
    except Exception:
        return "no logs"
