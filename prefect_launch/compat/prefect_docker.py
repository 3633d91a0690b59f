"""prefect-docker's private names that the docker back end (`workers/backends/docker.py`) relies on.

It overrides or calls these DockerWorker hooks, as a subclass of prefect-docker's worker: the container
settings it adds limits and labels to, the status events it emits for a warm-started container, the
client, the ``base_url:container`` id its inherited `kill_infrastructure` parses, and the container watch.
"""

from __future__ import annotations

from prefect_docker.worker import DockerWorker

from prefect_launch.compat import missing_members

DOCKER_WORKER_HOOKS = (
    "_build_container_settings", "_emit_container_status_change_event", "_get_client",
    "_get_infrastructure_pid", "_watch_container_safe",
)


def missing() -> list[str]:
    return [f"DockerWorker.{n}" for n in missing_members(DockerWorker, DOCKER_WORKER_HOOKS)]
