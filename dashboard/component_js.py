"""What the monitor's components (``st.components.v2``) are mounted with: their script
(``component_base.js``'s helpers, then the component's own file: each script is mounted as its own
module, so the helpers travel with each rather than being imported) and their payload as bytes
(:func:`packed`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_HERE = Path(__file__).parent

# the look of component_base.js's helpIcon (the "?" beside a figure's or a choice's label), added to the CSS
# of each component that draws one
HELP_CSS = """
.pl-help { display: inline-flex; align-items: center; justify-content: center; width: 14px; height: 14px;
           border: 1px solid #808495; border-radius: 50%; color: #808495; font-size: 10px; cursor: help; }
"""


def packed(payload: dict) -> bytes:
    """``payload`` as the bytes a component gets: JSON whose first key is ``sig``, a digest of the rest.

    Streamlit forwards bytes as they are, where a dict is JSON-encoded on every mount, and encoded and
    digested once more for the element's identity (about 60 ms a visit for the lanes and the runs table
    at 100k runs, holding the GIL). The script reads ``sig`` from the first bytes (``sigOf`` in
    component_base.js) and parses the rest only for a payload it has not drawn (a rerun sending the same
    one keeps the drawn chart or table: its brush, sort and scroll)."""
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    sig = hashlib.blake2b(body.encode(), digest_size=12).hexdigest()
    return ('{"sig":"' + sig + '"' + ("," + body[1:] if body != "{}" else "}")).encode()


def script(name: str) -> str:
    """``component_base.js`` followed by ``name`` (a file beside this module)."""
    return (_HERE / "component_base.js").read_text() + "\n" + (_HERE / name).read_text()
