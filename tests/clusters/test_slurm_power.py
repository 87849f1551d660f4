"""Powering Slurm nodes down and up through slurmrestd: the request (pure), the choice of API
version, and what Slurm's answers become. The live run against a real Slurm is in
test_slurm_live.py; here a small stand-in answers on loopback, because no slurmrestd of 23.02 or
later runs on this machine (the test Slurm is 22.05, whose API cannot update nodes)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from clusters.adapters.base import power_saving_of
from clusters.adapters.registry import adapter_for
from clusters.adapters.slurm.api import (
    NODE_UPDATE_VERSIONS,
    SlurmClient,
    SlurmError,
    node_update,
    update_errors,
)
from clusters.choices import ClusterKind


@pytest.mark.parametrize(
    "version, node, state, expected",
    [
        (
            "v0.0.40",
            "gpu-001",
            "POWER_DOWN",
            ("POST", "/slurm/v0.0.40/node/gpu-001", {"state": ["POWER_DOWN"]}),
        ),
        ("v0.0.39", "gpu-001", "POWER_UP", ("POST", "/slurm/v0.0.39/node/gpu-001", {"state": ["POWER_UP"]})),
        # a hostile name stays one path segment: it cannot reach another endpoint or add a query
        (
            "v0.0.41",
            "../jobs?x=1",
            "POWER_DOWN",
            ("POST", "/slurm/v0.0.41/node/..%2Fjobs%3Fx%3D1", {"state": ["POWER_DOWN"]}),
        ),
    ],
    ids=["power-down", "power-up", "hostile-name"],
)
def test_node_update_request(version, node, state, expected):
    assert node_update(version, node, state) == expected


@pytest.mark.parametrize(
    "version, node, state, words",
    [
        ("v0.0.38", "gpu-001", "POWER_DOWN", "cannot update nodes"),  # would answer a POST like a GET
        ("v0.0.36", "gpu-001", "POWER_UP", "cannot update nodes"),
        ("v0.0.40", "gpu-001", "DOWN", "not a power state"),
        ("v0.0.40", "gpu-001", "RESUME", "not a power state"),
        ("v0.0.40", "", "POWER_DOWN", "not a node name"),
        ("v0.0.40", "n" * 256, "POWER_DOWN", "not a node name"),
    ],
    ids=["v38", "v36", "down-is-not-power", "resume-is-not-power", "empty-name", "huge-name"],
)
def test_requests_orrery_never_sends(version, node, state, words):
    with pytest.raises(SlurmError, match=words):
        node_update(version, node, state)


@pytest.mark.parametrize(
    "answer, expected",
    [
        ({"errors": []}, ""),
        ({}, ""),
        (
            {"errors": [{"description": "Invalid node state specified", "error_number": 2016}]},
            "Invalid node state specified",
        ),
        ({"errors": [{"error": "Unable to contact slurm controller"}]}, "Unable to contact slurm controller"),
        ({"errors": "odd"}, "odd"),
    ],
    ids=["none", "absent", "description", "error", "not-a-list"],
)
def test_refusals_inside_an_ordinary_answer(answer, expected):
    assert update_errors(answer) == expected


def test_newest_update_version_first():
    assert NODE_UPDATE_VERSIONS[-1] == "v0.0.39" and list(NODE_UPDATE_VERSIONS) == sorted(
        NODE_UPDATE_VERSIONS, reverse=True
    )


def test_slurm_and_simulated_kinds_can_power_nodes_others_cannot():
    able = {kind for kind in ClusterKind.values if power_saving_of(adapter_for(kind)) is not None}
    assert able == {ClusterKind.SLURM, ClusterKind.SIMULATED}


class StandIn(http.server.BaseHTTPRequestHandler):
    """A stand-in slurmrestd: answers pings on ``served`` versions, records node updates, and
    refuses them with ``refusal`` when set (as a 200 with errors, or with ``status``)."""

    served: tuple[str, ...] = ()
    refusal: str = ""
    status: int = 200
    seen: list[tuple[str, str, dict, dict]] = []

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        version = self.path.split("/")[2]
        if self.path.endswith("/ping") and version in self.served:
            self._answer(200, {"pings": [{"ping": "UP"}], "errors": []})
        else:
            self._answer(404, {"errors": [{"error": "Unable to find path"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        headers = {k: self.headers[k] for k in ("X-SLURM-USER-NAME", "X-SLURM-USER-TOKEN")}
        type(self).seen.append(("POST", self.path, body, headers))
        if self.refusal:
            self._answer(self.status, {"errors": [{"description": self.refusal}]})
        else:
            self._answer(200, {"errors": []})

    def log_message(self, *args):
        pass


@pytest.fixture
def slurmrestd() -> Iterator[type[StandIn]]:
    handler = type("Handler", (StandIn,), {"served": ("v0.0.38", "v0.0.40"), "seen": []})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_port}"
    yield handler
    server.shutdown()


def test_a_power_down_goes_to_the_newest_version_that_updates_nodes(slurmrestd):
    client = SlurmClient(slurmrestd.url, "jwt-1", user="orrery")
    client.set_node_state("gpu-001", "POWER_DOWN")
    client.set_node_state("gpu-002", "POWER_UP")
    assert slurmrestd.seen == [
        (
            "POST",
            "/slurm/v0.0.40/node/gpu-001",
            {"state": ["POWER_DOWN"]},
            {"X-SLURM-USER-NAME": "orrery", "X-SLURM-USER-TOKEN": "jwt-1"},
        ),
        (
            "POST",
            "/slurm/v0.0.40/node/gpu-002",
            {"state": ["POWER_UP"]},
            {"X-SLURM-USER-NAME": "orrery", "X-SLURM-USER-TOKEN": "jwt-1"},
        ),
    ]


def test_a_slurmrestd_too_old_is_a_clear_refusal_and_nothing_is_posted(slurmrestd):
    slurmrestd.served = ("v0.0.38", "v0.0.37")
    with pytest.raises(SlurmError, match=r"cannot update nodes: power saving needs API v0.0.39 or later"):
        SlurmClient(slurmrestd.url, "jwt").set_node_state("gpu-001", "POWER_DOWN")
    assert slurmrestd.seen == []


@pytest.mark.parametrize("status", [200, 500], ids=["errors-in-a-200", "http-500"])
def test_slurms_refusal_says_why(slurmrestd, status):
    slurmrestd.refusal, slurmrestd.status = "Node power saving is disabled", status
    with pytest.raises(SlurmError, match="Node power saving is disabled"):
        SlurmClient(slurmrestd.url, "jwt").set_node_state("gpu-001", "POWER_DOWN")
