"""blocks of prefect-launch."""
