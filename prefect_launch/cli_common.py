"""What every `prefect-launch` command shares: output, errors, the Prefect client and time options.

Both command modules (``prefect_launch.cli`` and ``prefect_launch.session_cli``) import this one, and
it imports neither. Output for scripts is JSON on stdout (``print_json``); errors go to stderr with
what to do next and exit 2 (``fail``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import datetime
from typing import Any, Iterator, NoReturn

import typer
from rich.console import Console

from prefect_launch.times import parse_when

console = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: MESSAGE`` on stderr and exit with ``code``."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def prefect_client() -> Iterator[Any]:
    """A sync Prefect client (with the API retries installed); says what to do when no server is set or
    the server wants an auth string."""
    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    from prefect_launch.api_retry import install

    install()
    if not os.environ.get("PREFECT_API_URL"):
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():
            fail("PREFECT_API_URL is not set; start a server (`make demo`) or export PREFECT_API_URL")
    import httpx

    try:
        with get_client(sync_client=True) as client:
            yield client
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 401:
            raise
        fail("the Prefect server refused the request (401 Unauthorized): it requires an auth string; export "
             "PREFECT_API_AUTH_STRING=user:password (the server's PREFECT_SERVER_API_AUTH_STRING)")
    except httpx.TransportError as exc:  # connection refused or broken: the server, or the gateway, is away
        fail(unreachable(exc))


def unreachable(exc: Exception) -> str:
    """What to tell the user when the Prefect API (the server, or `prefect-launch gateway` in front of it) does
    not answer: a refused connection sent nothing; one broken mid-request may or may not have been applied."""
    from prefect.settings import PREFECT_API_URL

    url = os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'no answer'}"
    import httpx

    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        then = ("nothing was sent. Is the Prefect server, or the gateway in front of it, running? Try again once "
                "it answers")
    else:
        then = ("the connection broke during a request, which may or may not have been applied: check with "
                "`prefect-launch runs ls` before trying again")
    return f"cannot reach the Prefect API at {url} ({why}); {then}"


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def time_option(value: Any) -> datetime:
    """``parser=`` of ``--since`` / ``--until``: an aware datetime (:func:`prefect_launch.times.parse_when`:
    an ISO date or time, no offset meaning UTC, or a duration ago), read when the command line is parsed;
    anything else is a usage error (exit 2) saying which forms are accepted."""
    try:
        return parse_when(value, what="")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def starts_at_option(value: Any) -> str:
    """``parser=`` of ``--starts-at``: checked like :func:`time_option` with a duration meaning that long from
    now, and kept as written (``1h``): the session back end reads it at submission, and a relaunched
    configuration starts an hour after its relaunch, not at the first launch's time."""
    try:
        parse_when(value, what="", ahead=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return str(value).strip()


TIME_HELP = "ISO date or time (no offset: UTC), or a duration ago: 90s, 1h30m, 2d, 2w"
