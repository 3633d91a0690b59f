"""dashboard of prefect-launch."""
