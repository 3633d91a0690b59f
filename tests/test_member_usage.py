"""Per-member figures of cluster runs: the pure pieces (attribution, CPU by member, the monitor's cell)."""

from __future__ import annotations

from prefect_launch.workers.cluster.usage import cpu_by_member, member_of


def test_a_cluster_run_keeps_one_row_with_its_members_in_a_column():
    from prefect_launch.dashboard.metrics_source import members_text, metrics_frame

    members = {"sub1": {"gpu_indices": [1], "cpu_seconds": 2.44, "peak_memory_bytes": 3 * 2**29},
               "main1": {"gpu_indices": [0], "cpu_seconds": 1.2, "peak_memory_bytes": None}}
    assert members_text(members) == "main1: gpu 0, 1.2 CPU-s · sub1: gpu 1, 2.4 CPU-s, 1.50 GiB"
    assert members_text(None) == "" and members_text({}) == ""
    rows = [{"flow_run_id": "a", "has_summary": True, "extra": {"members": members}},
            {"flow_run_id": "b", "has_summary": True, "extra": {}}]
    df = metrics_frame(rows)
    assert len(df) == 2  # one row per run, members or not
    assert df.set_index("id")["members"].to_dict() == {"a": members_text(members), "b": ""}


def test_processes_belong_to_the_member_they_descend_from():
    roots = {100: "main1", 200: "sub1"}
    parent = {100: 1, 101: 100, 102: 101, 200: 1, 201: 200, 300: 1}
    assert member_of(102, roots, parent) == "main1"
    assert member_of(201, roots, parent) == "sub1"
    assert member_of(300, roots, parent) is None  # not a member's process


def test_cpu_by_member_counts_a_reaped_child_once():
    roots = {100: "main1", 200: "sub1"}
    prev = {100: 1.0, 101: 2.0, 200: 0.5}
    prev_parent = {100: 1, 101: 100, 200: 1}
    # 101 ended and was reaped by 100: its 2.5 s moved into 100's children time
    now = {100: 1.0 + 2.5 + 0.1, 200: 1.5}
    now_parent = {100: 1, 200: 1}
    got = cpu_by_member(now, prev, now_parent, prev_parent, roots)
    assert round(got["main1"], 6) == 0.6  # 0.1 of its own + 0.5 more of the child's, not 2.5 again
    assert round(got["sub1"], 6) == 1.0
