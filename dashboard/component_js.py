"""The script of one of the monitor's components (``st.components.v2``): ``component_base.js``'s
helpers, then the component's own file. Each script is mounted as its own module, so the helpers
travel with each rather than being imported."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent


def script(name: str) -> str:
    """``component_base.js`` followed by ``name`` (a file beside this module)."""
    return (_HERE / "component_base.js").read_text() + "\n" + (_HERE / name).read_text()
