"""One way to wrap a function of Streamlit's server (dashboard/streamlit_hook.py): once per hook,
several hooks on one function, and nothing changed where the module or function is missing."""

from __future__ import annotations

import sys
import types

import pytest

from prefect_launch.dashboard import streamlit_hook


@pytest.fixture()
def module():
    mod = types.ModuleType("hook_target_for_tests")
    mod.serve = lambda x: [x]
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _around(tag):
    def make(fn):
        return lambda x: fn(x) + [tag]

    return make


def test_a_hook_wraps_once_and_hooks_stack(module):
    assert streamlit_hook.wrap(module.__name__, "serve", "a", _around("a")) is True
    assert streamlit_hook.wrap(module.__name__, "serve", "a", _around("a")) is True  # again: still one wrapper
    assert module.serve(1) == [1, "a"]
    assert streamlit_hook.wrap(module.__name__, "serve", "b", _around("b")) is True  # another hook goes around it
    assert module.serve(1) == [1, "a", "b"]
    assert streamlit_hook.hooks_of(module.serve) == {"a", "b"}


def test_nothing_changes_where_the_target_is_missing(module):
    before = module.serve
    assert streamlit_hook.wrap("no_such_module_here", "serve", "a", _around("a")) is False
    assert streamlit_hook.wrap(module.__name__, "missing", "a", _around("a")) is False
    assert module.serve is before and not hasattr(module, "missing") and streamlit_hook.hooks_of(before) == frozenset()
