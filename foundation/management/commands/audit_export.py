from datetime import UTC, datetime, time

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from foundation.audit import export_lines
from foundation.choices import AuditAction
from foundation.models import AuditEntry


class Command(BaseCommand):
    help = (
        "Write the audit log as CSV or JSON lines, oldest first, streaming (a long log never sits "
        "in memory). --since and --until take a date or an ISO 8601 time (UTC unless it says)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=["csv", "jsonl"], default="csv")
        parser.add_argument("--since", help="entries at or after this date or time")
        parser.add_argument("--until", help="entries before this date or time")
        parser.add_argument("--action", action="append", choices=AuditAction.values, help="repeatable")
        parser.add_argument("--output", "-o", help="a file to write (default: standard output)")

    def handle(self, *args, format: str, since: str | None, until: str | None, **options) -> None:
        entries = AuditEntry.objects.order_by("id")
        if since:
            entries = entries.filter(at__gte=_moment(since, "--since"))
        if until:
            entries = entries.filter(at__lt=_moment(until, "--until"))
        if options["action"]:
            entries = entries.filter(action__in=options["action"])
        lines = export_lines(entries.iterator(chunk_size=2000), format)
        if options["output"]:
            with open(options["output"], "w", encoding="utf-8", newline="") as out:
                out.writelines(lines)
        else:
            for line in lines:
                self.stdout.write(line, ending="")


def _moment(text: str, option: str) -> datetime:
    """A date (its midnight, UTC) or a date and time; naive times are UTC."""
    try:
        moment = parse_datetime(text)
        if moment is None and (day := parse_date(text)) is not None:
            moment = datetime.combine(day, time.min)
    except ValueError:
        moment = None
    if moment is None:
        raise CommandError(f"{option}: not a date or an ISO 8601 time: {text!r}")
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment, UTC)
