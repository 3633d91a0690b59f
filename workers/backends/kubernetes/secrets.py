"""A Kubernetes run's Secrets: its ``secret_env`` values in a per-run Secret (deleted when the run ends; the
manifest only names it), and image pull Secrets made from Prefect Secret blocks."""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any, Optional

import anyio

from prefect_launch.compat.prefect_kubernetes import slugify_name
from prefect_launch.workers.agent.tags import RUN_ID_LABEL

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.backends.kubernetes.api import KubeApi

PULL_SECRET_PREFIX = "prefect-launch-pull-"
ENV_SECRET_PREFIX = "prefect-launch-env-"


def docker_config_json(value: Any, block: str = "") -> str:
    """A Secret block's value as a ``.dockerconfigjson``.

    Accepted values: a docker config (``{"auths": {...}}``, as ``docker login``
    writes it), or ``{"registry", "username", "password"}``; either may be JSON text.
    """
    where = f"Secret block {block!r}" if block else "the pull secret"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where} is not JSON: store a docker config ({{\"auths\": ...}}) or "
                             "{\"registry\", \"username\", \"password\"}") from None
    if isinstance(value, dict) and isinstance(value.get("auths"), dict):
        return json.dumps(value)
    if isinstance(value, dict) and {"registry", "username", "password"} <= set(value):
        auth = base64.b64encode(f"{value['username']}:{value['password']}".encode()).decode()
        entry = {"username": value["username"], "password": value["password"], "auth": auth}
        return json.dumps({"auths": {value["registry"]: entry}})
    raise ValueError(f"{where} must hold a docker config ({{\"auths\": ...}}) or "
                     "{\"registry\", \"username\", \"password\"}")


def pull_secret_name(block: str) -> str:
    return PULL_SECRET_PREFIX + (slugify_name(block, max_length=40) or "block").lower()


class RunSecrets:
    """The Secrets of the runs of one Kubernetes worker (``w``)."""

    def __init__(self, worker: Any):
        self.w = worker

    async def env_secret(self, api: KubeApi, namespace: str, flow_run: "FlowRun",
                          refs: Optional[dict[str, str]]) -> Optional[tuple[str, list[str]]]:
        """``secret_env`` values and, behind a gateway, the run's own key (in place of the agent's) in a per-run
        Secret (deleted when the run ends); the manifest only names it."""
        from prefect_launch.workers.agent.run_keys import run_key_env
        from prefect_launch.workers.agent.secrets import resolve_secret_env

        values = await resolve_secret_env({"secret_env": refs}) if refs else {}
        values.update(await run_key_env(flow_run.id))
        if not values:
            return None
        name = ENV_SECRET_PREFIX + str(flow_run.id)
        await api.upsert_secret(namespace, name, values, labels={RUN_ID_LABEL: str(flow_run.id)})
        return name, sorted(values)

    async def forget(self, api: KubeApi, namespace: str, name: str) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await api.delete_secret(namespace, name)
            except Exception as exc:
                self.w._logger.warning("could not delete the run's env Secret %s/%s: %s", namespace, name, exc)

    async def pull_secret(self, api: KubeApi, namespace: str, block: str) -> str:
        """The Secret block's registry credentials as a dockerconfigjson Secret in the job's namespace."""
        from prefect.blocks.system import Secret

        value = (await Secret.aload(block, client=self.w.client)).get()
        name = pull_secret_name(block)
        await api.upsert_secret(namespace, name, {".dockerconfigjson": docker_config_json(value, block)},
                                secret_type="kubernetes.io/dockerconfigjson")
        return name
