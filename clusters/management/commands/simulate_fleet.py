"""``manage.py simulate_fleet``: heartbeat traffic of made-up nodes over real HTTP (see
``clusters.traffic``)."""

from __future__ import annotations

import contextlib

from django.core.management.base import BaseCommand, CommandError, CommandParser

from clusters.traffic import HeartbeatTraffic, TrafficError


class Command(BaseCommand):
    help = (
        "Generate heartbeat traffic: register clusters (kind simulated) and nodes through the agent "
        "API and send their heartbeats over HTTP."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--server", default="http://127.0.0.1:8000")
        parser.add_argument("--clusters", type=int, default=4)
        parser.add_argument("--nodes", type=int, default=1000, help="in all, spread over the clusters")
        parser.add_argument("--gpus-per-node", type=int, default=8)
        parser.add_argument("--mode", choices=["batched", "per-node"], default="batched")
        parser.add_argument("--interval", type=float, default=10.0, help="seconds between reports")
        parser.add_argument(
            "--fail-rate", type=float, default=0.0, help="chance a node dies at each interval"
        )
        parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
        parser.add_argument("--prefix", default="sim", help="cluster names: PREFIX-0, PREFIX-1, …")

    def handle(self, *args, **o) -> None:
        traffic = HeartbeatTraffic(
            o["server"],
            clusters=o["clusters"],
            nodes=o["nodes"],
            mode=o["mode"],
            interval=o["interval"],
            fail_rate=o["fail_rate"],
            gpus_per_node=o["gpus_per_node"],
            prefix=o["prefix"],
        )
        try:
            traffic.setup()
        except (TrafficError, OSError) as exc:
            raise CommandError(f"Could not set up the fleet on {o['server']}: {exc}") from exc
        nodes, clusters = len(traffic.nodes), len(traffic.clusters)
        shape = f"{nodes} nodes in {clusters} clusters ({o['mode']}, every {o['interval']}s)"
        self.stdout.write(f"Sending heartbeats of {shape}; Ctrl-C stops.")
        with contextlib.suppress(KeyboardInterrupt):
            traffic.run(o["duration"])
        self.stdout.write(f"Sent {traffic.sent} node reports, {traffic.refused} refused.")
