"""A tiny fake Kubernetes API server for the launch-kubernetes worker's tests.

It answers only the requests the worker makes - jobs create/get/list/delete,
pods list by label selector, events list by ``involvedObject.name`` / ``.kind``, secrets
get/create/replace/delete, services create/get/delete (cluster runs) - over real HTTP on loopback, so the worker's own
path (kubeconfig, kubernetes_asyncio's BatchV1Api/CoreV1Api, JSON
(de)serialisation) runs unchanged. It schedules nothing: a test plays the
cluster by adding pods, pod states and events (`add_pod`, `set_pod`, `add_event`).
Every request is recorded (`calls`) so tests can check the verbs used.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import parse_qs, urlparse

_ROUTES = [
    (re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/jobs$"), "jobs"),
    (re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)$"), "job"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/pods$"), "pods"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/events$"), "events"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/secrets$"), "secrets"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/secrets/([^/]+)$"), "secret"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/services$"), "services"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/]+)$"), "service"),
]


INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []  # (method, resource kind)
        self.lock = threading.Lock()
        self.url = ""

    # ------------------------------------------------------------ the cluster
    def job(self, index: int = -1) -> dict[str, Any]:
        with self.lock:
            return list(self.jobs.values())[index]

    def add_pod(self, job: dict[str, Any], phase: str = "Pending", index: Optional[int] = None, **status: Any) -> str:
        """A pod of ``job`` with its template's labels, as the job controller makes it (``index``: a pod of an
        indexed Job, with its completion-index annotation and label, name and hostname ``<job>-<index>``)."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        stem = name if index is None else f"{name}-{index}"
        pod_name = f"{stem}-{uuid.uuid4().hex[:5]}"
        labels = {**((job["spec"]["template"].get("metadata") or {}).get("labels") or {}), "job-name": name}
        meta: dict[str, Any] = {"name": pod_name, "namespace": ns, "labels": labels, "creationTimestamp": now(),
                                "uid": str(uuid.uuid4())}
        spec = json.loads(json.dumps(job["spec"]["template"]["spec"]))
        if index is not None:
            labels[INDEX_KEY] = str(index)
            meta["annotations"] = {INDEX_KEY: str(index)}
            spec["hostname"] = stem
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": phase}}
        with self.lock:
            self.pods[(ns, pod_name)] = pod
        self.set_pod(pod_name, **status)
        return pod_name

    def set_pod(self, pod_name: str, phase: Optional[str] = None, node: Optional[str] = None, **status: Any) -> None:
        with self.lock:
            pod = next(p for (ns, n), p in self.pods.items() if n == pod_name)
            if phase:
                pod["status"]["phase"] = phase
            if node:
                pod["spec"]["nodeName"] = node
            for cs in status.get("containerStatuses") or []:  # the fields the API always sends
                cs.setdefault("image", pod["spec"]["containers"][0].get("image") or "img")
                cs.setdefault("imageID", "")
                cs.setdefault("ready", False)
                cs.setdefault("restartCount", 0)
            pod["status"].update(status)

    def delete_pod(self, pod_name: str) -> None:
        with self.lock:
            for key in [k for k in self.pods if k[1] == pod_name]:
                del self.pods[key]

    def set_job_condition(self, job: dict[str, Any], ctype: str, reason: str, message: str = "") -> None:
        with self.lock:
            stored = self.jobs[(job["metadata"]["namespace"], job["metadata"]["name"])]
            stored.setdefault("status", {}).setdefault("conditions", []).append(
                {"type": ctype, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now()})

    def add_event(self, name: str, reason: str, message: str, kind: str = "Pod", namespace: str = "default",
                  etype: str = "Warning") -> None:
        with self.lock:
            self.events.append({
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{name}.{uuid.uuid4().hex[:8]}", "namespace": namespace,
                             "creationTimestamp": now()},
                "involvedObject": {"kind": kind, "name": name, "namespace": namespace},
                "reason": reason, "message": message, "type": etype, "lastTimestamp": now(), "count": 1})

    # ---------------------------------------------------------------- the API
    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        for pattern, kind in _ROUTES:
            m = pattern.match(path)
            if m:
                with self.lock:
                    self.calls.append((method, kind))
                    return getattr(self, f"_{kind}")(method, *m.groups(), query=query, body=body)
        return 404, _status(404, f"no route {method} {path}")

    def _jobs(self, method, ns, query, body):
        if method == "POST":
            name = body["metadata"].get("name") or body["metadata"]["generateName"] + uuid.uuid4().hex[:5]
            body["metadata"].update(name=name, namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now())
            body["status"] = {"active": 1, "startTime": now()}
            self.jobs[(ns, name)] = body
            return 201, body
        sel = (query.get("labelSelector") or [""])[0]
        items = [j for (n, _), j in self.jobs.items() if n == ns and _matches(j["metadata"].get("labels") or {}, sel)]
        return 200, {"apiVersion": "batch/v1", "kind": "JobList", "metadata": {}, "items": items}

    def _job(self, method, ns, name, query, body):
        if (ns, name) not in self.jobs:
            return 404, _status(404, f'jobs.batch "{name}" not found')
        if method == "DELETE":
            del self.jobs[(ns, name)]
            for key in [k for k, p in self.pods.items() if p["metadata"]["labels"].get("job-name") == name]:
                del self.pods[key]
            return 200, {**_status(200, "deleted"), "details": {"name": name, "kind": "jobs"}}
        return 200, self.jobs[(ns, name)]

    def _pods(self, method, ns, query, body):
        sel = (query.get("labelSelector") or [""])[0]
        items = [p for (n, _), p in self.pods.items() if n == ns and _matches(p["metadata"]["labels"], sel)]
        return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}

    def _events(self, method, ns, query, body):
        field = (query.get("fieldSelector") or [""])[0]
        want = dict(part.split("=", 1) for part in field.split(",") if "=" in part)  # involvedObject.name/kind
        items = [e for e in self.events if e["metadata"]["namespace"] == ns
                 and all(e["involvedObject"].get(k.partition(".")[2]) == v for k, v in want.items())]
        return 200, {"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": items}

    def _secrets(self, method, ns, query, body):
        name = body["metadata"]["name"]
        if (ns, name) in self.secrets:
            return 409, _status(409, f'secrets "{name}" already exists')
        self.secrets[(ns, name)] = body
        return 201, body

    def _secret(self, method, ns, name, query, body):
        if method == "PUT":
            self.secrets[(ns, name)] = body
            return 200, body
        if (ns, name) not in self.secrets:
            return 404, _status(404, f'secrets "{name}" not found')
        if method == "DELETE":
            self.secrets.pop((ns, name))
            return 200, _status(200, "deleted")
        return 200, self.secrets[(ns, name)]


    def _services(self, method, ns, query, body):
        name = body["metadata"]["name"]
        if (ns, name) in self.services:
            return 409, _status(409, f'services "{name}" already exists')
        body["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now())
        self.services[(ns, name)] = body
        return 201, body

    def _service(self, method, ns, name, query, body):
        if (ns, name) not in self.services:
            return 404, _status(404, f'services "{name}" not found')
        if method == "DELETE":
            self.services.pop((ns, name))
            return 200, _status(200, "deleted")
        return 200, self.services[(ns, name)]


def _status(code: int, message: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": "Success" if code < 300 else "Failure",
            "message": message, "code": code}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKube

    def _serve(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        code, out = self.fake.handle(self.command, url.path, parse_qs(url.query), body)
        data = json.dumps(out).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def fake_kube(tmp_path: Path) -> Iterator[tuple[FakeKube, Path]]:
    """Serve a FakeKube on loopback; yield it and a kubeconfig file pointing at it."""
    fake = FakeKube()
    handler = type("Handler", (_Handler,), {"fake": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    }))
    try:
        yield fake, kubeconfig
    finally:
        server.shutdown()
        server.server_close()
