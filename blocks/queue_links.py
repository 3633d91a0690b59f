"""External links per launch queue (label + URL), kept in a Prefect block.

The queue monitor's "Manage Links" form edits them and its "External Links" section
shows them (e.g. Grafana, Datadog, NVIDIA Base Command, a cloud console). One block
document per queue, named ``links-<queue slug>``. Only absolute http(s) URLs are
accepted; labels and URLs are escaped when rendered as HTML.
"""

from __future__ import annotations

import html
import re
from typing import Optional
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
        """The saved links of a queue, or an empty set."""
        try:
            blk = cls.load(cls.block_name(queue))
            if isinstance(blk, QueueLinks):
                return blk
        except (ValueError, Exception):
            pass
        return cls(queue=queue, links=[])

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
