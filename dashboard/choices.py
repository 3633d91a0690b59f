"""Groups of choices (the sidebar's queues, time range, grouping and filters) as one Streamlit component
(``st.components.v2``: in the page, no iframe): each option a toggle button, every label set as text.

Streamlit's pills draw each option of each choice through its markdown pipeline, in a control with a
script chunk of its own; the sidebar held some forty options. ``choices.js`` draws the same buttons as
plain elements. The choice itself is kept in the session (``<key>__kept``): the component only says what
its groups hold after a click (state ``picked``, with a nonce so that each click is applied once), so the
choice outlives the component (a list that grows past :data:`PILLS_MAX` becomes a multiselect
with the same choice).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import streamlit as st
from pydantic import BaseModel, Field

from prefect_launch.dashboard import text_block as TB
from prefect_launch.dashboard.component_js import HELP_CSS, packed, script

COMPONENT = "prefect_launch.choices"
PILLS_MAX = 8  # a choice among at most this many is drawn as buttons; among more, as a multiselect
CSS = """
.ch-box { font-family: "Source Sans", "Source Sans Pro", sans-serif; color: #31333f; display: flex; flex-direction: column; gap: 1rem; }
.ch-heading { font-size: 1.25rem; font-weight: 600; line-height: 1.2; margin: 0 0 0.5rem 0; padding: 0.5rem 0 0 0; }
.ch-label { font-size: 14px; display: flex; align-items: center; gap: 6px; margin-bottom: 0.25rem; }
.ch-row { display: flex; flex-wrap: wrap; gap: 0.5rem; }
.ch-pill { font: inherit; font-size: 14px; line-height: 1.6; padding: 0.15rem 0.75rem; border-radius: 1rem; cursor: pointer;
           border: 1px solid rgba(49, 51, 63, 0.2); background: #fff; color: #31333f; }
.ch-pill:hover { border-color: #ff4b4b; color: #ff4b4b; }
.ch-pill:focus-visible { outline: 2px solid #ff4b4b; outline-offset: 1px; }
.ch-pill[aria-pressed="true"] { border-color: #ff4b4b; background: rgba(255, 75, 75, 0.1); color: #ff4b4b; }
"""

_mount = st.components.v2.component(COMPONENT, js=script("choices.js"), css=CSS + HELP_CSS, isolate_styles=False)


class Group(BaseModel):
    """One choice as drawn: its key (the choice is kept in ``st.session_state[f"{key}__kept"]``), label,
    options (as sent back) and how each is shown, whether several may be chosen, and the chosen ones."""

    key: str
    label: str
    options: list[str]
    shown: list[str]
    multi: bool = True
    help: Optional[str] = None
    heading: Optional[str] = None  # a heading drawn above the group (the sidebar's "Filters")
    hide_label: bool = False  # the label for assistive technology only (the page's section switch)
    selected: list[str] = Field(default_factory=list)


class ChoicesPayload(BaseModel):
    groups: list[Group]


def kept(key: str) -> Optional[list]:
    """The choice kept for ``key`` (None: nothing chosen yet in this session)."""
    return st.session_state.get(f"{key}__kept")


def keep(key: str, values: Sequence[Any]) -> list:
    """Keep ``values`` as the choice for ``key``; returns them as a list."""
    st.session_state[f"{key}__kept"] = list(values)
    return list(values)


def applied(state: Any, last_nonce: Optional[str]) -> Optional[tuple[dict[str, list[str]], str]]:
    """({key: chosen options}, nonce) of the click message in a component's ``state`` not yet applied (its
    nonce is not ``last_nonce``), else None. The message holds every group of its component, as drawn
    after the click."""
    picked = state.get("picked") if hasattr(state, "get") else None
    if not isinstance(picked, dict) or picked.get("nonce") in (None, last_nonce) or not isinstance(picked.get("values"), dict):
        return None
    values = {str(k): [str(x) for x in v] if isinstance(v, list) else [] for k, v in picked["values"].items()}
    return values, str(picked["nonce"])


def take_clicks(instance: str) -> None:
    """Apply the click message the browser sent for the component mounted under ``instance`` (once) to the
    kept choices: read before the component is drawn, so the page reads the choices clicked."""
    seen = f"{instance}__nonce"
    got = applied(st.session_state.get(instance), st.session_state.get(seen))
    if got is not None:
        values, nonce = got
        st.session_state[seen] = nonce
        for key, chosen in values.items():
            keep(key, chosen)


def draw(groups: Sequence[Group], instance: str, where=None) -> None:
    """Draw ``groups`` as one component under ``instance`` (in ``where``, e.g. ``st.sidebar``)."""
    with where if where is not None else contextlib.nullcontext():
        _mount(key=instance, data=packed(ChoicesPayload(groups=list(groups)).model_dump()), default={"picked": None},
               on_picked_change=lambda: None)


class Column:
    """Where choices go, in order (``where``: a container such as ``st.sidebar``; None: where the script draws
    now): consecutive groups of buttons are drawn as one component (one element instead of a control per
    choice), which another kind of control (a multiselect, the date picker) ends."""

    def __init__(self, where=None) -> None:
        self.where = where
        self.run: list[Group] = []

    def add(self, group: Group, choose: Callable[[list], list]) -> list:
        """Add ``group`` to the run; its selection is ``choose(the kept choice)``, read after the clicks sent by
        the component this run will be drawn as are applied (the first group of a run applies them). The
        selection is kept and returned."""
        if not self.run:
            take_clicks(f"choices_{group.key}")
        group.selected = keep(group.key, choose(kept(group.key) or []))
        self.run.append(group)
        return group.selected

    def flush(self) -> None:
        if self.run:
            draw(self.run, f"choices_{self.run[0].key}", self.where)
            self.run = []


def pick(col: Column, label: str, options: Sequence[str], key: str, placeholder: str, heading: Optional[str] = None) -> list:
    """Several of ``options`` (none chosen: all). While they are few, buttons: each visible, one click
    (bench/results/sidebar_pills_ab.txt: the sidebar's choices as Streamlit's pills drew 0.19 s sooner than as
    multiselects, a radio, a selectbox and an expander; as these buttons, 0.09 s sooner than as pills:
    bench/results/sidebar_choices_ab.txt); a multiselect beyond :data:`PILLS_MAX`, where buttons would fill the
    sidebar. The choice is kept in the session, so it stays when the options grow past the limit or shrink back."""
    options = [str(o) for o in options]
    if len(options) <= PILLS_MAX:
        group = Group(key=key, label=label, options=options, shown=options, help=f"None chosen: {placeholder}.",
                      heading=heading)
        return col.add(group, lambda was: [v for v in was if v in options])  # an option gone is dropped
    col.flush()
    was = [v for v in (kept(key) or []) if v in options]
    if heading:
        TB.text(f"{key}_heading", heading, where=col.where)
    target = col.where if col.where is not None else st
    got = target.multiselect(label, options, default=was, key=key, placeholder=placeholder)
    return keep(key, got or [])


def single(col: Column, label: str, options: Sequence, key: str, default, shown: Callable = str,
           heading: Optional[str] = None, hide_label: bool = False):
    """One of ``options`` (always one: ``default`` until another is clicked)."""
    values = [str(o) for o in options]
    group = Group(key=key, label=label, options=values, shown=[shown(o) for o in options], multi=False,
                  heading=heading, hide_label=hide_label)
    cur = col.add(group, lambda was: was[:1] if was and was[0] in values else [str(default)])[0]
    return options[values.index(cur)]


def toggle(col: Column, label: str, key: str) -> bool:
    """An on/off button reading ``label`` (pressed: on), off until clicked."""
    group = Group(key=key, label=label, options=[label], shown=[label], hide_label=True)
    return bool(col.add(group, lambda was: [label] if label in was else []))
