from django.core.management.base import BaseCommand, CommandError

from portal.services.demo import DemoRefused, seed_demo


class Command(BaseCommand):
    help = "Seed the demo fleet, users (admin/alice/bob) and jobs. Idempotent; refused in production."

    def handle(self, *args, **options) -> None:
        try:
            counts = seed_demo()
        except DemoRefused as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(", ".join(f"{n} {what}" for what, n in counts.items()))
