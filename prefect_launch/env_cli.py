"""`prefect-launch env ls | rm | prune`: the host's cache of job environments (workers/environments/builder.py)."""

from __future__ import annotations

import time
from typing import List, Optional

import typer
from rich.table import Table

from prefect_launch.cli_common import console, fail, print_json

env_app = typer.Typer(help="Job environments cached on this host (one virtual environment per content hash).",
                      no_args_is_help=True)


def _cache(cache_dir: Optional[str]):
    from prefect_launch.workers.environments.builder import EnvCache

    return EnvCache(cache_dir) if cache_dir else EnvCache()


DIR_OPTION = typer.Option(None, "--dir", help="The cache folder (default: LAUNCH_ENV_DIR, else _envs in the "
                                              "agents' state directory)")


@env_app.command("ls")
def env_ls(cache_dir: Optional[str] = DIR_OPTION,
           as_json: bool = typer.Option(False, "--json", help="Print the environments as JSON.")) -> None:
    """Every complete environment: hash, size, last use, the live runs using it, its pins."""
    from prefect_launch.workers.scheduling.resources import format_size

    cache = _cache(cache_dir)
    entries = cache.entries()
    if as_json:
        print_json({"dir": str(cache.root), "environments": entries})
        return
    table = Table(title=f"job environments in {cache.root}")
    for col in ("hash", "size", "last used", "live runs", "built in", "pins"):
        table.add_column(col)
    now = time.time()
    for e in entries:
        table.add_row(e["hash"], format_size(int(e["size"])), f"{(now - e['last_used']) / 60:.0f} min ago",
                      str(len(e["users"])), f"{e['build_seconds'] or 0:.1f} s", ", ".join(e["pins"])[:80])
    console.print(table)


@env_app.command("rm")
def env_rm(hashes: List[str] = typer.Argument(..., help="Hash(es), or a unique prefix"),
           force: bool = typer.Option(False, "--force", help="Also when a live run uses it."),
           cache_dir: Optional[str] = DIR_OPTION) -> None:
    """Remove environments (the next run that needs one builds it again)."""
    cache = _cache(cache_dir)
    known = [e["hash"] for e in cache.entries()]
    for h in hashes:
        found = [k for k in known if k.startswith(h)]
        if len(found) != 1:
            fail(f"{h!r} names {'no' if not found else 'more than one'} environment; see `prefect-launch env ls`")
        try:
            cache.remove(found[0], force=force)
        except RuntimeError as exc:
            fail(f"{exc}; wait for it to end or use --force")
        console.print(f"removed {found[0]}", highlight=False)


@env_app.command("prune")
def env_prune(max_size: Optional[str] = typer.Option(
        None, "--max", help="Keep the cache under this size (default: LAUNCH_ENV_CACHE_MAX)"),
        all_unused: bool = typer.Option(False, "--all", help="Remove every environment no live run uses."),
        cache_dir: Optional[str] = DIR_OPTION,
        as_json: bool = typer.Option(False, "--json", help="Print the removed hashes as JSON.")) -> None:
    """Remove leftover build folders, then the least recently used environments of no live run over the limit."""
    from prefect_launch.workers.scheduling.resources import LaunchValidationError, parse_size

    try:
        limit = parse_size(max_size, "--max") if max_size else None
    except LaunchValidationError as exc:
        fail(str(exc))
    removed = _cache(cache_dir).prune(limit, all_unused=all_unused)
    if as_json:
        print_json({"removed": removed})
        return
    console.print(f"removed {len(removed)} environment(s){': ' + ', '.join(removed) if removed else ''}",
                  highlight=False)
