"""Slurm's answers mapped to Orrery's terms, on output recorded from a real Slurm 22.05
(slurmrestd v0.0.38, via scripts/slurm-dev-cluster.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusters.adapters.slurm import decode_exit, job_state, node_state, parse_gres, parse_nodes
from clusters.choices import NodeState

RECORDINGS = Path(__file__).parent / "recordings"


def recorded(name: str) -> dict:
    return json.loads((RECORDINGS / f"slurm-22.05-{name}.json").read_text())


@pytest.mark.parametrize(
    "gres, expected",
    [
        ("gpu:a100:4", ("a100", 4)),
        ("gpu:4", (None, 4)),
        ("", (None, 0)),
        (None, (None, 0)),
        ("gpu:h100:8(S:0-1)", ("h100", 8)),
        ("tmpdisk:100,gpu:l40s:2", ("l40s", 2)),
    ],
)
def test_gres(gres, expected):
    assert parse_gres(gres) == expected


@pytest.mark.parametrize(
    "state, flags, expected",
    [
        ("idle", [], NodeState.READY),
        ("mixed", [], NodeState.READY),
        ("allocated", [], NodeState.READY),
        ("down", [], NodeState.DOWN),
        ("idle", ["DRAIN"], NodeState.DRAINED),
        ("mixed", ["DRAIN"], NodeState.DRAINING),
        ("idle", ["NOT_RESPONDING"], NodeState.NOT_READY),
        ("down", ["NOT_RESPONDING"], NodeState.DOWN),
        ("future", [], NodeState.NOT_READY),
        (["IDLE", "DRAIN"], None, NodeState.DRAINED),
        ("weird", [], NodeState.NOT_READY),
    ],
)
def test_node_states(state, flags, expected):
    assert node_state(state, flags)[0] == expected


@pytest.mark.parametrize(
    "state, expected",
    [
        ("PENDING", "PENDING"),
        ("RUNNING", "RUNNING"),
        ("COMPLETING", "COMPLETING"),
        ("COMPLETED", "SUCCEEDED"),
        ("FAILED", "FAILED"),
        ("NODE_FAIL", "FAILED"),
        ("TIMEOUT", "TIMEOUT"),
        ("CANCELLED", "CANCELLED"),
        ("PREEMPTED", "PREEMPTED"),
        ("REQUEUE_HOLD", "HELD"),
        (["CANCELLED"], "CANCELLED"),
        ("NEW_STATE", "FAILED"),
    ],
)
def test_job_states(state, expected):
    assert job_state(state) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [(0, (0, None)), (768, (3, None)), (15, (None, 15)), (9, (None, 9)), (None, (None, None))],
)
def test_exit_status_is_a_raw_wait_status(raw, expected):
    assert decode_exit(raw) == expected


def test_recorded_nodes():
    nodes = {n.name: n for n in parse_nodes(recorded("nodes"))}
    assert set(nodes) == {"n1", "n2", "n3", "n4"}
    assert (nodes["n1"].gpu_type, nodes["n1"].gpus, nodes["n1"].cpus, nodes["n1"].memory_mb) == (
        "a100",
        4,
        8,
        64000,
    )
    assert nodes["n1"].partitions == ("gpu",)
    assert (nodes["n4"].state, nodes["n4"].reason) == (NodeState.DRAINED, "maintenance")


def test_recorded_jobs():
    jobs = {j["name"]: j for j in recorded("jobs")["jobs"]}
    assert job_state(jobs["rec-exit3"]["job_state"]) == "FAILED"
    assert decode_exit(jobs["rec-exit3"]["exit_code"]) == (3, None)
    assert job_state(jobs["rec-sleep"]["job_state"]) == "CANCELLED"
    assert decode_exit(jobs["rec-sleep"]["exit_code"]) == (None, 15)


def test_an_answer_that_is_not_slurmrestd_json_is_a_clear_error():
    import http.server
    import threading

    from clusters.adapters.slurm import SlurmClient, SlurmError

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # a catch-all web app: 200 with HTML on every path
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>welcome</html>")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SlurmError, match="is this the slurmrestd URL") as caught:
            SlurmClient(f"http://127.0.0.1:{server.server_port}", "jwt").connect()
        assert caught.value.field == "url"
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    "state, expected",
    [("RUNNING", True), ("COMPLETING", False), ("SUSPENDED", False), (["RUNNING"], True)],
)
def test_only_a_running_job_can_pass_its_time_limit(state, expected):
    import time
    from types import SimpleNamespace

    from scheduling.slurm import _past_time_limit

    job = SimpleNamespace(time_limit_s=60)
    assert _past_time_limit(job, {"job_state": state, "start_time": time.time() - 61}) is expected
    assert _past_time_limit(job, {"job_state": state, "start_time": time.time() - 59}) is False
