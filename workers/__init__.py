"""workers of prefect-launch: the launch worker types and what they share.

Back ends (each a Prefect worker type): `worker.LaunchProcessWorker` (``launch-process``),
`docker_worker.LaunchDockerWorker` (``launch-docker``), both registered by importing
``prefect_launch`` (entry point ``prefect_launch``), and
`kubernetes_worker.LaunchKubernetesWorker` (``launch-kubernetes``), registered by
`kubernetes_plugin` (entry point ``prefect_launch_kubernetes``) where prefect-kubernetes is
installed. This package imports nothing itself, so importing one worker module stays cheap.
"""
