"""workers of prefect-launch."""
