"""The launch-kubernetes back end: the worker, its Job manifest, its pod events, its entry point.
"""
