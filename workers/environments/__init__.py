"""Job environments (issue 39): a job's declared requirements turned into a cached virtual environment.

`spec` is pure (the declaration, its pins and its content hash, the cache's LRU choice); `builder` builds
and caches the environments with uv under the agent's state directory.
"""
