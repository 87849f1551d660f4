from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.services.tokens import issue_token


class Command(BaseCommand):
    help = "Issue an API token for USERNAME and print it (it is not stored in plaintext)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="a label to tell tokens apart")

    def handle(self, *args, username: str, name: str, **options) -> None:
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"No active user '{username}'.")
        _, plaintext = issue_token(user, name=name)
        self.stdout.write(plaintext)
