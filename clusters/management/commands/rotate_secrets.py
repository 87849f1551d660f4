from django.core.management.base import BaseCommand
from django.db import transaction

from clusters.models import ClusterSecret
from foundation.sealing import reseal


class Command(BaseCommand):
    help = (
        "Seal every cluster secret again with the first key of ORRERY_SECRETS_KEYS. Rotate a key by "
        "putting the new one first, running this, then removing the old one."
    )

    def handle(self, *args, **options) -> None:
        with transaction.atomic():
            rows = list(ClusterSecret.objects.select_for_update())
            for row in rows:
                row.sealed = reseal(row.sealed)
                row.save(update_fields=["sealed", "updated_at"])
        self.stdout.write(f"Sealed {len(rows)} cluster secret(s) with the newest key.")
