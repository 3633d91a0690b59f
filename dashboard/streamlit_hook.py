"""Wrap one function of Streamlit's server once, where this Streamlit has it.

The monitor changes two things about how Streamlit's Starlette server serves (the sockets it
binds, the app it makes); both wrap a module attribute the same way, so the way lives here: a
Streamlit without that module or attribute is left as it is, and wrapping again is harmless.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

_MARK = "prefect_launch_hooks"  # on a wrapper: the names of the hooks already around it


def wrap(module: str, name: str, hook: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Set ``module.name`` to ``make(module.name)``, unless the hook named ``hook`` is already there.
    Returns whether the hook is in place (False where ``module`` or its ``name`` does not exist:
    nothing changes)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    current = getattr(mod, name, None)
    if current is None:
        return False
    hooks = getattr(current, _MARK, frozenset())
    if hook in hooks:
        return True
    wrapper = make(current)
    setattr(wrapper, _MARK, hooks | {hook})
    setattr(mod, name, wrapper)
    return True


def hooks_of(fn: Callable[..., Any]) -> frozenset:
    """The hooks wrapped around ``fn`` by :func:`wrap` (empty for an unwrapped function)."""
    return getattr(fn, _MARK, frozenset())
