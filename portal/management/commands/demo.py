"""``python manage.py demo``: migrate, seed, and serve the portal with nothing but Python."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from clusters.selectors import simulated_fleet
from clusters.traffic import HeartbeatTraffic, TrafficError
from portal.embedded import start_embedded_timers
from portal.services.demo import DEMO_USERS, DemoRefused, seed_demo, submit_demo_jobs

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Migrate, seed the demo fleet and serve Orrery (HTTP and websockets) on one process."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-seed", action="store_true", help="Serve what is there; seed nothing.")
        parser.add_argument(
            "--no-simulator", action="store_true", help="Do not keep simulated clusters reporting."
        )
        parser.add_argument(
            "--fail-rate", type=float, default=0.004, help="chance a simulated node dies per report"
        )

    def handle(
        self, *args, host: str, port: int, no_seed: bool, no_simulator: bool, fail_rate: float, **options
    ) -> None:
        self.fail_rate = fail_rate
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        if not no_seed:
            try:
                counts = seed_demo()
            except DemoRefused as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write("Demo fleet: " + ", ".join(f"{n} {what}" for what, n in counts.items()))
            logins = ", ".join(f"{name}/{name}" for name, _ in DEMO_USERS)
            self.stdout.write(f"Demo logins (user/password): {logins} — admin is the operator.")
        self.stdout.write(f"Serving on http://{host}:{port}/  (console: http://{host}:{port}/admin/)")

        stop = threading.Event()
        start_embedded_timers(stop)
        if not no_simulator:
            threading.Thread(
                target=self._send_heartbeats, args=(host, port, stop), name="heartbeat-traffic", daemon=True
            ).start()
            threading.Thread(target=self._workload, args=(stop,), name="workload", daemon=True).start()
        # Imported late: the ASGI application needs the app registry ready.
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server

        from portal.asgi import application

        try:
            Server(
                application=application, endpoints=build_endpoint_description_strings(host=host, port=port)
            ).run()
        finally:
            stop.set()

    def _send_heartbeats(self, host: str, port: int, stop: threading.Event) -> None:
        """Keep the simulated clusters reporting through the agent API, like real collectors,
        with the odd node dying and coming back so the lifecycle shows."""
        for _ in range(100):  # wait until the server accepts connections
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
                break
            time.sleep(0.1)
        fleet = simulated_fleet()
        if not fleet:
            return
        traffic = HeartbeatTraffic(
            f"http://{host}:{port}", mode="batched", interval=5.0, fail_rate=self.fail_rate
        )
        try:
            traffic.setup(existing=fleet)
        except (TrafficError, OSError) as exc:
            log.error("the demo's heartbeat traffic could not start: %s", exc)
            return
        threading.Thread(target=lambda: (stop.wait(), traffic.stop()), daemon=True).start()
        traffic.run()

    def _workload(self, stop: threading.Event) -> None:
        """A trickle of new jobs, so the demo fleet fills and drains as a real one does."""
        while not stop.wait(15.0):
            try:
                submit_demo_jobs(2)
            except Exception:
                log.exception("the demo workload could not submit")
            finally:
                close_old_connections()
