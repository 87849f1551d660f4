"""Fixtures of the fault suite: a PostgreSQL and a Redis of its own for the whole run, and one
production topology per test module (``TOPOLOGY = {...}`` in a module gives its fleet and
environment). Every process is stopped at the end, whatever happened; a failed test's process
logs are printed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.harness import Heartbeats, PrivatePostgres, PrivateRedis, Topology, private_root


@dataclass
class Servers:
    pg: PrivatePostgres
    redis: PrivateRedis
    root: Path
    migrate_s: float

    def heal(self) -> None:
        """Bring back whatever a scenario left stopped."""
        if not self.pg.running():
            self.pg.start()
        if self.redis.process is None or self.redis.process.poll() is not None:
            self.redis.start()


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    root = private_root()
    pg, rds = PrivatePostgres(root), PrivateRedis(root)
    try:
        pg.init()
        pg.start()
        migrate_s = pg.migrate_template()
        rds.start()
        yield Servers(pg, rds, root, migrate_s)
    finally:
        rds.stop()
        if pg.running():
            pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def topology(servers: Servers, request: pytest.FixtureRequest) -> Iterator[Topology]:
    servers.heal()
    servers.redis.flushall()  # no task of an earlier module's beat reaches this one's workers
    name = request.module.__name__.rsplit(".", 1)[-1]
    shape = dict(getattr(request.module, "TOPOLOGY", {}))
    # The scenarios kill web workers on purpose: the fairness slots a killed one held come back
    # after 5 s rather than production's 60 (tests/portal/api/test_fairness.py tests the lease).
    shape["env"] = {"ORRERY_API_TENANT_LEASE_S": "5", **shape.get("env", {})}
    topo = Topology(servers.pg, servers.redis, servers.root / name, **shape)
    failed_before = request.session.testsfailed
    try:
        topo.start()
        yield topo
    finally:
        topo.stop()
        if request.session.testsfailed > failed_before:  # this module's tests failed
            for process in topo.processes.values():
                tail = process.log.read_text(errors="replace")[-3000:] if process.log.exists() else ""
                print(f"--- {process.name} ---\n{tail}")


@pytest.fixture
def healed(servers: Servers, topology: Topology) -> Iterator[Topology]:
    """The module's topology, healed after the test: servers running, every process up."""
    yield topology
    servers.heal()
    topology.supervisor.paused.clear()
    topology.wait_all_up()


@pytest.fixture(scope="module")
def heartbeats(topology: Topology) -> Iterator[Heartbeats]:
    """Every node of the module's fleet reports every 2 s, for all its scenarios."""
    beats = Heartbeats(topology.web_ports, topology.seed["clusters"], interval_s=2.0)
    beats.start()
    yield beats
    beats.stop()
