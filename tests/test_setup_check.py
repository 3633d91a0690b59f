"""`prefect-launch setup --check` fails clearly where the Prefect server's automations do not act on events.

The failing case is real: a Prefect server of this module's own, started with its reactive-triggers
service off (PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false: what a server whose service failed to start
looks like from outside - the API answers, events are stored, no automation fires). The passing case runs
in tests/test_hosts_e2e.py. The message itself is checked purely, without a server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launch_helpers import cli, restored_env
from prefect_launch.deployments.automations_probe import PROBE_NAME, not_answering_why
from prefect_launch.local_server import local_prefect_server

PROBE_SECONDS = "8"  # the probe's wait here: a healthy server answers a first probe in about 6 s (the default is 30)


# ------------------------------------------------------------------------------------------------ pure
def test_not_answering_message_names_the_cause_and_the_next_step():
    why = not_answering_why(4)
    assert why.startswith("the Prefect server's automations do not act on events")
    assert f"'{PROBE_NAME}' automation in 4 s" in why
    assert "reactive-triggers service is not running" in why
    assert "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false" in why
    assert "Restart the Prefect server" in why and "`prefect-launch setup --check` again" in why
    assert "never be marked Crashed" in why  # what the user loses while it stays so
    assert "in 30 s" in not_answering_why(30.0) and "in 2.5 s" in not_answering_why(2.5)


def test_check_seconds_below_one_is_a_usage_error():
    """Refused while the command line is parsed: no server is asked."""
    proc = cli("setup", "--check", "--check-seconds", "0", check=False)
    assert proc.returncode == 2
    assert "--check-seconds" in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------- a server without triggers
@pytest.fixture(scope="module")
def server_without_triggers(tmp_path_factory) -> str:
    """A `prefect server start` whose reactive-triggers service is off; the session's settings come back after."""
    home: Path = tmp_path_factory.mktemp("no-triggers-home")
    with restored_env("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_API_AUTH_STRING",
                      "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "LAUNCH_METRICS_BLOCK"):
        os.environ.pop("PREFECT_API_AUTH_STRING", None)
        os.environ.pop("LAUNCH_METRICS_BLOCK", None)
        os.environ["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"] = "false"  # read by the server (server_env copies it)
        with local_prefect_server(home) as api_url:
            yield api_url


@pytest.mark.server
def test_setup_check_fails_json_says_not_answering(server_without_triggers: str):
    proc = cli("setup", "--check", "--check-seconds", PROBE_SECONDS, "--json", check=False)
    assert proc.returncode != 0, proc.stdout
    out = json.loads(proc.stdout)  # what was registered is still printed, then the error
    assert out["automations"]["answering"] is False
    assert out["automations"]["seconds"] >= float(PROBE_SECONDS)
    assert "reactive-triggers service is not running" in out["automations"]["why"]
    assert out["zombie_automation"]["name"]  # the zombie automation is registered even so (it waits for them)
    assert "error:" in proc.stderr and "automations do not act on events" in proc.stderr


@pytest.mark.server
def test_setup_check_fails_plain_names_cause_and_next_step(server_without_triggers: str):
    proc = cli("setup", "--check", "--check-seconds", PROBE_SECONDS, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "metrics store block" in proc.stdout  # the part that worked is reported
    assert "acting on events" not in proc.stdout
    err = " ".join(proc.stderr.split())  # however the console wrapped it
    assert err.startswith("error: the Prefect server's automations do not act on events"), err
    assert f"in {PROBE_SECONDS} s" in err
    assert "reactive-triggers service is not running" in err
    assert "Restart the Prefect server" in err and "`prefect-launch setup --check` again" in err
