"""Streamlit's hashed assets answered from memory (dashboard/asset_cache.py), in front of Streamlit's own
static routes and middleware (its real static folder): what is kept, what always reaches Streamlit."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from starlette.applications import Starlette

from prefect_launch.dashboard import asset_cache, streamlit_hook


class Counted:
    """Counts the requests that reach Streamlit's app (an instrument around it, not a stand-in)."""

    def __init__(self, app):
        self.app, self.calls = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.calls.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@pytest.fixture()
def stack():
    from streamlit import file_util
    from streamlit.web.server.starlette.starlette_app import create_streamlit_middleware
    from streamlit.web.server.starlette.starlette_static_routes import create_streamlit_static_assets_routes

    inner = Counted(Starlette(routes=create_streamlit_static_assets_routes(None), middleware=create_streamlit_middleware()))
    js = sorted(os.listdir(os.path.join(file_util.get_static_dir(), "static", "js")))
    return inner, js


def _get(app, *requests):
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return [await c.request(method, path, headers=headers or {}) for method, path, headers in requests]

    return asyncio.run(run())


def test_a_hashed_asset_is_answered_once_by_streamlit_then_from_memory(stack):
    inner, js = stack
    cache = asset_cache.AssetCache(inner)
    path = f"/static/js/{js[0]}"
    first, second, third = _get(cache, ("GET", path, None), ("GET", path, None), ("GET", path, None))
    assert first.status_code == second.status_code == third.status_code == 200
    assert "immutable" in first.headers["cache-control"]
    assert second.content == first.content and len(first.content) == int(first.headers["content-length"]) > 0
    assert dict(second.headers) == dict(first.headers)  # the same type, length, cache headers
    assert inner.calls == [("GET", path)]  # Streamlit answered the first only
    assert cache.size == len(first.content) and len(cache.entries) == 1


def test_what_always_reaches_streamlit(stack):
    inner, js = stack
    cache = asset_cache.AssetCache(inner)
    path = f"/static/js/{js[1]}"
    ok, = _get(cache, ("GET", path, None))
    etag = ok.headers["etag"]
    got = _get(cache, ("GET", "/", None), ("GET", "/", None),  # index.html: no-cache, never kept
               ("GET", "/no/such/page", None), ("GET", "/no/such/page", None),  # the app's fallback page
               ("GET", path, {"Range": "bytes=0-9"}),  # a part: Streamlit answers it
               ("GET", path, {"If-None-Match": etag}),  # the browser's own copy: Streamlit's 304
               ("HEAD", path, None),
               ("GET", "/static/js/%2e%2e/%2e%2e/index.html", None),
               ("GET", "/static/js/%2e%2e/%2e%2e/index.html", None))
    assert [r.status_code for r in got[:4]] == [200, 200, 200, 200]
    assert "no-cache" in got[0].headers["cache-control"] and "no-cache" in got[2].headers["cache-control"]
    assert got[4].status_code == 206 and got[4].content == ok.content[:10]
    assert got[5].status_code == 304
    assert got[6].status_code == 200 and got[6].content == b""
    assert got[7].status_code == got[8].status_code == 400  # Streamlit's path check refuses a way out, each time
    assert len(inner.calls) == 1 + 9  # each of these went to Streamlit
    assert list(cache.entries) == ["\0" + path]  # only the asset itself is kept


def test_the_memory_it_keeps_is_bounded(stack):
    inner, js = stack
    cache = asset_cache.AssetCache(inner, max_bytes=10)
    path = f"/static/js/{js[0]}"
    a, b = _get(cache, ("GET", path, None), ("GET", path, None))
    assert a.status_code == b.status_code == 200 and a.content == b.content
    assert len(inner.calls) == 2 and cache.entries == {} and cache.size == 0


def test_kept_only_whole_immutable_answers():
    assert asset_cache.kept(200, [(b"Cache-Control", b"public, immutable, max-age=31536000")])
    assert not asset_cache.kept(200, [(b"cache-control", b"no-cache")])
    assert not asset_cache.kept(200, [])
    assert not asset_cache.kept(404, [(b"cache-control", b"public, immutable")])
    assert not asset_cache.kept(200, [(b"cache-control", b"immutable"), (b"content-range", b"bytes 0-9/100")])
    # an answer shaped by the request (compressed for a browser that accepts gzip) is not the path's one answer
    assert not asset_cache.kept(200, [(b"cache-control", b"immutable"), (b"content-encoding", b"gzip")])
    assert not asset_cache.kept(200, [(b"cache-control", b"immutable"), (b"Vary", b"Accept-Encoding")])


def test_the_size_it_counts_is_what_it_keeps(stack):
    """``size`` (kept as a running sum for the cap) equals the bodies held, after several assets and repeats."""
    inner, js = stack
    cache = asset_cache.AssetCache(inner, max_bytes=1 << 30)
    paths = [f"/static/js/{name}" for name in js[:6]]
    got = _get(cache, *[("GET", p, None) for p in paths + paths[:3]])
    assert all(r.status_code == 200 for r in got)
    assert len(cache.entries) == len(paths) and len(inner.calls) == len(paths)
    assert cache.size == sum(len(body) for *_, body in cache.entries.values()) == sum(len(r.content) for r in got[:6])


def test_a_gzipped_answer_is_never_replayed_to_another_browser(stack):
    """If Streamlit ever gzips a hashed asset, a browser that did not ask for gzip must not get those bytes."""
    inner, js = stack
    from starlette.middleware.gzip import GZipMiddleware

    cache = asset_cache.AssetCache(GZipMiddleware(inner, minimum_size=10))
    path = f"/static/js/{js[0]}"
    zipped, plain = _get(cache, ("GET", path, {"Accept-Encoding": "gzip"}), ("GET", path, {"Accept-Encoding": "identity"}))
    assert zipped.headers.get("content-encoding") == "gzip"
    assert "content-encoding" not in plain.headers and len(inner.calls) == 2 and cache.entries == {}


def test_installed_in_front_of_the_app_streamlit_serves():
    from streamlit.web.server.starlette import starlette_app
    from streamlit.web.server.starlette import starlette_server as server

    assert asset_cache.install() is True
    assert asset_cache.install() is True  # twice is harmless: one wrapper
    made = server.create_starlette_app
    assert "asset_cache" in streamlit_hook.hooks_of(made)
    assert made.__closure__[0].cell_contents is starlette_app.create_starlette_app
