"""Creating a submission's runs safely when the server is busy or briefly gone.

A busy SQLite-backed Prefect server answers 503 ("database is locked"); a restarting one drops
connections; a slow one times out after it has already committed. Prefect's client retries some of
these on its own, and a retried creation without a key can make a second run. Here every run of a
submission carries an idempotency key (``<submission key>:<index>``): Prefect returns the existing run
when a creation with the same key is repeated, so retrying never makes two runs. Transient failures
(connection errors, timeouts, 408/429/5xx) are retried with jittered backoff until
``LAUNCH_SUBMIT_RETRY_SECONDS`` (default 300) have passed (Prefect's client also retries 503 a few times
inside each attempt - except run creation, see ``_create``). ``count`` runs are all or none: when a creation finally fails, the runs
already created are deleted (and the one whose answer was lost, if the server made it), and the
error says so.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any, Callable, Optional

import httpx

from prefect_launch.workers.scheduling.resources import LaunchValidationError

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


class SubmitFailed(LaunchValidationError):
    """Creating the runs failed; ``created`` ran to ``deleted`` (all of them unless ``left`` is non-empty)."""

    def __init__(self, message: str, created: int = 0, deleted: int = 0, left: Optional[list[str]] = None):
        super().__init__(message)
        self.created, self.deleted, self.left = created, deleted, left or []


def retry_seconds() -> float:
    return float(os.environ.get("LAUNCH_SUBMIT_RETRY_SECONDS", "300"))


def new_submission_key() -> str:
    return f"launch-submit:{uuid.uuid4().hex}"


def is_transient(exc: BaseException) -> bool:
    """A failure that a retry may cure: the server busy, restarting or slow (not a refusal)."""
    if isinstance(exc, httpx.TransportError):  # connect errors, timeouts, dropped connections
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in TRANSIENT_STATUS
    return isinstance(exc, (ConnectionError, TimeoutError))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        body = exc.response.text[:200].strip()
        return f"server answered {exc.response.status_code} {exc.response.reason_phrase}" + (f": {body}" if body else "")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def with_retries(call: Callable[[], Any], deadline: float, what: str) -> Any:
    """``call()`` until it succeeds, fails for good, or ``deadline`` (time.time()) passes."""
    delay = 0.25
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc) or time.time() + delay > deadline:
                raise
            time.sleep(delay * (0.5 + random.random()))  # jitter keeps concurrent submitters apart
            delay = min(delay * 2, 5.0)


def create_runs(client: Any, deployment_id: Any, count: int, run_kwargs: Callable[[int], dict[str, Any]],
                key: Optional[str] = None) -> list[Any]:
    """Create ``count`` runs of a deployment, all or none; ``run_kwargs(i)`` gives run i's arguments.

    ``key`` names the submission (default: a fresh one): repeating a call with the same key returns
    the same runs instead of making new ones.
    """
    key = key or new_submission_key()
    deadline = time.time() + retry_seconds()
    created: list[Any] = []
    i = 0
    try:
        for i in range(count):
            kw = run_kwargs(i)
            created.append(with_retries(
                lambda: _create(client, deployment_id, idempotency_key=f"{key}:{i}", **kw),
                deadline, f"run {i + 1} of {count}"))
    except Exception as exc:
        deleted, left = _undo(client, deployment_id, created, f"{key}:{i}" if is_transient(exc) else None,
                              run_kwargs(i))
        where = f"creating run {i + 1} of {count} failed" if count > 1 else "creating the run failed"
        if is_transient(exc):
            where += f" (still failing after {retry_seconds():.0f} s of retries)"
        undo = (f"deleted the {deleted} run(s) already created, so nothing of this submission is queued"
                if not left else
                f"could not delete {len(left)} run(s) of this submission: {', '.join(left)}; delete them with "
                "`prefect flow-run delete ID`")
        if not created and not left:
            undo = "nothing of this submission is queued"
        raise SubmitFailed(f"{where}: {_describe(exc)}; {undo}", created=len(created), deleted=deleted,
                           left=left) from exc
    return created


def _create(client: Any, deployment_id: Any, **kw: Any) -> Any:
    """One creation with no retries inside Prefect's client: it waits 2, 4, 8 s between tries, and a
    SQLite-backed server answers 503 whenever another write commits while the creation's transaction
    reads (seen: up to 15 s per run with two agents busy). ``with_retries`` tries again after 0.1-0.4 s
    first, and the idempotency key keeps a retry from making a second run."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
        return client.create_flow_run_from_deployment(deployment_id, **kw)


def _undo(client: Any, deployment_id: Any, created: list[Any], lost_key: Optional[str],
          lost_kwargs: dict[str, Any]) -> tuple[int, list[str]]:
    """Delete what this submission created; returns (deleted, ids that could not be deleted)."""
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelled

    deadline = time.time() + min(30.0, retry_seconds())
    runs = list(created)
    if lost_key:  # the server may have made the run whose answer never came: look it up by its key
        try:  # same key: returns that run if it exists; otherwise makes a Cancelled one no agent takes
            runs.append(with_retries(lambda: client.create_flow_run_from_deployment(
                deployment_id, idempotency_key=lost_key, **dict(lost_kwargs, state=Cancelled(
                    message="placeholder of a failed submission; deleted at once"))), deadline, "look-up"))
        except Exception:
            pass  # the server is still unreachable; nothing more can be known
    deleted, left = 0, []
    for fr in runs:
        try:
            with_retries(lambda: client.delete_flow_run(fr.id), deadline, "delete")
            deleted += 1 if fr in created else 0
        except ObjectNotFound:
            deleted += 1 if fr in created else 0
        except Exception:
            left.append(str(fr.id))
    return deleted, left
