"""Heartbeat traffic: made-up nodes that report like real ones, over HTTP, through the public
agent API.

A load and demo tool, not a cluster adapter: the clusters it creates are of kind ``simulated``,
whose jobs run in-process through their adapter (``clusters.adapters.simulated``); this
module only sends their nodes' registrations and heartbeats. Used by ``manage.py simulate_fleet``
and by ``make demo`` (a small fleet). It runs next to the server: it creates its clusters and
their credentials directly (as an operator would in the console), then registers nodes and
sends every report through ``/api/v1/agent/…`` like any collector or agent.

* ``batched`` mode: one collector per cluster posts all its nodes every interval
  (``agent/nodes`` once, then ``agent/report`` in chunks);
* ``per-node`` mode: every node registers with a join token and heartbeats on its own
  (``agent/register``, then ``agent/heartbeat``).

A GPU reports load as a job would put on it: each round the traffic asks which GPUs of its
nodes active allocations hold (the ``held_gpus`` port; it runs next to the server), and those
run busy, near their model's TDP, while the others idle at a tenth of it — so the telemetry
averages, the fleet's power charts and the energy meter see what the simulated jobs would draw.

With ``fail_rate`` each live node may die at each interval (it stops reporting for one to ten
minutes, then comes back with a new boot id), so the lifecycle has something to do.

A report answered 429 or 503 with ``Retry-After`` is not retried at once: that node (per-node
mode) or that cluster's collector (batched mode) sends nothing until the suggested wait, drawn
out by a random 0–50 % so that a refused fleet does not return in step, has passed.
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson

from clusters import ports
from clusters.choices import ClusterKind, ClusterState
from clusters.models import Cluster, GpuModel, Node
from clusters.services.credentials import create_join_token, issue_cluster_credential

log = logging.getLogger(__name__)
MODELS = ["h100-80g", "a100-80g", "l40s-48g", "h200-141g"]
CHUNK = 1000
IDLE_POWER = 0.12  # of TDP: what an idle data-centre GPU draws, roughly (an idle H100: ~80 of 700 W)
DEFAULT_TDP_W = 700.0  # for a model the catalog does not know


class TrafficError(Exception):
    """The server refused something the traffic needs (registration, a report)."""


@dataclass
class TrafficNode:
    """One made-up node: its identity, the sequence of its reports and its GPUs' power limit."""

    name: str
    cluster: str
    model: str
    gpus: int
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    dead_until: float = 0.0
    credential: str = ""
    retry_at: float = 0.0  # asked to wait (Retry-After) until then
    tdp_w: float = DEFAULT_TDP_W
    node_id: int | None = None

    def report(self, now: float, held: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """The node's next report; the GPUs of ``held`` (indices) run a job, the others idle."""
        self.seq += 1
        gpus = []
        for i in range(self.gpus):
            util = random.uniform(88.0, 100.0) if i in held else random.uniform(0.0, 2.0)
            gpus.append(
                {
                    "index": i,
                    "model": self.model,
                    "util": round(util, 1),
                    "memory_used_mb": int(util * 700),
                    "power_w": round(gpu_power(self.tdp_w, util), 1),
                    "temp_c": round(35 + util * 0.4, 1),
                    "health": "healthy",
                }
            )
        return {
            "node": self.name,
            "boot_id": self.boot_id,
            "seq": self.seq,
            "sent_at": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "cpu": round(random.uniform(0.05, 0.9), 3),
            "memory": random.randint(2**34, 2**38),
            "power_w": round(sum(g["power_w"] for g in gpus) + 300, 1),
            "agent_version": "heartbeat-traffic",
            "gpus": gpus,
        }

    def description(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cpu_millicores": 128_000,
            "memory_bytes": 1024 * 2**30,
            "agent_version": "heartbeat-traffic",
            "boot_id": self.boot_id,
            "labels": {"simulated": "true"},
            "gpus": [
                {
                    "index": i,
                    "model": self.model,
                    "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{self.name}.{i}')}",
                    "topology_group": f"nvl{i // 4}",
                }
                for i in range(self.gpus)
            ],
        }


def gpu_power(tdp_w: float, util: float) -> float:
    """What a GPU at ``util`` % draws: a tenth or so of its TDP idle, rising with load to the
    TDP at full load."""
    return tdp_w * (IDLE_POWER + (1 - IDLE_POWER) * util / 100)


class _Http:
    """One keep-alive connection per thread to the server."""

    def __init__(self, server: str, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(server)
        self.host, self.port, self.timeout = parsed.hostname or "127.0.0.1", parsed.port or 80, timeout
        self.local = threading.local()

    def post(self, path: str, body: Any, bearer: str) -> tuple[int, Any]:
        """``(status, JSON body)``; ``retry_after`` then holds the answer's Retry-After, if any."""
        data = orjson.dumps(body)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {bearer}"}
        for attempt in (1, 2):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection(
                    self.host, self.port, timeout=self.timeout
                )
            try:
                conn.request("POST", path, data, headers)
                response = conn.getresponse()
                payload = response.read()
                self.local.retry_after = _seconds(response.getheader("Retry-After"))
                return response.status, orjson.loads(payload) if payload else None
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def _seconds(header: str | None) -> float | None:
    try:
        return max(float(header), 0.0) if header else None
    except ValueError:  # an HTTP date: not sent by this server
        return None


def backoff(retry_after: float) -> float:
    """How long to hold off when told ``Retry-After``: that, plus up to half again at random."""
    return retry_after * random.uniform(1.0, 1.5)


class HeartbeatTraffic:
    """Registers ``nodes`` made-up nodes spread over ``clusters`` and sends their reports every
    ``interval`` seconds, batched per cluster or one request per node (``mode``)."""

    def __init__(
        self,
        server: str,
        *,
        clusters: int | Iterable[str] = 4,
        nodes: int = 100,
        mode: str = "batched",
        interval: float = 10.0,
        fail_rate: float = 0.0,
        gpus_per_node: int = 8,
        prefix: str = "sim",
        threads: int = 8,
    ) -> None:
        if mode not in ("batched", "per-node"):
            raise ValueError("mode is batched or per-node")
        names = [f"{prefix}-{i}" for i in range(clusters)] if isinstance(clusters, int) else list(clusters)
        self.http = _Http(server)
        self.mode, self.interval, self.fail_rate, self.threads = mode, interval, fail_rate, threads
        self.clusters = names
        self.nodes: list[TrafficNode] = []
        self.credentials: dict[str, str] = {}
        self.sent = self.refused = 0
        self.retry_at: dict[str, float] = {}  # batched mode: a collector asked to wait
        per_cluster = max(nodes // len(names), 1)
        for c, cluster in enumerate(names):
            model = MODELS[c % len(MODELS)]
            self.nodes += [
                TrafficNode(f"{cluster}-n{i:05d}", cluster, model, gpus_per_node) for i in range(per_cluster)
            ]
        self._stop = threading.Event()

    # --- setup: operator side, then the public API ---------------------------------------------
    def setup(self, existing: dict[str, list[tuple[str, str, int]]] | None = None) -> None:
        """Create clusters and credentials, then declare or register every node over HTTP.
        ``existing`` attaches to clusters that already have nodes: ``{cluster: [(node, model, gpus)]}``."""
        if existing:
            self.clusters = list(existing)
            self.nodes = [TrafficNode(n, c, m, g) for c, rows in existing.items() for n, m, g in rows]
        for name in self.clusters:
            cluster, _ = Cluster.objects.get_or_create(
                name=name,
                defaults={
                    "kind": ClusterKind.SIMULATED,
                    "state": ClusterState.ONBOARDING,
                    "display_name": "Simulated cluster",
                },
            )
            if self.mode == "batched":
                _, self.credentials[name] = issue_cluster_credential(cluster, name="heartbeat-traffic")
            else:
                members = sum(1 for n in self.nodes if n.cluster == name)
                _, self.credentials[name] = create_join_token(
                    cluster, name="heartbeat-traffic", max_uses=members
                )
        GpuModel.objects.filter(slug__in=MODELS).count()  # the catalog must hold the models it reports
        if self.mode == "batched":
            for cluster in self.clusters:
                members = [n for n in self.nodes if n.cluster == cluster]
                for i in range(0, len(members), CHUNK):
                    body = {"cluster": cluster, "nodes": [n.description() for n in members[i : i + CHUNK]]}
                    self._expect(
                        self.http.post("/api/v1/agent/nodes", body, self.credentials[cluster]),
                        "declare nodes",
                    )
        else:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(self._register, self.nodes))
        self._learn_nodes()

    def _learn_nodes(self) -> None:
        """Each node's id (what allocations name) and its model's TDP, from the database."""
        models = GpuModel.objects.filter(slug__in={n.model for n in self.nodes})
        tdps = dict(models.values_list("slug", "tdp_watts"))
        nodes = Node.objects.filter(cluster__name__in=self.clusters)
        ids = {(cluster, name): pk for cluster, name, pk in nodes.values_list("cluster__name", "name", "pk")}
        for node in self.nodes:
            node.tdp_w = float(tdps.get(node.model, DEFAULT_TDP_W))
            node.node_id = ids.get((node.cluster, node.name))

    def _register(self, node: TrafficNode) -> None:
        status, body = self.http.post(
            "/api/v1/agent/register", node.description(), self.credentials[node.cluster]
        )
        self._expect((status, body), f"register {node.name}")
        node.credential = body["credential"]

    @staticmethod
    def _expect(result: tuple[int, Any], what: str) -> Any:
        status, body = result
        if status >= 300:
            raise TrafficError(f"{what}: HTTP {status}: {body}")
        return body

    # --- reporting ---------------------------------------------------------------------------
    def alive(self, now: float) -> list[TrafficNode]:
        live = []
        for node in self.nodes:
            if node.dead_until > now:
                continue
            if node.dead_until:  # back from the dead: a reboot
                node.dead_until, node.boot_id, node.seq = 0.0, uuid.uuid4().hex, 0
            if self.fail_rate and random.random() < self.fail_rate:
                node.dead_until = now + random.uniform(60, 600)
                log.info("node %s stops reporting", node.name)
                continue
            if node.retry_at > now or self.retry_at.get(node.cluster, 0.0) > now:
                continue  # told to come back later
            live.append(node)
        return live

    def kill(self, name: str, seconds: float) -> None:
        """Make one node silent for ``seconds`` (tests and demos)."""
        for node in self.nodes:
            if node.name == name:
                node.dead_until = time.time() + seconds

    def tick(self) -> int:
        """Send one round of reports; returns how many node reports were accepted."""
        now = time.time()
        live = self.alive(now)
        held = self._held(live)
        if self.mode == "batched":
            jobs = []
            for cluster in self.clusters:
                members = [n for n in live if n.cluster == cluster]
                jobs += [(cluster, members[i : i + CHUNK]) for i in range(0, len(members), CHUNK)]
            with ThreadPoolExecutor(min(self.threads, max(len(jobs), 1))) as pool:
                return sum(pool.map(lambda job: self._send_batch(job[0], job[1], now, held), jobs))
        with ThreadPoolExecutor(self.threads) as pool:
            return sum(pool.map(lambda node: self._send_one(node, now, held), live))

    @staticmethod
    def _held(nodes: list[TrafficNode]) -> dict[int, set[int]]:
        """``{node id: GPU indices held by active allocations}`` of ``nodes``, in one query."""
        ids = [n.node_id for n in nodes if n.node_id is not None]
        return ports.held_gpus()(ids) if ids else {}

    def _send_batch(
        self, cluster: str, nodes: list[TrafficNode], now: float, held: dict[int, set[int]]
    ) -> int:
        body = {"cluster": cluster, "nodes": [n.report(now, held.get(n.node_id, set())) for n in nodes]}
        status, answer = self.http.post("/api/v1/agent/report", body, self.credentials[cluster])
        self.sent += len(nodes)
        if status != 200:
            self.refused += len(nodes)
            wait = self._told_to_wait()
            if wait is not None:
                self.retry_at[cluster] = time.time() + wait
            log.warning("report for %s refused: HTTP %s %s", cluster, status, answer)
            return 0
        return answer["accepted"]

    def _send_one(self, node: TrafficNode, now: float, held: dict[int, set[int]]) -> int:
        report = node.report(now, held.get(node.node_id, set()))
        status, answer = self.http.post("/api/v1/agent/heartbeat", report, node.credential)
        self.sent += 1
        if status != 200:
            self.refused += 1
            wait = self._told_to_wait()
            if wait is not None:
                node.retry_at = time.time() + wait
            return 0
        return int(answer["accepted"])

    def _told_to_wait(self) -> float | None:
        told = getattr(self.http.local, "retry_after", None)
        return backoff(told) if told is not None else None

    def run(self, duration: float | None = None) -> None:
        """Report every ``interval`` until ``stop()`` or ``duration`` seconds have passed."""
        end = time.monotonic() + duration if duration else None
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            started = time.monotonic()
            try:
                accepted = self.tick()
                log.debug("heartbeat traffic sent a round: %d accepted", accepted)
            except (OSError, http.client.HTTPException) as exc:
                log.warning("heartbeat traffic could not reach the server: %s", exc)
            self._stop.wait(max(self.interval - (time.monotonic() - started), 0.0))

    def stop(self) -> None:
        self._stop.set()
