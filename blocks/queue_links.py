"""External links per launch queue (label + URL), kept in a Prefect block.

The queue monitor's "Manage Links" form edits them and its "External Links" section
shows them (e.g. Grafana, Datadog, NVIDIA Base Command, a cloud console). One block
document per queue, named ``links-<queue slug>``. Only absolute http(s) URLs are
accepted; labels and URLs are escaped when rendered as HTML.
"""

from __future__ import annotations

import html
import re
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator

from prefect.blocks.core import Block

MAX_LABEL = 80
MAX_URL = 2000


def validate_url(url: str) -> str:
    """The URL stripped, if it is an absolute http or https URL with a host; else ValueError."""
    url = (url or "").strip()
    if not url:
        raise ValueError("URL is empty")
    if len(url) > MAX_URL:
        raise ValueError(f"URL is longer than {MAX_URL} characters")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError("URL contains spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("only http:// and https:// URLs are accepted")
    if not parts.netloc or not parts.hostname:
        raise ValueError("URL has no host")
    return url


def validate_label(label: str) -> str:
    label = " ".join((label or "").split())
    if not label:
        raise ValueError("label is empty")
    if len(label) > MAX_LABEL:
        raise ValueError(f"label is longer than {MAX_LABEL} characters")
    return label


class QueueLink(BaseModel):
    label: str = Field(description="Text shown for the link")
    url: str = Field(description="Absolute http(s) URL")

    @field_validator("label")
    @classmethod
    def _label(cls, v: str) -> str:
        return validate_label(v)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return validate_url(v)

    def html(self) -> str:
        """An anchor with label and URL escaped; opens in a new tab without referrer."""
        return (
            f'<a href="{html.escape(self.url, quote=True)}" target="_blank" rel="noopener noreferrer">'
            f"{html.escape(self.label)}</a>"
        )


class QueueLinks(Block):
    """External monitoring links for one launch queue (work pool)."""

    _block_type_name = "Launch Queue Links"
    _block_type_slug = "launch-queue-links"
    _description = "External links (label + http(s) URL) shown for a launch queue in the prefect-launch queue monitor."

    queue: str = Field(description="The launch queue (work pool) name")
    links: list[QueueLink] = Field(default_factory=list)

    # ------------------------------------------------------------ helpers

    @staticmethod
    def block_name(queue: str) -> str:
        slug = re.sub(r"[^a-z0-9-]+", "-", queue.lower()).strip("-") or "queue"
        return f"links-{slug}"[:100]

    @classmethod
    def for_queue(cls, queue: str) -> "QueueLinks":
        """The saved links of a queue, or an empty set where none are saved. Any other failure (the server
        not reachable, a stored document that no longer validates) raises: an empty set in its place
        would be saved over the real links by the next edit."""
        from prefect.exceptions import ObjectNotFound
        from pydantic import ValidationError

        name = cls.block_name(queue)
        try:
            blk = cls.load(name)
        except ValueError as exc:
            if isinstance(exc.__cause__, ObjectNotFound):  # Block.load's "Unable to find block document"
                return cls(queue=queue, links=[])
            raise
        except RuntimeError as exc:  # Block.load's "due to failed validation"
            if isinstance(exc.__cause__, ValidationError):
                raise _not_valid(name, exc.__cause__) from None
            raise
        if not isinstance(blk, QueueLinks):
            raise TypeError(f"the block {name!r} is a {type(blk).__name__}, not the queue's links")
        return blk

    @classmethod
    def saved_data(cls, api: Any, queues: Sequence[str]) -> dict[str, dict]:
        """The stored data of each of ``queues`` that has links saved (not validated: see
        :meth:`from_saved`), read in one request per 200 queues through ``api`` (the monitor's kept
        HTTP client to Prefect's REST API; ``Block.load`` makes a Prefect client, with its connection
        pool and SSL context, for every queue it reads)."""
        names: dict[str, list[str]] = {}
        for q in queues:
            names.setdefault(cls.block_name(q), []).append(q)
        wanted = list(names)
        found: dict[str, dict] = {}
        for i in range(0, len(wanted), 200):
            docs = api.post("/block_documents/filter", {
                "block_documents": {"name": {"any_": wanted[i:i + 200]}, "is_anonymous": {"eq_": False}},
                "block_types": {"slug": {"any_": [cls.get_block_type_slug()]}}, "limit": 200})
            for doc in docs:
                for q in names.get(doc["name"], []):
                    found[q] = doc["data"]
        return found

    @classmethod
    def from_saved(cls, queue: str, data: dict) -> "QueueLinks":
        """A queue's stored data (:meth:`saved_data`) as its links, each validated as when saved: a
        document edited elsewhere (the Prefect UI or API know nothing of these rules) to hold, say, a
        ``javascript:`` URL raises ValueError naming the field, and is never drawn."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _not_valid(cls.block_name(queue), exc) from None

    def store(self) -> None:
        self.save(self.block_name(self.queue), overwrite=True)

    def upsert(self, label: str, url: str, replace_label: Optional[str] = None) -> QueueLink:
        """Add a link, or replace the one labelled ``replace_label`` (or ``label``)."""
        link = QueueLink(label=label, url=url)
        target = replace_label or link.label
        for i, existing in enumerate(self.links):
            if existing.label == target:
                self.links[i] = link
                break
        else:
            if any(x.label == link.label for x in self.links):
                raise ValueError(f"a link labelled {link.label!r} exists already")
            self.links.append(link)
        return link

    def remove(self, label: str) -> bool:
        n = len(self.links)
        self.links = [x for x in self.links if x.label != label]
        return len(self.links) < n

    def html(self) -> str:
        return " · ".join(x.html() for x in self.links)


def _not_valid(block: str, exc: Any) -> ValueError:
    """What to tell of a links document that these rules refuse (``exc``: pydantic's ValidationError)."""
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    return ValueError(f"the saved links do not validate ({where}: {err.get('msg', 'invalid')}); fix or delete the "
                      f"block {block!r} in Prefect's Blocks page")
