"""The few Kubernetes calls the launch-kubernetes worker makes, on a kubernetes_asyncio ApiClient."""

from __future__ import annotations

from typing import Any, Optional

DELETE_GRACE_S = 30


class KubeApi:
    """The few Kubernetes calls the worker makes, on a kubernetes_asyncio ApiClient; objects come back as the
    API's JSON dicts. Each call is one RBAC verb: jobs create/get/list/delete, pods list, events list,
    secrets get/create/update/delete, services create/delete (cluster runs)."""

    def __init__(self, api_client: Any):
        from kubernetes_asyncio.client import BatchV1Api, CoreV1Api

        self._client = api_client
        self.batch = BatchV1Api(api_client)
        self.core = CoreV1Api(api_client)

    def _json(self, obj: Any) -> Any:
        return self._client.sanitize_for_serialization(obj)

    async def read_job(self, namespace: str, name: str) -> Optional[dict[str, Any]]:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return self._json(await self.batch.read_namespaced_job(name=name, namespace=namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        pods = await self.core.list_namespaced_pod(namespace=namespace, label_selector=label_selector)
        return [self._json(p) for p in pods.items or []]

    async def list_events(self, namespace: str, names: list[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for name in names:
            events = await self.core.list_namespaced_event(namespace=namespace,
                                                           field_selector=f"involvedObject.name={name}")
            out += [self._json(e) for e in events.items or []]
        return out

    async def list_job_pod_events(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """Events of every pod the Job made (named ``<job>-<suffix>``), also of pods deleted before this
        worker ever listed them (a preempted pod can come and go between two polls)."""
        events = await self.core.list_namespaced_event(namespace=namespace, field_selector="involvedObject.kind=Pod")
        return [e for e in (self._json(e) for e in events.items or [])
                if str((e.get("involvedObject") or {}).get("name") or "").startswith(f"{job}-")]

    async def delete_job(self, namespace: str, name: str, grace_seconds: int = DELETE_GRACE_S) -> bool:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await self.batch.delete_namespaced_job(name=name, namespace=namespace, grace_period_seconds=grace_seconds,
                                                   propagation_policy="Foreground")
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def create_service(self, namespace: str, body: dict[str, Any]) -> None:
        await self.core.create_namespaced_service(namespace=namespace, body=body)

    async def delete_service(self, namespace: str, name: str) -> bool:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await self.core.delete_namespaced_service(name=name, namespace=namespace)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def upsert_secret(self, namespace: str, name: str, string_data: dict[str, str],
                            secret_type: str = "Opaque", labels: Optional[dict[str, str]] = None) -> None:
        from kubernetes_asyncio.client import V1ObjectMeta, V1Secret
        from kubernetes_asyncio.client.exceptions import ApiException

        body = V1Secret(api_version="v1", kind="Secret", type=secret_type, string_data=string_data,
                        metadata=V1ObjectMeta(name=name, namespace=namespace,
                                              labels={"app.kubernetes.io/managed-by": "prefect-launch",
                                                      **(labels or {})}))
        try:
            await self.core.read_namespaced_secret(name=name, namespace=namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self.core.create_namespaced_secret(namespace=namespace, body=body)
            return
        await self.core.replace_namespaced_secret(name=name, namespace=namespace, body=body)

    async def delete_secret(self, namespace: str, name: str) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await self.core.delete_namespaced_secret(name=name, namespace=namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
