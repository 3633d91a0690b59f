"""Prefect API reader of the queue monitor: a small JSON client and the bounded reads.

Every read is bounded by the view's time filters; none pages through every run:
per-interval numbers come from the server-side aggregation ``POST /flow_runs/history``,
"now" numbers from ``POST /flow_runs/count``, per-run rows are the newest
``detail_limit`` runs of the range (read 200 at a time, in parallel). What comes back
is handed on as the producers' inputs (:mod:`.frames`, :func:`.index_view.from_flow_runs`):
readers here return JSON or plain columns, never a panel's frame of their own.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

import httpx
import pandas as pd

from prefect_launch.dashboard import frames as F
from prefect_launch.dashboard.spec import UTC, ViewSpec, iso
from prefect_launch.workers.agent.tags import LAUNCH_TAG, OWNER, PRESET, tag

PAGE = 200  # the API's maximum page size for flow runs
SERVER_ID_VARIABLE = "prefect_launch_server_id"  # the server's identity (Api.server_id)
IO_WORKERS = 8  # IO_POOL's size (its tests fill it)
IO_POOL = ThreadPoolExecutor(max_workers=IO_WORKERS, thread_name_prefix="dash-io")
# Requests fanned out by a task that itself runs on IO_POOL go to a pool of their own: a task that
# waits on the pool it runs in deadlocks once every worker waits (seen as a page that never drew,
# when a view read on the API path overlapped another view's read)
FAN_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dash-fan")
_IN_FAN = threading.local()


def fan_out(fn: Callable[[Any], Any], items: Iterable[Any]) -> list:
    """``fn`` over ``items`` in parallel on :data:`FAN_POOL`, results in order. Called from a
    FAN_POOL thread it runs in line (that thread must not wait on its own pool either)."""
    items = list(items)
    if len(items) <= 1 or getattr(_IN_FAN, "on", False):
        return [fn(x) for x in items]

    def run(x: Any) -> Any:
        _IN_FAN.on = True
        return fn(x)

    return list(FAN_POOL.map(run, items))


# the POST endpoints that only read (``/flow_runs/filter``, ``/flow_runs/count``, ``/flow_runs/history``, ...)
READ_POSTS = frozenset({"filter", "count", "history"})

# history requests are whole-range scans on the server: more than two at once only make
# them contend there (measured: 7 in parallel cost 1.5x the server CPU of 7 in a row)
HISTORY_SLOTS = threading.BoundedSemaphore(int(os.environ.get("LAUNCH_DASHBOARD_HISTORY_SLOTS", "2")))


class Api:
    """A small synchronous JSON client for the Prefect REST API (thread-safe)."""

    def __init__(self, api_url: Optional[str] = None, timeout: float = 30.0):
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

        self.api_url = (api_url or os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value() or "").rstrip("/")
        if not self.api_url:
            raise RuntimeError("PREFECT_API_URL is not set: point it at your Prefect server's /api")
        headers = {}
        if PREFECT_API_KEY.value():
            headers["Authorization"] = f"Bearer {PREFECT_API_KEY.value()}"
        elif PREFECT_API_AUTH_STRING.value():
            headers["Authorization"] = "Basic " + base64.b64encode(PREFECT_API_AUTH_STRING.value().encode()).decode()
        self.http = httpx.Client(base_url=self.api_url + "/", headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=16, max_keepalive_connections=16))
        self._server_id: Optional[str] = None
        self._server_id_lock = threading.Lock()

    def post(self, path: str, body: Optional[dict] = None) -> Any:
        read = path.rstrip("/").rsplit("/", 1)[-1] in READ_POSTS
        r = self._send(lambda: self.http.post(path.lstrip("/"), json=body or {}), retry=read)
        r.raise_for_status()
        return r.json()

    def get(self, path: str) -> Any:
        r = self._send(lambda: self.http.get(path.lstrip("/")), retry=True)
        r.raise_for_status()
        return r.json()

    @staticmethod
    def _send(request: Callable[[], httpx.Response], retry: bool) -> httpx.Response:
        """A read is sent once more when the server closed the connection without answering: a kept-alive
        connection the server had just closed (seen at 1M runs after a long read), which Prefect's own client
        also retries. Writes are not resent (one may have been applied)."""
        try:
            return request()
        except httpx.RemoteProtocolError:
            if not retry:
                raise
            return request()

    def server_id(self, fresh: bool = False) -> str:
        """This server's identity, steadier than the URL it is reached by: a UUID kept in the Prefect
        Variable ``SERVER_ID_VARIABLE``, made by the first monitor that asks. The run index is kept per
        server by it, so monitors reaching one server as localhost and 127.0.0.1 (or through a proxy)
        share one index instead of resetting each other's. Read once and kept; ``fresh`` reads it again
        (the index's owner found no index under the kept id: the Variable may have been deleted and made
        anew by another monitor). Raises when the server cannot be read: a guess here would rebuild the
        index."""
        with self._server_id_lock:
            if self._server_id is None or fresh:
                self._server_id = self._read_or_make_server_id()
            return self._server_id

    def _read_or_make_server_id(self) -> str:
        path = f"variables/name/{SERVER_ID_VARIABLE}"
        for _ in range(3):
            r = self.http.get(path)
            if r.status_code == 404:  # the first monitor of this server: make it (another may do so at once)
                made = self.http.post("variables/", json={"name": SERVER_ID_VARIABLE, "value": uuid.uuid4().hex,
                                                          "tags": ["prefect-launch"]})
                if made.status_code == 409:  # made meanwhile by another: read theirs
                    continue
                made.raise_for_status()
                r = made
            r.raise_for_status()
            value = r.json().get("value")
            if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value)):
                raise RuntimeError(f"the Prefect Variable {SERVER_ID_VARIABLE!r} holds {value!r}, not a server id: "
                                   "delete it (`prefect variable unset " + SERVER_ID_VARIABLE + "`) and the monitor makes a new "
                                   "one (its run index is then built again)")
            return value
        raise RuntimeError(f"could not read or make the Prefect Variable {SERVER_ID_VARIABLE!r}")

    def ui_url(self) -> str:
        """Base URL of the Prefect UI: PREFECT_UI_URL if set, else this API URL minus ``/api``."""
        ui = os.environ.get("PREFECT_UI_URL")
        if ui:
            return str(ui).rstrip("/")
        base = self.api_url
        return base[: -len("/api")] if base.endswith("/api") else base


_APIS: dict[str, Api] = {}
_APIS_LOCK = threading.Lock()


def get_api(api_url: Optional[str] = None) -> Api:
    """The process-wide client for a server (PREFECT_API_URL by default)."""
    key = api_url or os.environ.get("PREFECT_API_URL") or ""
    with _APIS_LOCK:
        if key not in _APIS:
            _APIS[key] = Api(api_url)
        return _APIS[key]


_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def prefect_client() -> Any:
    """The process-wide Prefect sync client for the server PREFECT_API_URL (as Prefect's settings read it)
    names, opened on first use and kept, for the reads that need Prefect's client rather than
    :class:`Api` (the waiting runs): one made per read also made a connection pool and an SSL context
    (~20% of the monitor's idle CPU at 100k runs). A client that has connected once retries a refused
    connection for about a minute: readers that must fail fast set PREFECT_CLIENT_MAX_RETRIES."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or ""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(url)
        if client is None:
            client = get_client(sync_client=True)
            client.__enter__()  # closed with the process (httpx's client is safe to share between threads)
            _CLIENTS[url] = client
        return client


def run_url(ui_base: str, flow_run_id: str) -> str:
    return f"{ui_base.rstrip('/')}/runs/flow-run/{flow_run_id}"


# --------------------------------------------------------------- filter bodies


def tag_combos(spec: ViewSpec) -> list[tuple[str, ...]]:
    """Owner x preset filters as tag sets to AND (one request each; the sets are disjoint)."""
    owners = [tag(OWNER, o) for o in spec.owners] or [None]
    presets = [tag(PRESET, p) for p in spec.presets] or [None]
    return [tuple(t for t in (o, p) if t) for o in owners for p in presets]


def filter_body(spec: ViewSpec, tags: Sequence[str] = (), *, time_field: str = "expected_start_time",
                pools: Optional[Sequence[str]] = None, jobs: Optional[Sequence[str]] = None,
                state_types: Optional[Sequence[str]] = None, since: Optional[dt.datetime] = None,
                until: Optional[dt.datetime] = None) -> dict:
    """The flow_runs / deployments / work_pools filter for a spec (plus a group's narrowing)."""
    fr: dict[str, Any] = {}
    s, u = since or spec.since, until or spec.until
    if time_field:
        fr[time_field] = {"after_": iso(s), "before_": iso(u)}
    if tags:
        fr["tags"] = {"all_": list(tags)}
    types = list(state_types) if state_types is not None else spec.state_types()
    if types:
        fr["state"] = {"type": {"any_": types}}
    body: dict[str, Any] = {"flow_runs": fr}
    pool_names = list(pools) if pools is not None else list(spec.queues)
    if pool_names:
        body["work_pools"] = {"name": {"any_": pool_names}}
    job_names = list(jobs) if jobs is not None else list(spec.jobs)
    if job_names:
        body["deployments"] = {"name": {"any_": job_names}}
    return body


def run_matches(r: dict, spec: ViewSpec, deployments: dict[str, dict]) -> bool:
    """The sidebar filters applied to one flow-run JSON, as the server applies them."""
    tags = r.get("tags") or []
    if spec.queues and r.get("work_pool_name") not in spec.queues:
        return False
    if spec.owners and not any(tag(OWNER, o) in tags for o in spec.owners):
        return False
    if spec.presets and not any(tag(PRESET, p) in tags for p in spec.presets):
        return False
    if spec.jobs and (deployments.get(r.get("deployment_id") or "") or {}).get("name") not in spec.jobs:
        return False
    if spec.statuses and r.get("state_type") not in set(spec.state_types()):
        return False
    return True


# --------------------------------------------------------------------- readers


def fetch_pools(api: Api) -> list[dict]:
    """Every work pool, paged by offset (a server with more than one page of queues lost some before)."""
    out: list[dict] = []
    while True:
        page = api.post("/work_pools/filter", {"limit": PAGE, "offset": len(out)})
        out.extend(page)
        if len(page) < PAGE:
            return out


def fetch_deployments(api: Api) -> dict[str, dict]:
    """Deployment id -> {name, pool}; pages by offset (deployments are few)."""
    out: dict[str, dict] = {}
    offset = 0
    while True:
        page = api.post("/deployments/filter", {"limit": PAGE, "offset": offset})
        for d in page:
            out[d["id"]] = {"name": d["name"], "pool": d.get("work_pool_name")}
        if len(page) < PAGE:
            return out
        offset += PAGE


def fetch_history(api: Api, spec: ViewSpec, interval_s: int, tags: Sequence[str] = (),
                  deployment_ids: Optional[Sequence[str]] = None, **narrow: Any) -> list[dict]:
    """``POST /flow_runs/history`` for the spec narrowed by ``narrow`` (pools, jobs, state_types);
    ``deployment_ids`` narrows by the indexed run column ([] = runs without a deployment)."""
    body = filter_body(spec, tags, time_field="", **narrow)
    if deployment_ids is not None:
        body["flow_runs"]["deployment_id"] = {"any_": list(deployment_ids)} if deployment_ids else {"is_null_": True}
        body.pop("deployments", None)
    body.update(history_start=iso(spec.since), history_end=iso(spec.until), history_interval_seconds=interval_s)
    with HISTORY_SLOTS:
        return api.post("/flow_runs/history", body)


def history_from_api(buckets: list[dict], group: str = "all") -> pd.DataFrame:
    """History JSON -> :func:`.frames.history_frame` (Prefect's own sums per bucket and state)."""
    cols: dict[str, list] = {k: [] for k in ("bucket", "state_type", "count", "run_s", "queued_s")}
    for b in buckets:
        for s in b.get("states", []):
            cols["bucket"].append(b["interval_start"])
            cols["state_type"].append(s["state_type"])
            cols["count"].append(int(s["count_runs"]))
            cols["run_s"].append(float(s["sum_estimated_run_time"]))
            cols["queued_s"].append(float(s["sum_estimated_lateness"]))
    return F.history_frame(pd.to_datetime(cols["bucket"], utc=True, format="ISO8601"), [group] * len(cols["count"]), cols["state_type"], cols["count"], cols["run_s"],
                           cols["queued_s"])


def fetch_runs(api: Api, spec: ViewSpec, since: Optional[dt.datetime] = None, limit: Optional[int] = None,
               until: Optional[dt.datetime] = None) -> list[dict]:
    """Newest ``limit`` runs expected to start in [since, until], read 200 at a time in parallel."""
    limit = limit or spec.detail_limit
    bodies = [dict(filter_body(spec, tags, since=since, until=until), sort="EXPECTED_START_TIME_DESC") for tags in tag_combos(spec)]
    # the first page of each filter set alone: most narrow filters match less than one page
    first = fan_out(lambda b: api.post("/flow_runs/filter", dict(b, limit=min(PAGE, limit), offset=0)), bodies)
    rest = [dict(b, limit=min(PAGE, limit - off), offset=off)
            for b, p in zip(bodies, first) if len(p) == min(PAGE, limit) for off in range(PAGE, limit, PAGE)]
    pages = first + fan_out(lambda b: api.post("/flow_runs/filter", b), rest)
    seen: set = set()
    uniq = []
    for p in pages:
        for r in p:
            if r["id"] not in seen:
                seen.add(r["id"])
                uniq.append(r)
    uniq.sort(key=lambda r: r.get("expected_start_time") or "", reverse=True)
    return uniq[:limit]


def fetch_runs_by_id(api: Api, ids: Sequence[str], where: Optional[dict] = None) -> list[dict]:
    """The runs ``ids`` (those of them that also match the flow-run filter ``where``, e.g. a state)."""
    chunks = [list(ids[i : i + PAGE]) for i in range(0, len(ids), PAGE)]
    pages = fan_out(lambda c: api.post("/flow_runs/filter", {"flow_runs": {**(where or {}), "id": {"any_": c}},
                                                             "limit": PAGE}), chunks)
    return [r for p in pages for r in p]


def fetch_errors(api: Api, spec: ViewSpec, limit: int = PAGE) -> tuple[list[dict], list[dict]]:
    """Failed and crashed runs that ended in the range (newest first) and their ERROR logs."""
    runs: list[dict] = []
    for tags in tag_combos(spec):
        body = filter_body(spec, tags, time_field="end_time", state_types=["FAILED", "CRASHED"])
        body.update(sort="END_TIME_DESC", limit=limit)
        runs.extend(api.post("/flow_runs/filter", body))
    runs.sort(key=lambda r: r.get("end_time") or r.get("state", {}).get("timestamp") or "", reverse=True)
    runs = runs[:limit]
    return runs, fetch_error_logs(api, [r["id"] for r in runs])


def fetch_error_logs(api: Api, run_ids: Sequence[str]) -> list[dict]:
    """The newest ERROR (and worse) logs of these runs."""
    if not run_ids:
        return []
    return api.post("/logs/filter", {"logs": {"flow_run_id": {"any_": list(run_ids)}, "level": {"ge_": 40}},
                                     "sort": "TIMESTAMP_DESC", "limit": PAGE})


def fetch_now_counts(api: Api, spec: ViewSpec, pools: Sequence[str], now: dt.datetime) -> pd.DataFrame:
    """Per pool, runs queued (due and waiting), pending and running right now, as long
    counts (queue, status, count) for :func:`.frames.now_counts_frame`."""
    jobs = []
    for pool in pools:
        for status, types, extra in (
            ("queued", ["SCHEDULED"], {"expected_start_time": {"before_": iso(now)}}),
            ("pending", ["PENDING"], {}),
            ("running", ["RUNNING"], {}),
        ):
            for tags in tag_combos(spec):
                body = filter_body(spec, tags, time_field="", pools=[pool], state_types=types)
                body["flow_runs"].update(extra)
                jobs.append((pool, status, body))
    counts = fan_out(lambda j: int(api.post("/flow_runs/count", j[2])), jobs)
    return pd.DataFrame([(p, s, n) for (p, s, _), n in zip(jobs, counts)], columns=["queue", "status", "count"])


def fetch_workers(api: Api, pools: Sequence[str]) -> list[dict]:
    """Prefect's workers of these pools (each with its ``pool``); a pool that cannot be read has none."""
    def one(pool: str) -> list[dict]:
        try:
            return [dict(w, pool=pool) for w in api.post(f"/work_pools/{pool}/workers/filter", {"limit": PAGE})]
        except httpx.HTTPError:
            return []

    return [w for ws in fan_out(one, pools) for w in ws]


def fetch_agents(api: Api) -> list[dict]:
    """Capacity that launch agents publish as Prefect Variables tagged ``launch-agent``."""
    try:
        vars_ = api.post("/variables/filter", {"variables": {"tags": {"all_": ["launch-agent"]}}, "limit": PAGE})
    except httpx.HTTPError:
        return []
    return [v["value"] for v in vars_ if isinstance(v.get("value"), dict)]


def fetch_recent_labels(api: Api) -> dict[str, list[str]]:
    """Owners and presets seen on the newest launched runs (the sidebar's choices)."""
    recent = api.post("/flow_runs/filter", {"flow_runs": {"tags": {"all_": [LAUNCH_TAG]}}, "sort": "EXPECTED_START_TIME_DESC", "limit": PAGE})
    owners = sorted({t.split(":", 1)[1] for r in recent for t in r.get("tags", []) if t.startswith(tag(OWNER, ""))})
    presets = sorted({t.split(":", 1)[1] for r in recent for t in r.get("tags", []) if t.startswith(tag(PRESET, ""))})
    return dict(owners=owners, presets=presets)


def parse_time(v: Optional[str]) -> Optional[dt.datetime]:
    """An ISO timestamp of the API (``Z`` or an offset) as an aware datetime."""
    return dt.datetime.fromisoformat(v.replace("Z", "+00:00")).astimezone(UTC) if v else None
