"""deployments of prefect-launch."""
