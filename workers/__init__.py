"""workers of prefect-launch: the launch worker types and what they share, by role.

- ``agent/``: intake, one run's life (``core``), stops, recovery, publishing, journal, limits, secrets.
- ``scheduling/``: resources, queue specs, resolution, the ledger, placement, dispatch, fair share, preemption.
- ``backends/``: ``process`` (``launch-process``), ``docker`` (``launch-docker``, with warm containers),
  the warm engines, and ``kubernetes/`` (``launch-kubernetes``, registered by its ``plugin`` where
  prefect-kubernetes is installed, entry point ``prefect_launch_kubernetes``).
- ``cluster/``: cluster runs (spec, env, placement, protocol, followers, lifecycle, each back end's members).
- ``metrics/``: sampler, summaries, NVML, RAPL, idle checks.

The process and docker workers are registered by importing ``prefect_launch`` (entry point
``prefect_launch``). This package imports nothing itself, so importing one worker module stays cheap.
A few old module paths (``warm_engine``, ``engine_zygote``, ``cluster_member``, ``kubernetes_member``,
``kubernetes_plugin``) remain as shims for one release.
"""
