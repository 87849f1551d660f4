"""The production topology survives the loss of any one process: each of the eight is killed in
turn with SIGKILL under load (keyed submissions through both gunicorns, 100 nodes reporting
every 2 s), restarted a second later as systemd's ``Restart=always`` would, and the time until
service is back is measured from the kill:

* ``submitted``: a submission accepted (through either gunicorn, retried with its key);
* ``cycle``: a scheduling cycle ran (``SchedulerState.last_cycle_at``);
* ``placed``: a job placed (an attempt created);
* ``ingest``: a report accepted by the API, and ``flushed``: one written to the database
  (``NodeLastSeen.seen_at``);
* ``replaced``: the killed process itself serving again (restarted, answering or consuming).

One process is down at a time per role: the other copy of a role is killed only once the first
serves again (processes of different roles may be restarting together).

The target: no single process whose loss stops scheduling or ingest for more than one failover
period of its role. Every role has a second copy, so the period is that of the client or the
periodic task moving to the other copy: ``BOUND_S`` (10 s, the aim, plus slack for a loaded
2-core machine). Invariants hold after every kill, and no node flaps meanwhile.
"""

from __future__ import annotations

import json
import time

from tests.faults.harness import Heartbeats, Submitter, Topology, wait_for
from tests.faults.invariants import assert_invariants

TOPOLOGY = {"clusters": 2, "nodes": 50}
BOUND_S = 20.0  # aim 10 s; twice that on a shared 2-core machine, and fail on a stall
SIGNALS = ("submitted", "cycle", "placed", "ingest", "flushed")
# One copy of each role at a time: the second copy of a role is killed once the first serves again.
ORDER = ("web-1", "worker-1", "ws-1", "beat-1", "web-2", "worker-2", "ws-2", "beat-2")
ROLES = (Topology.WEB, Topology.WS, Topology.WORKERS, Topology.BEATS)
SIBLING = {a: b for pair in ROLES for a, b in (pair, pair[::-1])}


def recovery(topology: Topology, heartbeats: Heartbeats, submitter: Submitter, name: str, at: float) -> dict:
    """Seconds from the kill at ``at`` until each signal of service came back (None: not
    within a minute)."""
    found: dict[str, float | None] = {}
    probes = {
        "submitted": lambda: submitter.first_accepted_after(at),
        "cycle": lambda: (t := topology.last_cycle_at()) and t > at and t,
        "placed": lambda: topology.scalar(
            "SELECT extract(epoch FROM min(created_at)) FROM scheduling_jobattempt"
            " WHERE created_at > to_timestamp(%s)",
            [at],
        ),
        "ingest": lambda: heartbeats.last_answer_after(at),
        "flushed": lambda: (t := topology.last_seen_at()) and t > at and t,
    }
    end = time.monotonic() + 60
    while len(found) < len(probes) and time.monotonic() < end:
        for signal_name, probe in probes.items():
            if signal_name not in found and (value := probe()):
                found[signal_name] = round(float(value) - at, 2)
        time.sleep(0.1)
    return {s: found.get(s) for s in SIGNALS}


def replaced(topology: Topology, name: str, at: float) -> float:
    """Seconds from the kill until the process serves again (restarted and ready)."""
    process = topology.processes[name]
    wait_for(lambda: process.alive() and process.started_at > at, f"{name} to be restarted", 60)
    process.wait_up(120)
    return round(time.time() - at, 2)


def test_each_process_killed_under_load_is_replaced_and_service_goes_on(topology: Topology):
    heartbeats = Heartbeats(topology.web_ports, topology.seed["clusters"], interval_s=2.0)
    heartbeats.start()
    submitter = Submitter(topology.api, topology.project, every_s=0.3, seconds=2).start()
    figures: dict[str, dict] = {}
    since = time.time()
    try:
        wait_for(lambda: topology.last_placement_at(), "a first placement", 60)
        killed_at: dict[str, float] = {}
        for name in ORDER:
            sibling = SIBLING[name]
            if sibling in killed_at and "replaced" not in figures[sibling]:
                figures[sibling]["replaced"] = replaced(topology, sibling, killed_at[sibling])
            killed_at[name] = topology.kill(name)
            figures[name] = recovery(topology, heartbeats, submitter, name, killed_at[name])
            with topology.cursor() as cursor:
                assert_invariants(cursor, accepted_jobs=submitter.accepted.values())
        for name, at in killed_at.items():
            figures[name].setdefault("replaced", replaced(topology, name, at))
    finally:
        submitter.stop()
        heartbeats.stop()
    print(json.dumps({"topology_recovery_s": figures, "bound_s": BOUND_S}))
    slow = {
        f"{name}/{s}": f[s] for name, f in figures.items() for s in SIGNALS if f[s] is None or f[s] > BOUND_S
    }
    assert not slow, f"service stopped for longer than {BOUND_S:g} s after a kill: {slow}"
    assert topology.node_flaps(since) == 0, "nodes went not-ready while one process was down"
    assert submitter.failures == 0
    assert not topology.supervisor.unplanned(since), topology.supervisor.unplanned(since)
    with topology.cursor() as cursor:
        assert_invariants(cursor, accepted_jobs=submitter.accepted.values())
