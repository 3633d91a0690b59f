"""The job images on a Docker daemon (``launch-env/<job>:<hash>``, image.py): listed, removed, kept under a size.

What ``prefect-launch env ls | rm | prune --images`` and the docker back end (after a build) use. An image is one
that carries the hash label (`image.HASH_LABEL`); what this module decides is pure (`image_rows`, then
`spec.lru_victims`), the daemon is only read and asked to remove tags.

- **Size**: the image's own layers (Docker's ``df``: ``Size - SharedSize``), not the base image it shares with
  the queue's other images: removing it frees that much. ``LAUNCH_ENV_CACHE_MAX`` applies to these images and to
  the environments folder each on its own (they live on different disks: Docker's data root, the agents' state
  directory).
- **Whose images**: those with a mark ``image-<hash>.used`` in the environments folder (``--dir``), touched by
  each run of the hash (`image.mark_used`; its time is the last use): the images this host's agents built or
  used. Images of the same daemon built through another state directory (another host's agents, a test's own
  folder) are neither listed nor pruned from this one.
- **Live runs**: a container of the image that is not exited (created, running, paused, restarting) holds it;
  such an image is never removed by the LRU or ``prune``, and ``rm`` refuses it without ``--force``. Between a
  build and its container's creation the build's own hash is kept (``keep``).
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional

from prefect_launch.workers.environments.builder import cache_max_bytes, default_cache_dir
from prefect_launch.workers.environments.image import HASH_LABEL
from prefect_launch.workers.environments.spec import CachedEnv, lru_victims

LIVE_STATES = frozenset({"created", "running", "paused", "restarting"})
RUN_ID_KEY = "io.prefect-launch.run-id"  # tags.RUN_ID_LABEL, the docker back end's container label


def _epoch(created: Any) -> float:
    """Docker's ``Created`` (an ISO string with nanoseconds, or epoch seconds from ``df``) as epoch seconds."""
    if isinstance(created, (int, float)):
        return float(created)
    text = str(created or "")
    if not text:
        return 0.0
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        base = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return 0.0
    return base + (float("0." + frac[:6]) if frac[:6].isdigit() else 0.0)


def image_rows(images: Iterable[dict], df_images: Iterable[dict], containers: Iterable[dict],
               used: dict[str, float]) -> list[dict]:
    """One row per job image (pure: what the daemon answered, and the last-use marks by hash).

    ``images``: ``api.images(filters={"label": HASH_LABEL})`` (Id, RepoTags, Labels, Created);
    ``df_images``: ``api.df()["Images"]`` (Id, Size, SharedSize); ``containers``: ``api.containers(all=True)``
    (ImageID, State, Names, Labels); ``used``: hash -> epoch seconds of its last use."""
    sizes = {d.get("Id"): d for d in df_images}
    by_image: dict[str, list[str]] = {}
    for c in containers:
        if str(c.get("State") or "").lower() in LIVE_STATES:
            who = (c.get("Labels") or {}).get(RUN_ID_KEY) or ((c.get("Names") or ["?"])[0]).lstrip("/")
            by_image.setdefault(c.get("ImageID") or "", []).append(who)
    rows = []
    for img in images:
        env_hash = (img.get("Labels") or {}).get(HASH_LABEL)
        if not env_hash:
            continue
        df = sizes.get(img.get("Id")) or {}
        size = int(df.get("Size") if df.get("Size") is not None else img.get("Size") or 0)
        shared = int(df.get("SharedSize") or 0)
        own = size - shared if 0 < shared <= size else size
        rows.append({"hash": env_hash, "id": img.get("Id"),
                     "tags": sorted(t for t in img.get("RepoTags") or [] if t != "<none>:<none>"),
                     "size": own, "total_size": size,
                     "last_used": used.get(env_hash) or _epoch(img.get("Created")),
                     "users": sorted(by_image.get(img.get("Id") or "", []))})
    return sorted(rows, key=lambda r: r["hash"])


class ImageCache:
    """The daemon's job images marked in the environments folder ``lock_dir`` (their last use)."""

    def __init__(self, client: Any, lock_dir: Optional[Path] = None):
        self.client = client
        self.lock_dir = Path(lock_dir) if lock_dir is not None else default_cache_dir()

    def _used(self) -> dict[str, float]:
        out = {}
        if self.lock_dir.is_dir():
            for mark in self.lock_dir.glob("image-*.used"):
                with contextlib.suppress(OSError):
                    out[mark.name[len("image-"):-len(".used")]] = mark.stat().st_mtime
        return out

    def entries(self) -> list[dict]:
        """Every job image: hash, id, tags, own size, last use, the runs (containers) using it."""
        api = self.client.api
        images = api.images(filters={"label": HASH_LABEL})
        if not images:
            return []
        used = self._used()
        images = [i for i in images if (i.get("Labels") or {}).get(HASH_LABEL) in used]  # this folder's images
        if not images:
            return []
        return image_rows(images, api.df().get("Images") or [], api.containers(all=True), used)

    def remove(self, env_hash: str, force: bool = False) -> bool:
        """Remove the hash's image (every tag; not while a live container uses it, unless ``force``); False when
        absent. Raises RuntimeError naming the runs that use it."""
        rows = [r for r in self.entries() if r["hash"] == env_hash]
        if not rows:
            return False
        for row in rows:
            if row["users"] and not force:
                raise RuntimeError(f"image {env_hash} is used by run(s) {', '.join(row['users'])}")
            if force:  # by id: every tag at once (a live container keeps its layers until it ends)
                self.client.api.remove_image(row["id"], force=True, noprune=False)
            else:  # tag by tag: Docker itself refuses the last one while any container (a new one too) uses it
                for tag in row["tags"] or [row["id"]]:
                    self.client.api.remove_image(tag, force=False, noprune=False)
        with contextlib.suppress(OSError):
            (self.lock_dir / f"image-{env_hash}.used").unlink()
        return True

    def enforce_limit(self, max_bytes: Optional[int] = None, keep: Iterable[str] = ()) -> list[str]:
        """LRU removal down to ``max_bytes`` (default ``LAUNCH_ENV_CACHE_MAX``); images in use and ``keep`` stay."""
        limit = max_bytes if max_bytes is not None else cache_max_bytes()
        if limit is None:
            return []
        return self._remove_victims(limit, set(keep))

    def prune(self, max_bytes: Optional[int] = None, all_unused: bool = False) -> list[str]:
        """LRU down to the limit (``all_unused``: every image no live container uses)."""
        limit = 0 if all_unused else (max_bytes if max_bytes is not None else cache_max_bytes())
        if limit is None:
            return []
        return self._remove_victims(limit, set())

    def _remove_victims(self, limit: int, keep: set[str]) -> list[str]:
        import docker.errors

        rows = self.entries()
        envs = [CachedEnv(r["hash"], int(r["size"]), float(r["last_used"]), bool(r["users"]) or r["hash"] in keep)
                for r in rows]
        removed = []
        for victim in lru_victims(envs, limit):
            with contextlib.suppress(RuntimeError, docker.errors.APIError):
                if self.remove(victim.hash):
                    removed.append(victim.hash)
        return removed
