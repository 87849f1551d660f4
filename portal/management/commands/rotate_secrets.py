from django.core.management.base import BaseCommand
from django.db import transaction

from clusters.models import ClusterSecret
from foundation.sealing import reseal
from scheduling.models import Job


class Command(BaseCommand):
    help = (
        "Seal every secret kept at rest (cluster credentials, jobs' secret environments) again with the "
        "first key of ORRERY_SECRETS_KEYS. Rotate a key by putting the new one first, running this, then "
        "removing the old one."
    )

    def handle(self, *args, **options) -> None:
        with transaction.atomic():
            rows = list(ClusterSecret.objects.select_for_update())
            for row in rows:
                row.sealed = reseal(row.sealed)
                row.save(update_fields=["sealed", "updated_at"])
        jobs = 0
        sealed = Job.objects.exclude(secret_env="").order_by("pk").values_list("pk", flat=True)
        for pk in sealed.iterator(chunk_size=1000):
            with transaction.atomic():
                job = Job.objects.select_for_update().only("secret_env").get(pk=pk)
                Job.objects.filter(pk=pk).update(secret_env=reseal(job.secret_env))
            jobs += 1
        self.stdout.write(
            f"Sealed {len(rows)} cluster secret(s) and {jobs} job secret environment(s) with the newest key."
        )
