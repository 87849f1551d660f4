"""``python manage.py demo``: migrate, seed, and serve the portal with nothing but Python."""

from __future__ import annotations

import threading

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.embedded import start_embedded_timers
from portal.services.demo import DEMO_USERS, DemoRefused, seed_demo


class Command(BaseCommand):
    help = "Migrate, seed the demo fleet and serve Orrery (HTTP and websockets) on one process."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-seed", action="store_true", help="Serve what is there; seed nothing.")

    def handle(self, *args, host: str, port: int, no_seed: bool, **options) -> None:
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
