"""The agent's side of run keys (pure, no gateway): whether it talks to a gateway, what a zygote's environment
keeps, and what a run start says when the gateway gives no key. The whole path: test_gateway_e2e.py."""

from __future__ import annotations

import asyncio

import pytest
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

from prefect_launch.workers.agent import run_keys as RK
from prefect_launch.local_server import free_port

AGENT_KEY = "plk_0123456789ab_" + "s" * 43


def test_without_a_gateway_nothing_changes():
    env = {"PREFECT_API_AUTH_STRING": "admin:pass", "PATH": "/bin"}
    with temporary_settings(updates={PREFECT_API_AUTH_STRING: "admin:pass"}):
        assert not RK.behind_gateway() and RK.without_agent_key(env) == env
        assert RK.agent_credentials()[1:] == (None, None)


@pytest.mark.parametrize("setting, value", [(PREFECT_API_AUTH_STRING, f"box-1:{AGENT_KEY}"),
                                            (PREFECT_API_KEY, AGENT_KEY)])
def test_behind_a_gateway_early_processes_get_no_agent_key(setting, value):
    env = {"PREFECT_API_AUTH_STRING": value, "PREFECT_API_KEY": value, "PATH": "/bin"}
    with temporary_settings(updates={setting: value}):
        assert RK.behind_gateway()
        assert RK.without_agent_key(env) == {"PATH": "/bin"}


def test_a_run_gets_no_key_when_the_gateway_cannot_be_reached(monkeypatch):
    """The run does not start with the agent's key instead: the start fails, saying where it asked."""
    monkeypatch.setattr(RK, "RETRY_DELAYS_S", ())
    monkeypatch.setattr(RK, "REVOKE_DELAYS_S", ())
    url = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: f"box-1:{AGENT_KEY}"}):
        with pytest.raises(RK.RunKeyError, match=rf"could not obtain a key for run r1 at the gateway \({url}\)"):
            asyncio.run(RK.run_key_env("r1"))
        asyncio.run(RK.revoke_run_keys("r1"))  # logged, not raised: the gateway ends the key itself later
    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: "admin:pass"}):
        assert asyncio.run(RK.run_key_env("r1")) == {}  # no gateway: no call at all
