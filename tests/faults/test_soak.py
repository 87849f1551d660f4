"""The soak's short variant (``benchmarks/soak.py`` runs the long one): 1,000 simulated nodes
report every 5 s for 40 s while each of the eight control-plane processes is killed once (the
second copy of a role only once the first serves again).
No report is lost, every node's last acknowledged report reaches the database, no node flaps,
no process dies unplanned, the invariants hold, and memory stays bounded."""

from __future__ import annotations

import json

from benchmarks.soak import soak
from tests.faults.harness import Topology

INTERVAL_S = 5
TOPOLOGY = {
    "clusters": 2,
    "nodes": 500,
    "env": {
        "ORRERY_HEARTBEAT_INTERVAL": str(INTERVAL_S),
        "ORRERY_NODE_GRACE": str(INTERVAL_S * 4),
        "ORRERY_NODE_FAILOVER_AFTER": str(INTERVAL_S * 12),
    },
}
MEMORY_BOUND_MIB = 1500  # per process group (a gunicorn master with its workers is one)


def test_a_short_soak_loses_no_report(topology: Topology):
    result = soak(topology, seconds=40, interval_s=INTERVAL_S, yardstick_s=3, sample_s=4, say=print)
    print(json.dumps({"soak": result}))
    reports = result["reports"]
    assert reports["lost"] == 0, reports
    assert reports["not_in_database"] == 0, reports
    assert reports["server_counted_accepted"] >= reports["accepted"], reports
    assert result["invariants_broken"] == []
    assert result["unplanned_deaths"] == []
    assert result["node_flaps"] == 0
    assert result["submission_failures"] == 0
    peaks = {name: m["peak"] for name, m in result["memory_mib"].items()}
    assert max(peaks.values()) < MEMORY_BOUND_MIB, peaks
