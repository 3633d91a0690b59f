"""Environment variables whose values come from Prefect Secret blocks, resolved by the agent.

``prefect-launch submit JOB --secret-env WANDB_API_KEY=wandb-key`` stores only the
reference ``{"WANDB_API_KEY": "wandb-key"}`` (variable name -> Secret block name) in the
run's job variable ``secret_env``; the value never enters job variables, the run, its
logs, the metrics store or the monitor. The agent reads each Secret block when the run
starts (:func:`resolve_secret_env`) and adds the values to the run process's
environment only. A deployment may carry ``secret_env`` in its ``job_variables`` too
(prefect.yaml); a run's own references overlay it name by name.

Checks, the same at submit time (before anything is enqueued) and at run start:

- the variable name is a valid environment variable name, and not one the agent sets
  itself (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``, ``OMP_NUM_THREADS``, ``LAUNCH_*``, ``PREFECT__*``...);
- the block exists and is a Secret (``prefect.blocks.system.Secret``).

Errors name the variable and the block, never a value.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional, Union

from prefect_launch.workers.scheduling.resources import LaunchValidationError

JOB_VARIABLE = "secret_env"
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
BLOCK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")  # Prefect's block document names
SECRET_SLUG = "secret"
RESERVED_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                            "OPENBLAS_NUM_THREADS"})
RESERVED_PREFIXES = ("LAUNCH_", "PREFECT__")


class SecretEnvError(LaunchValidationError):
    """A secret env reference is malformed, or its block is missing or not a Secret."""


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not ENV_NAME_RE.match(name):
        raise SecretEnvError(
            f"invalid environment variable name {name!r} in --secret-env: use letters, digits and '_' "
            "and do not start with a digit"
        )
    if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
        raise SecretEnvError(
            f"--secret-env cannot set {name!r}: the agent sets it itself (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, *_NUM_THREADS, "
            "LAUNCH_*, PREFECT__*)"
        )
    return name


def _check_block(name: str, block: Any) -> str:
    if not isinstance(block, str) or not BLOCK_NAME_RE.match(block):
        raise SecretEnvError(
            f"bad Secret block name {block!r} for {name} in --secret-env: block names use lowercase letters, "
            "digits and '-'"
        )
    return block


def parse_secret_env(items: Union[list[str], Mapping[str, str], None],
                     plain_env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``NAME=block`` items (or a mapping) -> ``{NAME: block}``, checked; no server needed.

    plain_env: the run's ``--env`` values; a name given in both is an error.
    """
    pairs: list[tuple[Any, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for item in items or []:
            if not isinstance(item, str) or "=" not in item:
                raise SecretEnvError(f"bad --secret-env {item!r}: expected NAME=secret-block-name")
            name, block = item.split("=", 1)
            pairs.append((name, block))
    out: dict[str, str] = {}
    for name, block in pairs:
        _check_name(name)
        _check_block(name, block)
        if name in out:
            raise SecretEnvError(f"environment variable {name!r} is given twice in --secret-env; keep one")
        if plain_env and name in plain_env:
            raise SecretEnvError(f"environment variable {name!r} is given with both --env and --secret-env; keep one")
        out[name] = block
    return out


def _other_block_type(client: Any, block: str) -> Optional[str]:
    """The type of a non-Secret block document called ``block``, if there is one."""
    try:
        response = client.request("POST", "/block_documents/filter", json={
            "block_documents": {"name": {"any_": [block]}, "is_anonymous": {"eq_": False}},
            "include_secrets": False, "limit": 5,
        })
        response.raise_for_status()
        for doc in response.json():
            return (doc.get("block_type") or {}).get("name") or doc.get("block_type_name") or "another block type"
    except Exception:
        return None
    return None


def check_secret_blocks(client: Any, refs: Mapping[str, str]) -> None:
    """Refuse references whose block does not exist or is not a Secret (sync client; values not read)."""
    from prefect.exceptions import ObjectNotFound

    for name, block in refs.items():
        try:
            client.read_block_document_by_name(block, block_type_slug=SECRET_SLUG, include_secrets=False)
        except ObjectNotFound:
            other = _other_block_type(client, block)
            if other:
                raise SecretEnvError(
                    f"block {block!r} (for {name}) is a {other} block, not a Secret; create a Secret block: "
                    f"prefect block create secret, or Secret(value=...).save({block!r})"
                ) from None
            raise SecretEnvError(
                f"no Secret block named {block!r} (for {name}); create it first, e.g. "
                f"python -c \"from prefect.blocks.system import Secret; Secret(value='...').save('{block}')\""
            ) from None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)  # a JSON Secret (dict, list, number) reaches the job as JSON text


async def resolve_secret_env(job_variables: Optional[Mapping[str, Any]]) -> dict[str, str]:
    """The environment the references in ``job_variables["secret_env"]`` stand for (async).

    job_variables: the run's (merged) job variables, or any mapping with a ``secret_env`` key
        of the form ``{ENV_NAME: secret_block_name}``; other keys are ignored.
    Returns ``{ENV_NAME: secret value}`` to add to the run process's environment only.
    Raises SecretEnvError (naming the variable and block, never a value) when a reference is
    malformed or its block is gone or not a Secret. Uses the current Prefect client settings.
    """
    refs = parse_secret_env(dict((job_variables or {}).get(JOB_VARIABLE) or {}))
    if not refs:
        return {}
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    out: dict[str, str] = {}
    async with get_client() as client:
        for name, block in refs.items():
            try:
                secret = await Secret.aload(block, client=client)
            except (ObjectNotFound, ValueError):
                raise SecretEnvError(f"Secret block {block!r} for {name} no longer exists; the run cannot start "
                                     "without it (create it again and resubmit)") from None
            out[name] = _as_text(secret.get())
    return out


__all__ = ["JOB_VARIABLE", "SecretEnvError", "check_secret_blocks", "parse_secret_env", "resolve_secret_env"]
