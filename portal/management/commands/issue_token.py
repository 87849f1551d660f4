from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.services.tokens import DEFAULT_SCOPES, TokenRefused, issue_token


class Command(BaseCommand):
    help = "Issue an API token for USERNAME and print it (it is not stored in plaintext)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="a label to tell tokens apart")
        parser.add_argument(
            "--scopes",
            default=",".join(DEFAULT_SCOPES),
            help="comma-separated: read, submit, operate (default: read,submit; operators "
            "onboarding clusters or mapping accounts through the API need operate)",
        )
        parser.add_argument(
            "--expires-in-days", type=int, help="default and maximum: ORRERY_TOKEN_MAX_DAYS (90)"
        )

    def handle(
        self, *args, username: str, name: str, scopes: str, expires_in_days: int | None, **options
    ) -> None:
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"No active user '{username}'.")
        wanted = [s.strip() for s in scopes.split(",") if s.strip()]
        try:
            _, plaintext = issue_token(user, name=name, scopes=wanted, expires_in_days=expires_in_days)
        except TokenRefused as exc:
            raise CommandError(f"--{exc.field.replace('expiresInDays', 'expires-in-days')}: {exc}") from None
        self.stdout.write(plaintext)
