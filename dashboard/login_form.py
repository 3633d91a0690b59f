"""The monitor's sign-in as one of the gateway's users (Streamlit widgets; the decisions are :mod:`.monitor_login`).

Both pages call :func:`users_gate` where they used to ask for the monitor's password, when
:func:`.monitor_login.current_mode` is ``users``; the signed-in user is kept in the browser session
(``st.session_state``), so the queue monitor and the Sessions page share it.
"""

from __future__ import annotations

import html
from typing import Any, Optional

import streamlit as st

from prefect_launch.dashboard import monitor_login as L

SIGNED = "monitor_user"  # session_state: the SignedIn user


def signed_in() -> Optional[L.SignedIn]:
    value = st.session_state.get(SIGNED)
    return value if isinstance(value, L.SignedIn) else None


def mode_or_error(where: Any = st) -> Optional[L.Mode]:
    """The login mode; None (and the reason shown) when ``LAUNCH_DASHBOARD_LOGIN`` is not a mode."""
    try:
        return L.current_mode()
    except ValueError as exc:
        where.error(f"Sign-in unavailable: {html.escape(str(exc), quote=False)}")
        return None


def _address() -> str:
    try:
        return st.context.ip_address or "this browser"
    except Exception:
        return "this browser"


def users_gate(where: Any, form_key: str, what: str) -> bool:
    """True when someone is signed in; else a user name + key form in ``where`` (the sidebar, a panel)."""
    signed = signed_in()
    if signed is not None:
        where.caption(f"Signed in as **{html.escape(signed.name, quote=False)}** ({signed.role}): {what} go to Prefect as "
                      f"{html.escape(signed.name, quote=False)}, through the gateway.")
        if where.button("Sign out", key=f"{form_key}_out"):
            st.session_state.pop(SIGNED, None)
            st.rerun()
        return True
    with where.form(form_key):
        st.caption(f"{what.capitalize()} need you to sign in with your user name and API key.")
        name = st.text_input("User name", key=f"{form_key}_user")
        key = st.text_input("API key", type="password", key=f"{form_key}_key")
        go = st.form_submit_button("Sign in")
    if go:
        user, why = L.sign_in(name, key, _address(), L.verify_in_store, L.LIMITER)
        if user is not None:
            st.session_state[SIGNED] = user
            st.session_state.pop(f"{form_key}_key", None)  # the key lives on in SignedIn only
            st.rerun()
        where.error(why)
    return False
