"""Warm containers' pure parts: what fixes a container's shape, the hand-over's update body and order file."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from prefect_launch.workers.scheduling.queue_spec import QueueSpec
from prefect_launch.workers.backends.warm_containers import (ORDER_DONE_PATH, ORDER_PATH, WARM_LABEL, order_archive, shape_key,
                                                    shape_of, update_args, warm_settings)

SETTINGS = {"image": "img:1", "network_mode": "host", "volumes": ["/a:/a:ro"], "shm_size": "67108864",
            "environment": {"PREFECT__FLOW_RUN_ID": "r1", "SECRET": "s"}, "labels": {"x": "1"}, "name": "run-a",
            "command": "python -c ...", "nano_cpus": 500000000, "cpuset_cpus": "1", "mem_limit": "268435456",
            "memswap_limit": "268435456", "auto_remove": False, "privileged": False, "extra_hosts": None}


def test_shape_keeps_what_docker_fixes_at_creation_and_drops_the_runs_own_fields():
    shape = shape_of(SETTINGS, command_configured=False)
    assert shape == {"image": "img:1", "network_mode": "host", "volumes": ["/a:/a:ro"], "shm_size": "67108864",
                     "privileged": False}
    other_run = {**SETTINGS, "environment": {"PREFECT__FLOW_RUN_ID": "r2"}, "name": "run-b", "cpuset_cpus": "0",
                 "nano_cpus": 10**9, "mem_limit": "1073741824"}
    assert shape_key(shape_of(other_run, False)) == shape_key(shape)  # same shape: the same warm container fits
    for changed in ({"shm_size": "134217728"}, {"image": "img:2"}, {"volumes": []}):
        assert shape_key(shape_of({**SETTINGS, **changed}, False)) != shape_key(shape)


def test_a_custom_command_or_sent_gpus_start_cold():
    assert shape_of(SETTINGS, command_configured=True) is None
    assert shape_of({**SETTINGS, "device_requests": [object()]}, False) is None
    assert shape_of({**SETTINGS, "rendered_device_requests": [{"DeviceIDs": ["0"]}]}, False) is not None


def test_update_args_set_cpus_cores_and_memory_without_extra_swap():
    # 0.5 CPU: a 50 ms quota per 100 ms period, what `--cpus 0.5` (NanoCpus 5e8) means
    assert update_args(SETTINGS) == {"cpu_period": 100_000, "cpu_quota": 50_000, "cpuset_cpus": "1",
                                     "mem_limit": 256 << 20, "memswap_limit": 256 << 20}
    assert update_args({"mem_limit": "512Mi"}) == {"mem_limit": 512 << 20, "memswap_limit": 512 << 20}
    assert update_args({}) == {}


def test_warm_settings_carry_no_run_env_and_name_the_agent():
    ws = warm_settings(shape_of(SETTINGS, False), "agent-a", "q", {"io.prefect-launch.agent": "agent-a"})
    assert ws["environment"] == {"LAUNCH_WARM_ORDER": ORDER_PATH, "LAUNCH_WARM_ORDER_DONE": ORDER_DONE_PATH,
                                 "LAUNCH_WARM_APPS": "0"}
    assert ws["labels"][WARM_LABEL] == "agent-a" and ws["name"].startswith("launch-warm-")
    assert ws["command"][-1] == "prefect_launch.workers.backends.warm_engine" and "nano_cpus" not in ws


def test_order_archive_is_a_private_order_then_its_done_marker_owned_by_the_engines_user():
    data = order_archive({"A": "1", "B": None}, uid=1000, gid=100)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        order_member, done_member = tf.getmembers()  # Docker extracts them in this order
        assert order_member.name == ORDER_PATH.rsplit("/", 1)[1] and done_member.name == ORDER_DONE_PATH.rsplit("/", 1)[1]
        for m in (order_member, done_member):
            assert (m.uid, m.gid, m.mode) == (1000, 100, 0o600)
        assert done_member.size == 0
        order = json.loads(tf.extractfile(order_member).read())
    assert order == {"env": {"A": "1"}, "replace_env": False, "cwd": None}


def test_the_engine_reads_the_order_only_once_its_done_marker_exists(tmp_path, capsys):
    """The order is left alone while Docker may still be setting its owner (no marker yet): removing it
    then failed the upload ("lchown ...: no such file or directory", seen with three test workers). Once the
    marker exists the order is read and removed; the marker stays."""
    import threading
    import time

    from prefect_launch.workers.backends.warm_engine import _wait_for_order

    order, done = tmp_path / "order.json", tmp_path / "order.json.done"
    order.write_text(json.dumps({"env": {"A": "1"}}))
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_wait_for_order(str(order), str(done), poll_s=0.01)))
    reader.start()
    time.sleep(0.3)  # 30 polls: a whole, parseable order without its marker
    assert not got and order.exists()
    done.write_bytes(b"")
    reader.join(10)
    assert got == [{"env": {"A": "1"}}]
    assert not order.exists() and done.exists()
    assert "launch-warm-ready uid=" in capsys.readouterr().out


def test_warm_containers_is_a_docker_queue_setting():
    base = {"name": "q", "presets": {"s": {"cpu": 1, "memory": "1Gi"}}, "default_preset": "s"}
    assert QueueSpec.model_validate({**base, "target": "docker", "warm_containers": 2}).warm_containers == 2
    with pytest.raises(ValueError, match="warm_containers applies to docker queues only"):
        QueueSpec.model_validate({**base, "warm_containers": 1})
    with pytest.raises(ValueError):
        QueueSpec.model_validate({**base, "target": "docker", "warm_containers": 99})
