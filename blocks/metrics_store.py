"""The run-metrics store block: how to reach the store's SQL database, and how long to keep its rows.

Blocks are a poor place for time series (each save replaces one encrypted JSON
document), so the block only carries the SQLAlchemy URL, its password (or the name
of a Secret block holding it) and retention; runs, samples and summaries live in SQL
tables that the store creates and upgrades itself (see
:mod:`prefect_launch.blocks.metrics_schema`). The block's reads and writes are
:class:`~prefect_launch.blocks.metrics_repository.MetricsRepository`, which it mixes
in; the records they take and give are :mod:`prefect_launch.blocks.metrics_records`.

Default URL (``url=None``): an SQLite file ``launch-metrics.db`` beside the
Prefect database under ``PREFECT_HOME``. PostgreSQL works with
``postgresql+psycopg://user@host:port/db`` (password may go in ``password``).

Typical use::

    store = RunMetricsStore.load("default")          # or RunMetricsStore()
    store, how = configure_store("default", url)     # create/update the saved block (setup)

Prefect finds the block type by its slug ``launch-run-metrics-store``; saved block
documents and ``prefect block register -m prefect_launch.blocks.metrics_store`` name this
module, so the class stays here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional
from urllib.parse import quote_plus

import sqlalchemy as sa
from pydantic import Field, PrivateAttr, SecretStr

from prefect.blocks.core import Block

from prefect_launch.blocks.metrics_repository import MetricsRepository

__all__ = ["RunMetricsStore", "default_store_url", "configure_store", "split_password"]


def default_store_url() -> str:
    """``sqlite:///<PREFECT_HOME>/launch-metrics.db`` (the Prefect DB's directory by default)."""
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    return f"sqlite:///{home / 'launch-metrics.db'}"


# --------------------------------------------------------------------- block


class RunMetricsStore(MetricsRepository, Block):
    """Where prefect-launch keeps per-run metrics: the SQL connection of the store.

    The rows (runs, samples, summaries) live in the store's own tables; this block
    holds only how to reach them and how long to keep them.
    """

    _block_type_name = "Launch Run Metrics Store"
    _block_type_slug = "launch-run-metrics-store"
    _description = (
        "SQL store (SQLite or PostgreSQL) for prefect-launch run metrics: per-run samples, "
        "summaries and queue aggregates. Holds the SQLAlchemy URL and the retention."
    )
    _documentation_url = "https://github.com/prefect-launch/prefect-launch"

    url: Optional[str] = Field(
        default=None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://launch@db:5432/launch. "
        "Empty: SQLite file launch-metrics.db under PREFECT_HOME.",
    )
    password: Optional[SecretStr] = Field(
        default=None, description="Database password, put into the URL at connect time (kept out of `url`)."
    )
    password_secret: Optional[str] = Field(
        default=None, description="Name of a Prefect Secret block holding the database password, read at "
        "connect time (instead of `password`).",
    )
    retention_days: Optional[int] = Field(
        default=90, description="purge() without an argument deletes runs that ended longer ago than this."
    )

    # ------------------------------------------------------------ connection

    _secret_password: Optional[str] = PrivateAttr(None)  # the Secret block's value, read once per instance

    def _password_value(self) -> Optional[str]:
        if self.password is not None:
            return self.password.get_secret_value()
        if not self.password_secret:
            return None
        if self._secret_password is None:
            from prefect.blocks.system import Secret

            try:
                secret = Secret.load(self.password_secret, _sync=True)
            except ValueError:
                raise ValueError(f"the metrics store's password Secret block {self.password_secret!r} does not "
                                 "exist; create it or run `prefect-launch setup --metrics-password-secret NAME`") from None
            self._secret_password = str(secret.get())
        return self._secret_password

    def resolved_url(self) -> str:
        """The URL to connect with, password included: never print or log it (see :meth:`display_url`)."""
        url = self.url or default_store_url()
        password = self._password_value()
        if password is not None:
            u = sa.engine.make_url(url).set(password=password)
            url = u.render_as_string(hide_password=False)
        return url

    def display_url(self) -> str:
        """The URL for people: a password in it shows as ``***``."""
        if not self.url:
            return "(SQLite beside the Prefect database)"
        try:
            return sa.engine.make_url(self.url).render_as_string(hide_password=True)
        except Exception:
            return "(unparseable URL)"

    def redact(self, text: str) -> str:
        """``text`` with this store's password (and URLs holding it) masked: for error messages."""
        try:
            password = self._password_value()
        except Exception:
            password = None
        for secret in filter(None, [password, quote_plus(password) if password else None]):
            text = text.replace(secret, "***")
        return text

    def password_source(self) -> str:
        """Where the password comes from: ``none``, ``block`` (encrypted field) or ``secret:<block name>``."""
        if self.password is not None:
            return "block"
        return f"secret:{self.password_secret}" if self.password_secret else "none"


# ------------------------------------------------------------------- set-up


def split_password(url: str) -> tuple[str, Optional[str]]:
    """``url`` without its password, and the password (None when it has none).

    Raises ValueError without repeating the URL (it may hold a password).
    """
    try:
        u = sa.engine.make_url(url)
    except Exception:
        raise ValueError("malformed metrics store URL: expected e.g. postgresql+psycopg://user@host:5432/db "
                         "or sqlite:///path/launch-metrics.db") from None
    if u.password is None:
        return url, None
    return u._replace(password=None).render_as_string(hide_password=False), str(u.password)


def configure_store(name: str, url: Optional[str] = None,
                    password_secret: Optional[str] = None) -> tuple["RunMetricsStore", str]:
    """Create or update the store block ``name``; returns it and ``created``/``updated``/``kept``.

    A password inside ``url`` is moved to the block's encrypted ``password`` field (the saved
    ``url`` never holds it); ``password_secret`` names a Secret block read at connect time
    instead. Given a ``url``, the password settings are this call's; given only
    ``password_secret``, the stored URL is kept. A stored URL that still holds a password is
    rewritten the same way. Raises ValueError (without any password) on bad input.
    """
    from prefect.blocks.system import Secret

    clean, password = split_password(url) if url else (None, None)
    if password is not None and password_secret:
        raise ValueError("give the store's password either inside --metrics-url or as --metrics-password-secret, "
                         "not both")
    if password_secret:
        try:
            Secret.load(password_secret, _sync=True)
        except ValueError:
            raise ValueError(f"no Secret block named {password_secret!r} for the metrics store's password; create it "
                             f"first, e.g. Secret(value='...').save({password_secret!r})") from None
    try:
        current: Optional[RunMetricsStore] = RunMetricsStore.load(name, _sync=True)
    except ValueError:
        current = None
    if current is None:
        store = RunMetricsStore(url=clean, password=password, password_secret=password_secret)
        store.save(name)
        return store, "created"
    want = {"url": current.url, "password": current.password, "password_secret": current.password_secret}
    if url:
        want = {"url": clean, "password": SecretStr(password) if password is not None else None,
                "password_secret": password_secret}
    elif password_secret:
        want.update(password=None, password_secret=password_secret)
    if want["url"]:
        stored_clean, stored_password = split_password(want["url"])
        if stored_password is not None:  # an old block with the password inside its URL
            want["url"] = stored_clean
            if want["password"] is None and not want["password_secret"]:
                want["password"] = SecretStr(stored_password)

    def plain(v: dict) -> tuple:
        pw = v["password"]
        return v["url"], pw.get_secret_value() if pw is not None else None, v["password_secret"]

    if plain(want) == plain({"url": current.url, "password": current.password,
                             "password_secret": current.password_secret}):
        return current, "kept"
    store = RunMetricsStore(retention_days=current.retention_days, **want)
    store.save(name, overwrite=True)
    return store, "updated"

