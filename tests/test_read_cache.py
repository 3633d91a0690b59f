"""The agent's short cache of deployment and flow reads (workers/agent/read_cache.py): pure, no server."""

import asyncio

import pytest

from prefect_launch.workers.agent.read_cache import ReadCache, cache_reads


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_read_is_kept_for_its_ttl_then_read_again():
    clock, calls = Clock(), []

    async def read():
        calls.append(clock.t)
        return {"n": len(calls)}

    cache = ReadCache(10, clock=clock)
    first = asyncio.run(cache.get("read_deployment", "d1", read))
    clock.t += 9.9
    again = asyncio.run(cache.get("read_deployment", "d1", read))
    assert again == first and again is not first  # kept, and a copy of its own
    clock.t += 0.2
    assert asyncio.run(cache.get("read_deployment", "d1", read)) == {"n": 2}
    assert (cache.hits, cache.misses) == (1, 2)
    asyncio.run(cache.get("read_flow", "d1", read))  # another kind of object under the same id
    assert len(calls) == 3


def test_a_failed_read_is_not_kept():
    calls = []

    async def gone():
        calls.append(1)
        raise LookupError("deployment d1 not found")

    cache = ReadCache(10)
    for _ in range(2):
        with pytest.raises(LookupError):
            asyncio.run(cache.get("read_deployment", "d1", gone))
    assert len(calls) == 2  # a deleted deployment is noticed on every read, never served from the cache


class Client:
    def __init__(self):
        self.reads = []

    async def read_deployment(self, deployment_id, *args, **kwargs):
        self.reads.append(("deployment", deployment_id, args, kwargs))
        return f"dep-{deployment_id}"

    async def read_flow(self, flow_id):
        self.reads.append(("flow", flow_id, (), {}))
        return f"flow-{flow_id}"


def test_cache_reads_wraps_the_client_once_and_passes_other_calls_through():
    client = Client()
    cache = cache_reads(client, ttl_s=60)
    assert cache_reads(client) is cache  # installing twice does not stack wrappers

    async def go():
        return [await client.read_deployment("a"), await client.read_deployment("a"), await client.read_flow("f"),
                await client.read_flow("f"), await client.read_deployment("a", "extra")]

    assert asyncio.run(go()) == ["dep-a", "dep-a", "flow-f", "flow-f", "dep-a"]
    assert [r[:2] for r in client.reads] == [("deployment", "a"), ("flow", "f"), ("deployment", "a")]
    assert client.reads[-1][2] == ("extra",)  # a read with more arguments than the id goes to the server


def test_a_reader_that_changes_what_it_got_does_not_change_the_next_readers_copy():
    """Prefect's resolve_for_flow_run merges a run's env into the deployment's job variables in place."""
    from types import SimpleNamespace

    async def read():
        return SimpleNamespace(job_variables={"env": {"A": "1"}})

    cache = ReadCache(10)
    first = asyncio.run(cache.get("read_deployment", "d1", read))
    first.job_variables["env"].update({"RUN_ONLY": "x"})
    second = asyncio.run(cache.get("read_deployment", "d1", read))
    second.job_variables["env"].update({"OTHER_RUN": "y"})
    third = asyncio.run(cache.get("read_deployment", "d1", read))
    assert third.job_variables == {"env": {"A": "1"}} and cache.misses == 1
