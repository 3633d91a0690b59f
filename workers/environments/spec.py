"""A job's environment declaration and its identity (pure: no uv, no network, no agent).

A job declares ``environment`` as a launch job variable (deployment ``job_variables`` in prefect.yaml,
overridable per run like the other launch variables)::

    environment: {requirements: requirements.txt}          # a file, read where it can be seen
    environment: {requirements: ["tinypkg==1.0", "rich"]}  # inline pins
    environment: {pyproject: pyproject.toml}                # its [project].dependencies
    environment: {requirements: [...], python: "3.11", find_links: /srv/wheels, index_url: https://...}
    environment: {requirements: [...], base_image: python:3.11-slim}   # docker/kubernetes queues: an image
    environment: {dockerfile: Dockerfile, context: ., requirements: [...]}   # docker/kubernetes queues

A file is read as early as it can be seen: ``submit`` (and ``--dry-run``) reads it relative to the
submitter's directory or the deployment's ``path`` and sends its pins inline with the run, so the agent needs
no access to the submitter's files; a run created elsewhere (the Prefect UI) has its file read by the agent,
relative to the deployment's ``path``. Nested ``-r``/``-c``/``-e`` lines are refused (inline them).

The identity (`env_hash`) is a SHA-256 over everything that shapes the environment: the normalised pins
(blank lines and comments dropped, so a comment never rebuilds), the Python version, the Prefect version the
agent runs, the wheel folders and index, and `FORMAT` (bumped when the builder changes how it lays out an
environment). Same hash, same environment, never rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prefect_launch.workers.scheduling.resources import LaunchValidationError

FORMAT = 1  # the builder's layout; part of the hash
HASH_CHARS = 16  # the folder name: 64 bits of the SHA-256 are plenty for one host's cache


class EnvironmentSpec(BaseModel):
    """The ``environment`` job variable as declared."""

    model_config = ConfigDict(extra="forbid")

    requirements: Optional[Union[str, list[str]]] = Field(
        default=None, description="A requirements file, or a list of pins.")
    pyproject: Optional[str] = Field(default=None, description="A pyproject.toml whose [project].dependencies "
                                                               "are the pins.")
    python: Optional[str] = Field(default=None, description="Python version, e.g. 3.11 (must be the agent's: the "
                                                            "environment reuses the agent's Prefect).")
    find_links: Optional[Union[str, list[str]]] = Field(default=None, description="Wheel folder(s) or URL(s).")
    index_url: Optional[str] = Field(default=None, description="Package index URL.")
    offline: Optional[bool] = Field(default=None, description="Never reach a package index (default: true when "
                                                              "find_links is given and index_url is not).")
    # container queues (docker, kubernetes): the image the requirements are installed into
    base_image: Optional[str] = Field(default=None, description="Image to build FROM (default: the queue's).")
    dockerfile: Optional[str] = Field(default=None, description="A Dockerfile to build (its folder is the "
                                                                "context unless `context` names one).")
    context: Optional[str] = Field(default=None, description="The Dockerfile's build context folder.")

    @field_validator("requirements")
    @classmethod
    def _pins_are_text(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(isinstance(p, str) for p in v):
            raise ValueError("requirements must be a file name or a list of pins (strings)")
        return v

    def links(self) -> list[str]:
        if self.find_links is None:
            return []
        return [self.find_links] if isinstance(self.find_links, str) else list(self.find_links)

    def is_offline(self) -> bool:
        return self.offline if self.offline is not None else bool(self.find_links) and not self.index_url


def parse_environment(value: Any, where: str = "") -> Optional[EnvironmentSpec]:
    """The job variable as a spec; None when not set. Raises LaunchValidationError saying what to change."""
    if value in (None, {}, ""):
        return None
    if isinstance(value, str) and value.lstrip().startswith("{"):  # JSON, e.g. from `submit --environment`
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise LaunchValidationError(f"environment {where} is not valid JSON: {exc}") from None
    if isinstance(value, str):  # a bare file name is the common case
        value = {"requirements": value}
    if not isinstance(value, dict):
        raise LaunchValidationError(f"environment {where} must be a mapping, e.g. "
                                    "{requirements: requirements.txt}, got " + repr(value))
    try:
        spec = EnvironmentSpec.model_validate(value)
    except Exception as exc:
        raise LaunchValidationError(f"bad environment {where}: {_short(exc)}") from None
    if spec.requirements is not None and spec.pyproject is not None:
        raise LaunchValidationError(f"environment {where} gives both requirements and pyproject; keep one")
    if spec.requirements is None and spec.pyproject is None and spec.dockerfile is None:
        raise LaunchValidationError(f"environment {where} names no requirements (a file or a list of pins) "
                                    "or pyproject (or, on container queues, a dockerfile)")
    if spec.dockerfile is not None and spec.base_image is not None:
        raise LaunchValidationError(f"environment {where} gives both dockerfile and base_image; keep one (the "
                                    "Dockerfile's FROM names its base)")
    if isinstance(spec.requirements, list):
        check_pins(spec.requirements, f"in environment {where}")
    return spec


def _short(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'value'}: {e.get('msg')}"
                         for e in errors())
    return str(exc)


def normalise_pins(lines: Iterable[str]) -> list[str]:
    """Requirement lines without blanks, comments and trailing whitespace, in their order."""
    out = []
    for line in lines:
        text = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if text:
            out.append(text)
    return out


def check_pins(pins: Sequence[str], where: str) -> list[str]:
    pins = normalise_pins(pins)
    for pin in pins:
        head = pin.split()[0]
        if head in ("-r", "-c", "-e", "--requirement", "--constraint", "--editable") or head.startswith(
                ("-r", "-c", "-e", "--requirement=", "--constraint=", "--editable=")):
            raise LaunchValidationError(f"{where}: {pin!r} names another file or an editable install; "
                                        "list its pins inline instead")
    return pins


def pins_of_file(path: Path, kind: str = "requirements") -> list[str]:
    """The pins of a requirements file or of a pyproject.toml's [project].dependencies."""
    if not path.is_file():
        raise LaunchValidationError(f"environment {kind} file {str(path)!r} does not exist")
    if kind == "pyproject" or path.name == "pyproject.toml":
        import tomllib  # noqa: PLC0415 (3.11+; the agent's Python)

        try:
            data = tomllib.loads(path.read_text())
        except Exception as exc:
            raise LaunchValidationError(f"environment pyproject {str(path)!r} is not valid TOML: {exc}") from None
        deps = (data.get("project") or {}).get("dependencies")
        if not isinstance(deps, list):
            raise LaunchValidationError(f"environment pyproject {str(path)!r} has no [project].dependencies list")
        return check_pins([str(d) for d in deps], f"in {path}")
    return check_pins(path.read_text().splitlines(), f"in {path}")


def locate(name: str, bases: Sequence[Optional[Union[str, Path]]]) -> Path:
    """``name`` as given when absolute, else the first of ``bases`` that holds it (else the first base's)."""
    p = Path(name).expanduser()
    if p.is_absolute():
        return p
    tried = [Path(b) / p for b in bases if b]
    for cand in tried:
        if cand.is_file():
            return cand
    return tried[0] if tried else p


def inline(spec: EnvironmentSpec, bases: Sequence[Optional[Union[str, Path]]]) -> EnvironmentSpec:
    """The spec with its file read into inline pins (what ``submit`` sends and the agent builds); a Dockerfile
    and its context become absolute paths, the Dockerfile checked (`check_dockerfile`)."""
    spec = _locate_dockerfile(spec, bases)
    if isinstance(spec.requirements, list):
        return spec.model_copy(update={"requirements": check_pins(spec.requirements, "in environment")})
    if spec.requirements is None and spec.pyproject is None:  # a Dockerfile alone
        return spec.model_copy(update={"requirements": []})
    kind = "pyproject" if spec.pyproject is not None else "requirements"
    path = locate(spec.pyproject or spec.requirements or "", bases)
    return spec.model_copy(update={"requirements": pins_of_file(path, kind), "pyproject": None})


def _locate_dockerfile(spec: EnvironmentSpec, bases: Sequence[Optional[Union[str, Path]]]) -> EnvironmentSpec:
    if spec.dockerfile is None:
        return spec
    path = locate(spec.dockerfile, bases).resolve()
    check_dockerfile(path)
    if spec.context is None:
        context = path.parent
    else:
        context = Path(spec.context).expanduser()
        if not context.is_absolute():
            context = next((Path(b) / context for b in bases if b and (Path(b) / context).is_dir()),
                           path.parent / context)
        context = context.resolve()
    if not context.is_dir():
        raise LaunchValidationError(f"environment context folder {str(context)!r} does not exist")
    return spec.model_copy(update={"dockerfile": str(path), "context": str(context)})


DOCKERFILE_INSTRUCTIONS = frozenset(
    "ADD ARG CMD COPY ENTRYPOINT ENV EXPOSE FROM HEALTHCHECK LABEL MAINTAINER ONBUILD RUN SHELL STOPSIGNAL USER "
    "VOLUME WORKDIR".split())


def check_dockerfile(path: Path) -> list[str]:
    """A Dockerfile's instructions, checked the way ``submit --dry-run`` can know it: the file exists, every
    instruction is one Docker knows and the first (after ARGs) is FROM. Returns the FROM images."""
    if not path.is_file():
        raise LaunchValidationError(f"environment dockerfile {str(path)!r} does not exist")
    lines, joined = [], ""
    for n, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        text = raw.strip()
        if not joined and (not text or text.startswith("#")):
            continue
        joined = (joined + " " + text.rstrip("\\").strip()) if joined else text.rstrip("\\").strip()
        if text.endswith("\\"):
            continue
        lines.append((n, joined))
        joined = ""
    froms: list[str] = []
    seen_from = False
    for n, line in lines:
        word = line.split(None, 1)[0].upper()
        if word not in DOCKERFILE_INSTRUCTIONS:
            raise LaunchValidationError(f"environment dockerfile {str(path)!r} line {n}: unknown instruction "
                                        f"{line.split(None, 1)[0]!r}")
        if word == "FROM":
            seen_from = True
            parts = line.split()
            refs = [p for p in parts[1:] if not p.startswith("--")]
            if not refs:
                raise LaunchValidationError(f"environment dockerfile {str(path)!r} line {n}: FROM names no image")
            froms.append(refs[0])
        elif not seen_from and word != "ARG":
            raise LaunchValidationError(f"environment dockerfile {str(path)!r} line {n}: the first instruction "
                                        f"must be FROM (or ARG), not {word}")
    if not froms:
        raise LaunchValidationError(f"environment dockerfile {str(path)!r} has no FROM instruction")
    return froms


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def check_python(spec: EnvironmentSpec, agent_python: Optional[str] = None) -> str:
    """The Python the environment is built for: the agent's (its Prefect is reused, so the minor must match)."""
    have = agent_python or python_version()
    want = (spec.python or have).strip()
    if want != have and not have.startswith(want + ".") and not want.startswith(have + "."):
        raise LaunchValidationError(f"environment asks for python {want}; this agent runs python {have} and job "
                                    "environments reuse the agent's Prefect, so they need its Python version "
                                    "(run the job on a queue whose agents run that version)")
    return have


@dataclass(frozen=True)
class Identity:
    """What the hash was computed over, kept beside the environment (``env ls`` shows it)."""

    pins: tuple[str, ...]
    python: str
    prefect: str
    find_links: tuple[str, ...]
    index_url: Optional[str]
    offline: bool

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "pins": list(self.pins), "python": self.python, "prefect": self.prefect,
                "find_links": list(self.find_links), "index_url": self.index_url, "offline": self.offline}

    @property
    def hash(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:HASH_CHARS]


def identity(spec: EnvironmentSpec, prefect_version: str, agent_python: Optional[str] = None) -> Identity:
    """The identity of an inlined spec (`inline` first: a file name has no content yet)."""
    if not isinstance(spec.requirements, list):
        raise ValueError("identity() needs inline pins: call inline(spec, bases) first")
    return Identity(pins=tuple(normalise_pins(spec.requirements)), python=check_python(spec, agent_python),
                    prefect=prefect_version, find_links=tuple(spec.links()), index_url=spec.index_url,
                    offline=spec.is_offline())


def env_hash(spec: EnvironmentSpec, prefect_version: str, agent_python: Optional[str] = None) -> str:
    return identity(spec, prefect_version, agent_python).hash


@dataclass(frozen=True)
class CachedEnv:
    """One complete environment of the cache, as `lru_victims` sees it."""

    hash: str
    size: int  # bytes
    last_used: float  # epoch seconds
    in_use: bool  # a live run uses it


def lru_victims(envs: Sequence[CachedEnv], max_bytes: Optional[int]) -> list[CachedEnv]:
    """The environments to remove so the cache fits ``max_bytes``: least recently used first, never one in use.

    None (no limit) removes nothing; when the environments in use alone exceed the limit, every unused one
    goes and the cache stays over it."""
    if max_bytes is None:
        return []
    total = sum(e.size for e in envs)
    out: list[CachedEnv] = []
    for env in sorted((e for e in envs if not e.in_use), key=lambda e: (e.last_used, e.hash)):
        if total <= max_bytes:
            break
        out.append(env)
        total -= env.size
    return out


def environment_for_submit(target: str, deployment_vars: Optional[dict[str, Any]], run_value: Any,
                           bases: Sequence[Optional[Union[str, Path]]]) -> Optional[dict[str, Any]]:
    """What ``submit`` sends as the run's ``environment``: the run's (else the deployment's) declaration with its
    file read into inline pins, so a missing or malformed file is refused before anything is enqueued and the
    agent needs no access to it. None when neither declares one."""
    where, value = ("in the submission", run_value) if run_value not in (None, {}, "") else \
        ("in the job's deployment", (deployment_vars or {}).get("environment"))
    spec = parse_environment(value, where)
    if spec is None:
        return None
    check_target(spec, target, where)
    return inline(spec, bases).model_dump(exclude_none=True)


def check_target(spec: EnvironmentSpec, target: str, where: str = "") -> None:
    """An image declaration (dockerfile, base_image) needs a container queue."""
    if target == "process" and (spec.dockerfile is not None or spec.base_image is not None):
        raise LaunchValidationError(f"environment {where}: dockerfile and base_image are for docker and kubernetes "
                                    "queues (an image per environment); a process queue builds a virtual "
                                    "environment from requirements alone")
