"""Data shaping for the Sessions page (pure: no server, no Streamlit).

The page (``dashboard/pages/1_Sessions.py``) only lays out what these functions return.
Validation stays in :mod:`prefect_launch.deployments.sessions` (``check`` and
``start_session``): this module turns the launcher's text fields into a
``SessionRequest``, files each problem message the back end reports under the field it
is about, and shapes sessions, recent launches, scheduling history, idle checks and app
links into tables. Names, messages and links shown on the page pass through
:func:`plain` / :func:`safe_app_url` first.
"""

from __future__ import annotations

import html
import re
from datetime import datetime, timezone
from typing import Any, Iterable, Optional
from urllib.parse import parse_qs, urlsplit

import pandas as pd

from prefect_launch.deployments.sessions import NAME_RE, SessionRequest
from prefect_launch.workers.agent.queued_state import WAITING_NAMES

STEPS = ("Type and name", "Environment and resources", "Data and storage", "Network", "Review and launch")
REVIEW = len(STEPS) - 1

# field -> the launcher step that shows it ("resources": the preset/cpu/memory/gpu group as a whole)
FIELD_STEP: dict[str, int] = {
    "type": 0, "name": 0, "startup_command": 0, "starts_at": 0, "timeout": 0,
    "queue": 1, "image": 1, "preset": 1, "cpu": 1, "memory": 1, "gpu": 1, "shm_size": 1, "resources": 1,
    "count": 1, "env": 1, "omp_threads": 1, "cluster_size": 1, "cluster_mode": 1, "preemptible": 1,
    "mounts": 2,
    "ports": 3,
    "general": REVIEW,
}
FIELD_LABEL = {
    "type": "Session type", "name": "Name", "startup_command": "Startup command", "starts_at": "Starts at",
    "timeout": "Timeout", "queue": "Queue", "image": "Environment image", "preset": "Preset", "cpu": "CPUs",
    "memory": "Memory", "gpu": "GPUs", "shm_size": "Shared memory", "resources": "Resources",
    "count": "Number of sessions", "env": "Environment variables", "omp_threads": "OMP threads",
    "cluster_size": "Cluster size", "cluster_mode": "Cluster mode", "preemptible": "Preemptible",
    "mounts": "Mounts", "ports": "Ports", "general": "Other",
}
BATCH_ONLY = ("startup_command", "starts_at", "timeout")
TEXT_FIELDS = ("type", "name", "startup_command", "starts_at", "timeout", "queue", "image", "preset", "cpu",
               "memory", "gpu", "shm_size", "count", "env", "omp_threads", "cluster_size", "cluster_mode",
               "preemptible", "mounts", "ports")
PHASES = ("schedule", "check_precondition", "start", "check_timeout", "idle_check", "terminate")
RESULTS = ("SUCCESS", "NEED_RETRY", "SKIPPED", "GIVE_UP", "EXPIRED", "FAILURE")
LIVE_STATUSES = (*WAITING_NAMES, "Pending", "Running", "Cancelling", "Paused")

# The back end's messages (deployments/sessions.check, start_session, deployments/submit, workers/resolve),
# matched to the field they are about; first match wins, anything else is "general".
_FIELD_RULES: tuple[tuple[str, re.Pattern], ...] = tuple((f, re.compile(p, re.I)) for f, p in (
    ("name", r"^name\b"),
    ("count", r"^count\b"),
    ("startup_command", r"needs --startup-command|^--startup-command\b"),
    ("starts_at", r"^--starts-at\b|^starts-at\b"),
    ("timeout", r"^--timeout\b|^timeout\b"),
    ("ports", r"^port\b|^--port\b|^ports\b"),
    ("env", r"^env\b|^environment variable|^bad --env"),
    ("mounts", r"^mount\b|^two mounts|^mounts\b"),
    ("omp_threads", r"^omp[-_]threads\b"),
    ("cluster_mode", r"^cluster[-_ ]mode\b"),
    ("cluster_size", r"^cluster[-_]size\b|^cluster runs\b"),
    ("image", r"^--image\b|^image\b"),
    ("preset", r"unknown preset"),
    ("cpu", r"^cpu\b"),
    ("gpu", r"^gpu\b"),
    ("shm_size", r"shm_size|shm-size"),
    ("memory", r"^malformed memory|^memory\b"),
    ("resources", r"out of bounds|beyond any agent"),
    ("queue", r"unknown queue|no session deployment|no launch presets|^queue\b|^job .* is deployed|^unknown job"),
))


# ------------------------------------------------------------------ safety

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~$:])")


def plain(text: Any, limit: int = 300) -> str:
    """``text`` safe to put inside st.markdown (and st.error, st.caption...): control characters
    dropped, ``& < >`` as entities (no HTML), Markdown syntax backslash-escaped (no links, no
    emphasis), cut to ``limit`` characters. Quotes stay as they are: outside HTML they are text."""
    s = _CONTROL.sub(" ", "" if text is None else str(text))
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return html.escape(_MD_SPECIAL.sub(r"\\\1", s), quote=False)


def shown_name(name: Optional[str]) -> str:
    """A session name for tables and pickers: as is when it follows the naming rule, else quoted
    with control characters removed (a run renamed outside prefect-launch may hold anything)."""
    if name and NAME_RE.match(name):
        return name
    return repr(_CONTROL.sub("", str(name or ""))[:64])


def one_line(text: Any, limit: int = 100) -> str:
    """Free text (a recent launch's label) for plain-text places such as picker options: one line, cut."""
    s = _CONTROL.sub(" ", "" if text is None else str(text)).strip()
    return s if len(s) <= limit else s[: limit - 1] + "…"


_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{8,256}$")


def safe_app_url(url: Any) -> Optional[str]:
    """The app URL if it is what `session show` gives - ``http://127.0.0.1:PORT/lab?token=T`` (loopback
    host, port 1024-65535, URL-safe token) - else None: nothing else is ever made a link."""
    if not isinstance(url, str) or len(url) > 400 or _CONTROL.search(url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or not port \
            or not 1024 <= port <= 65535 or parts.path != "/lab" or parts.fragment or parts.username:
        return None
    q = parse_qs(parts.query, keep_blank_values=True)
    if set(q) != {"token"} or len(q["token"]) != 1 or not _TOKEN_RE.match(q["token"][0]):
        return None
    return url


def redact_token(url: str) -> str:
    """The URL with its token replaced (for anyone but the session's owner)."""
    return re.sub(r"token=[^&#]*", "token=…", url)


# ------------------------------------------------------------------ the launcher

def empty_form() -> dict[str, str]:
    return {f: "" for f in TEXT_FIELDS} | {"type": "batch", "count": "1"}


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in (text or "").splitlines() if ln.strip()]


def _blank(v: Any) -> Any:
    return None if isinstance(v, str) and not v.strip() else (v.strip() if isinstance(v, str) else v)


def request_from_form(form: dict[str, Any], owner: Optional[str] = None) -> tuple[SessionRequest,
                                                                                 dict[str, list[str]]]:
    """The launcher's text fields as a ``SessionRequest``, and what could not be read, by field.

    Only reading happens here (``"2"`` -> 2.0, one port per comma or space, one ``NAME=value`` or
    ``HOST:PATH`` per line); every rule is ``check``'s. A field that cannot be read is reported and
    left at its default, so the request returned can still be checked for everything else; it is
    launchable only when the errors are empty. Batch-only fields are dropped for an interactive
    session: the launcher does not show them then.
    """
    from pydantic import ValidationError

    kind = (form.get("type") or "batch").strip()
    data: dict[str, Any] = {
        "type": kind, "queue": (form.get("queue") or "").strip(), "owner": owner,
        "env": _lines(form.get("env") or ""), "mounts": _lines(form.get("mounts") or ""),
        "ports": [p for p in re.split(r"[,\s]+", form.get("ports") or "") if p],
    }
    for f in ("name", "image", "preset", "cpu", "memory", "gpu", "shm_size", "omp_threads", "cluster_size",
              "cluster_mode"):
        data[f] = _blank(form.get(f))
    data["preemptible"] = str(form.get("preemptible") or "").strip().lower() in ("true", "1", "yes")
    data["count"] = _blank(form.get("count")) or 1
    if kind == "batch":
        for f in BATCH_ONLY:
            data[f] = _blank(form.get(f))
    errors: dict[str, list[str]] = {}
    if not data["queue"]:
        errors["queue"] = ["choose the queue the session runs on"]
    for _ in range(len(data)):
        try:
            return SessionRequest.model_validate(data), errors
        except ValidationError as exc:
            for e in exc.errors():
                key = str((e.get("loc") or ("general",))[0])
                field = key if key in FIELD_STEP else "general"
                what = {"ports": "port", "omp_threads": "omp-threads", "shm_size": "shm-size"}.get(field, field)
                got = e.get("input")
                msg = e.get("msg", "invalid").lower()
                errors.setdefault(field, []).append(f"{what} {got!r}: {msg}" if got is not None else f"{what}: {msg}")
                data.pop(key, None)
    raise AssertionError("unreachable: every field that fails is left at its default")


def form_from_request(data: dict[str, Any]) -> dict[str, str]:
    """A recent launch's stored request (``SessionRequest`` fields) as launcher text fields (relaunch)."""
    form = empty_form()
    for f in TEXT_FIELDS:
        v = data.get(f)
        if v is None:
            continue
        if f == "env":
            items = [f"{k}={val}" for k, val in v.items()] if isinstance(v, dict) else [str(x) for x in v]
            form[f] = "\n".join(items)
        elif f == "mounts":
            form[f] = "\n".join(str(x) for x in v)
        elif f == "ports":
            form[f] = ", ".join(str(x) for x in v)
        elif isinstance(v, float) and v.is_integer():
            form[f] = str(int(v))
        else:
            form[f] = str(v)
    return form


def field_of(message: str) -> str:
    """Which launcher field a back-end problem message is about ("general" when none)."""
    text = message.strip()
    for field, pat in _FIELD_RULES:
        if pat.search(text):
            return field
    return "general"


def field_errors(problems: Iterable[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in problems:
        out.setdefault(field_of(p), []).append(p)
    return out


def merge_errors(*parts: dict[str, list[str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in parts:
        for f, msgs in part.items():
            out.setdefault(f, []).extend(m for m in msgs if m not in out.get(f, []))
    return out


def errors_through(errors: dict[str, list[str]], step: int) -> dict[str, list[str]]:
    """The errors of fields shown on steps 0..``step`` (what blocks going past ``step``)."""
    return {f: m for f, m in errors.items() if FIELD_STEP.get(f, REVIEW) <= step and m}


def first_step_with_errors(errors: dict[str, list[str]]) -> Optional[int]:
    steps = [FIELD_STEP.get(f, REVIEW) for f, m in errors.items() if m]
    return min(steps) if steps else None


def review_rows(req: SessionRequest, started: Any = None) -> pd.DataFrame:
    """What will start: the request as entered and, after a dry run, what the queue resolved."""
    rows: list[tuple[str, str]] = [("type", req.type), ("queue", req.queue)]
    names = list(getattr(started, "names", []) or [])
    rows.append(("names", ", ".join(names) if names else (req.name or "(a readable random name)")))
    if started is not None:
        rows += [("preset", started.preset), ("resources", started.resources)]
        if started.ports:
            rows.append(("ports", ", ".join(map(str, started.ports))))
        if started.starts_at:
            rows.append(("starts at", f"{started.starts_at:%Y-%m-%d %H:%M:%S} UTC"))
        if started.timeout_s:
            rows.append(("timeout", f"{started.timeout_s:g} s"))
    else:
        rows += [("preset", req.preset or "(queue default)")]
    if req.startup_command:
        rows.append(("startup command", req.startup_command))
    if req.env:
        env = req.env if isinstance(req.env, list) else [f"{k}={v}" for k, v in req.env.items()]
        rows.append(("environment", "; ".join(env)))
    rows.append(("mounts", "; ".join(req.mounts) if req.mounts else "none (nothing is kept after the session)"))
    if req.count > 1:
        rows.append(("count", str(req.count)))
    if req.omp_threads:
        rows.append(("OMP threads", str(req.omp_threads)))
    size = getattr(started, "cluster_size", None) or req.cluster_size or 1
    if size > 1:
        mode = getattr(started, "cluster_mode", None) or req.cluster_mode or "single-node"
        rows.append(("cluster", f"{size} members ({mode}): main1{''.join(f', sub{i}' for i in range(1, size))}; "
                                "each with the resources above, placed all or none"))
    if req.preemptible:
        rows.append(("preemptible", "yes: fills idle hardware, may be preempted by regular work"))
    return pd.DataFrame(rows, columns=["item", "value"])


# ------------------------------------------------------------------ sessions

def fmt_seconds(s: Optional[float]) -> str:
    """``1m30s``, ``2h5m``: the CLI's duration format (``-`` for none)."""
    from prefect_launch.times import format_duration

    if s is None:
        return "-"
    return format_duration(max(0.0, float(s)))


def _time_of(row: Any) -> str:
    if row.elapsed_s is not None:
        return f"ran {fmt_seconds(row.elapsed_s)}"
    if row.waited_s:
        return f"waited {fmt_seconds(row.waited_s)}"
    return "-"


SESSION_COLUMNS = ["name", "status", "type", "queue", "resources", "time", "agent", "position", "eta", "why",
                   "owner", "id"]


def sessions_frame(rows: Iterable[Any]) -> pd.DataFrame:
    """`session ls` as a table (rows are ``session_view.SessionRow``)."""
    out = [{
        "name": shown_name(r.name), "status": r.status, "type": r.type or "-", "queue": r.queue or "-",
        "resources": r.resources or "-", "time": _time_of(r), "agent": r.agent or "-",
        "position": r.position, "eta": f"{r.eta:%H:%M:%S}" if r.eta else "-", "why": r.reason or "",
        "owner": r.owner or "-", "id": r.id,
    } for r in rows]
    df = pd.DataFrame(out, columns=SESSION_COLUMNS)
    df["position"] = df["position"].astype("Int64")
    return df


def session_label(row: Any) -> str:
    return f"{shown_name(row.name)} · {row.status} · {row.id[:8]}"


def is_live(status: Optional[str]) -> bool:
    return status in LIVE_STATUSES


def session_detail(fr: Any, row: Any, urls: list[str], usage: Optional[dict] = None,
                   idle_checks: Optional[dict] = None) -> dict[str, Any]:
    """What `session show --json` prints for the run ``fr`` (``row`` = its SessionRow; ``idle_checks``
    from ``session_view.idle_checks_of``)."""
    jv = getattr(fr, "job_variables", None) or {}
    params = getattr(fr, "parameters", None) or {}
    return {**row.model_dump(mode="json"), "env": jv.get("env") or {}, "mounts": params.get("mounts", []),
            "startup_command": params.get("startup_command") or None,
            "allocation": (getattr(fr, "labels", None) or {}).get("launch.placement"), "app_urls": list(urls),
            "state_message": fr.state.message if getattr(fr, "state", None) else None, "idle_checks": idle_checks,
            "usage": usage}


DETAIL_FIELDS = ("owner", "launched_by", "status", "type", "queue", "resources", "agent", "allocation", "created", "started",
                 "ended", "elapsed_s", "waited_s", "position", "eta", "reason", "ports", "startup_command",
                 "mounts", "env", "state_message")


def detail_frame(detail: dict[str, Any]) -> pd.DataFrame:
    """The detail panel's key/value table (app URLs, usage, idle checks and history have their own)."""
    rows = []
    for k in DETAIL_FIELDS:
        v = detail.get(k)
        if v in (None, [], {}, ""):
            continue
        if k in ("elapsed_s", "waited_s"):
            v = fmt_seconds(v)
        elif isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        elif isinstance(v, list):
            v = ", ".join(map(str, v))
        rows.append((k.removesuffix("_s").replace("_", " "), _CONTROL.sub(" ", str(v))[:500]))
    usage = detail.get("usage") or {}
    if usage:
        for label, key in (("cpu mean %", "avg_cpu_pct"), ("peak memory", "peak_rss_bytes"),
                           ("net rx bytes", "net_rx_bytes"), ("net tx bytes", "net_tx_bytes"),
                           ("gpu util %", "avg_gpu_util_pct")):
            if usage.get(key) is not None:
                rows.append((label, str(usage[key])))
    return pd.DataFrame(rows, columns=["field", "value"])


def app_links(detail: dict[str, Any], viewer_is_owner: bool) -> list[dict[str, str]]:
    """The session's app URLs that pass :func:`safe_app_url`; the token only for the owner."""
    out = []
    for url in detail.get("app_urls") or []:
        ok = safe_app_url(url)
        if not ok:
            continue
        port = urlsplit(ok).port
        out.append({"app": "JupyterLab", "port": str(port), "url": ok if viewer_is_owner else redact_token(ok)})
    return out


IDLE_REASONS = ("idle-session-lifetime", "idle-timeout", "idle-utilization")


def idle_rows(detail: dict[str, Any]) -> pd.DataFrame:
    """Idle checks as `session show` reports them (``idle_checks``: the agent's last judgement with
    ``checks`` and the printed ``lines``, from ``session_view.idle_checks_of``), plus the reclaim
    reason when an idle checker ended the session. Empty when neither."""
    rows: list[dict[str, str]] = []
    idle = detail.get("idle_checks")
    if isinstance(idle, dict):
        checks = [c for c in idle.get("checks") or [] if isinstance(c, dict)]
        lines = [str(x) for x in idle.get("lines") or []]
        for i, c in enumerate(checks):
            left = c.get("remaining_s", c.get("grace_remaining_s"))
            line = lines[i] if i < len(lines) else ""
            rows.append({"check": _text(c.get("name") or "-"),
                         "time left": fmt_seconds(left) if isinstance(left, (int, float)) else "-",
                         "status": _text(line.split(": ", 1)[1] if ": " in line else line)[:300]})
    msg = detail.get("state_message") or detail.get("reason") or ""
    for reason in IDLE_REASONS:
        if isinstance(msg, str) and reason in msg:
            rows.append({"check": reason, "time left": "0s", "status": f"reclaimed: {_text(msg)[:300]}"})
            break
    return pd.DataFrame(rows, columns=["check", "time left", "status"])


def idle_note(detail: dict[str, Any]) -> str:
    """The "(as judged by the agent N ago)" line `session show` adds, or ""."""
    idle = detail.get("idle_checks")
    if not isinstance(idle, dict):
        return ""
    extra = [str(x) for x in idle.get("lines") or []][len(idle.get("checks") or []):]
    return _text(" ".join(extra))[:200]


# ------------------------------------------------------------------ scheduling history

def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _ts(v: Any) -> Optional[datetime]:
    if v is None or v == "":
        return None
    if isinstance(v, datetime):
        return v if v.tzinfo else v.replace(tzinfo=timezone.utc)
    try:
        t = datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _text(v: Any) -> str:
    v = getattr(v, "value", v)  # enums
    return "" if v is None else _CONTROL.sub(" ", str(v))


def filter_history(records: Iterable[Any], phases: Iterable[str] = (), results: Iterable[str] = ()) -> list[Any]:
    """Records of the chosen phases and results (none chosen: all), in their given order."""
    ph, rs = set(phases), set(results)
    return [r for r in records if (not ph or _text(_get(r, "phase")) in ph)
            and (not rs or _text(_get(r, "result")) in rs)]


HISTORY_COLUMNS = ["created", "updated", "phase", "result", "from", "to", "error code", "attempts", "message",
                   "substeps", "id"]


def history_frame(records: Iterable[Any]) -> pd.DataFrame:
    rows = []
    for r in records:
        subs = _substeps(r)
        rows.append({"created": _ts(_get(r, "created")), "updated": _ts(_get(r, "updated")),
                     "phase": _text(_get(r, "phase")), "result": _text(_get(r, "result")),
                     "from": _text(_get(r, "from_state")), "to": _text(_get(r, "to_state")),
                     "error code": _text(_get(r, "error_code")), "attempts": _get(r, "attempts") or 1,
                     "message": _text(_get(r, "message"))[:500], "substeps": len(subs), "id": _text(_get(r, "id"))})
    return pd.DataFrame(rows, columns=HISTORY_COLUMNS)


def _substeps(record: Any) -> list[Any]:
    return list(_get(record, "sub_steps") or _get(record, "substeps") or [])


def substeps_frame(record: Any) -> pd.DataFrame:
    """A record's sub-steps (sequencing, validation, capacity check, allocation...) with their times."""
    rows = []
    for s in _substeps(record):
        started = _ts(_get(s, "started", _get(s, "created")))
        ended = _ts(_get(s, "ended", _get(s, "updated")))
        took = (ended - started).total_seconds() * 1000 if started and ended else None
        rows.append({"step": _text(_get(s, "step") or _get(s, "name")), "result": _text(_get(s, "result")),
                     "error code": _text(_get(s, "error_code")), "message": _text(_get(s, "message"))[:500],
                     "started": started, "took ms": took})
    return pd.DataFrame(rows, columns=["step", "result", "error code", "message", "started", "took ms"])


def record_message(record: Any) -> str:
    return _text(_get(record, "message"))


def history_title(record: Any) -> str:
    """One line per record for its expander: phase, result, attempts, error code."""
    n = _get(record, "attempts") or 1
    code = _text(_get(record, "error_code"))
    when = _ts(_get(record, "updated")) or _ts(_get(record, "created"))
    parts = [_text(_get(record, "phase")) or "-", _text(_get(record, "result")) or "-"]
    if code:
        parts.append(code)
    if n > 1:
        parts.append(f"x{n}")
    if when:
        parts.append(f"{when:%H:%M:%S}")
    return " · ".join(parts)


# ------------------------------------------------------------------ recent launches

RECENT_COLUMNS = ["id", "pinned", "label", "type", "queue", "name", "created"]


def recent_frame(entries: Iterable[Any]) -> pd.DataFrame:
    rows = [{"id": e.id, "pinned": bool(e.pinned), "label": _text(e.label)[:100],
             "type": _text(e.request.get("type")), "queue": _text(e.request.get("queue")),
             "name": shown_name(e.request.get("name")) if e.request.get("name") else "-",
             "created": _ts(e.created)} for e in entries]
    return pd.DataFrame(rows, columns=RECENT_COLUMNS)


def relaunch_request(entry: Any, owner: str, name: Optional[str] = None) -> SessionRequest:
    """What `session relaunch ID [--name]` starts: the stored request, a fresh (or given) name, this owner."""
    return SessionRequest.model_validate({**entry.request, "name": name or None, "owner": owner})

