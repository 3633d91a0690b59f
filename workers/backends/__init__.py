"""Where runs start: the process back end, docker (with warm containers), the pre-started (warm)
engines, and kubernetes. Each is a Prefect worker type over the shared agent core.
"""
