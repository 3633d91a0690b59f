"""`prefect-launch env ls | rm | prune`: the host's cache of job environments (workers/environments/builder.py),
and with ``--images`` the job images on the Docker daemon (``launch-env/<job>:<hash>``, image_cache.py)."""

from __future__ import annotations

import os
import time
from typing import List, Optional

import typer
from rich.table import Table

from prefect_launch.cli_common import console, fail, print_json

env_app = typer.Typer(help="Job environments cached on this host (one virtual environment per content hash; "
                           "--images: one Docker image per content hash).", no_args_is_help=True)


def _cache(cache_dir: Optional[str]):
    from prefect_launch.workers.environments.builder import EnvCache

    return EnvCache(cache_dir) if cache_dir else EnvCache()


DIR_OPTION = typer.Option(None, "--dir", help="The cache folder (default: LAUNCH_ENV_DIR, else _envs in the "
                                              "agents' state directory)")
IMAGES_OPTION = typer.Option(False, "--images", help="The job images (launch-env/*) on the Docker daemon of "
                                                     "DOCKER_HOST instead of the virtual environments.")


def _images(cache_dir: Optional[str]):
    """The Docker daemon's job images; a clear error when no daemon answers."""
    from pathlib import Path

    from prefect_launch.workers.environments.image_cache import ImageCache

    try:
        import docker

        client = docker.from_env(timeout=60)
        client.ping()
    except Exception as exc:
        fail(f"no Docker daemon answers (DOCKER_HOST={os.environ.get('DOCKER_HOST') or 'unset'}): {exc}")
    return ImageCache(client, Path(cache_dir) if cache_dir else None)


@env_app.command("ls")
def env_ls(cache_dir: Optional[str] = DIR_OPTION,
           as_json: bool = typer.Option(False, "--json", help="Print the environments as JSON."),
           images: bool = IMAGES_OPTION) -> None:
    """Every complete environment: hash, size, last use, the live runs using it, its pins."""
    from prefect_launch.workers.scheduling.resources import format_size

    if images:
        _ls_images(cache_dir, as_json)
        return
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


def _ls_images(cache_dir: Optional[str], as_json: bool) -> None:
    from prefect_launch.workers.scheduling.resources import format_size

    cache = _images(cache_dir)
    entries = cache.entries()
    if as_json:
        print_json({"docker": os.environ.get("DOCKER_HOST") or "default", "images": entries})
        return
    table = Table(title="job images (launch-env/*) on the Docker daemon")
    for col in ("hash", "id", "own size", "last used", "live runs", "tags"):
        table.add_column(col)
    now = time.time()
    for e in entries:
        table.add_row(e["hash"], str(e["id"])[7:19], format_size(int(e["size"])),
                      f"{(now - e['last_used']) / 60:.0f} min ago", str(len(e["users"])), ", ".join(e["tags"]))
    console.print(table)


@env_app.command("rm")
def env_rm(hashes: List[str] = typer.Argument(..., help="Hash(es), or a unique prefix"),
           force: bool = typer.Option(False, "--force", help="Also when a live run uses it."),
           cache_dir: Optional[str] = DIR_OPTION, images: bool = IMAGES_OPTION) -> None:
    """Remove environments (the next run that needs one builds it again)."""
    cache = _images(cache_dir) if images else _cache(cache_dir)
    known = [e["hash"] for e in cache.entries()]
    for h in hashes:
        found = [k for k in known if k.startswith(h)]
        if len(found) != 1:
            fail(f"{h!r} names {'no' if not found else 'more than one'} {'image' if images else 'environment'}; "
                 f"see `prefect-launch env ls{' --images' if images else ''}`")
        try:
            cache.remove(found[0], force=force)
        except Exception as exc:  # a live run uses it (ours, or Docker's own refusal)
            fail(f"{exc}; wait for it to end or use --force")
        console.print(f"removed {found[0]}", highlight=False)


@env_app.command("prune")
def env_prune(max_size: Optional[str] = typer.Option(
        None, "--max", help="Keep the cache under this size (default: LAUNCH_ENV_CACHE_MAX)"),
        all_unused: bool = typer.Option(False, "--all", help="Remove every environment no live run uses."),
        cache_dir: Optional[str] = DIR_OPTION,
        as_json: bool = typer.Option(False, "--json", help="Print the removed hashes as JSON."),
        images: bool = IMAGES_OPTION) -> None:
    """Remove leftover build folders, then the least recently used environments of no live run over the limit."""
    from prefect_launch.workers.scheduling.resources import LaunchValidationError, parse_size

    try:
        limit = parse_size(max_size, "--max") if max_size else None
    except LaunchValidationError as exc:
        fail(str(exc))
    removed = (_images(cache_dir) if images else _cache(cache_dir)).prune(limit, all_unused=all_unused)
    if as_json:
        print_json({"removed": removed})
        return
    what = "image" if images else "environment"
    console.print(f"removed {len(removed)} {what}(s){': ' + ', '.join(removed) if removed else ''}", highlight=False)
