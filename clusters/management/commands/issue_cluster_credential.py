from django.core.management.base import BaseCommand, CommandError, CommandParser

from clusters.models import Cluster
from clusters.services.credentials import issue_cluster_credential


class Command(BaseCommand):
    help = "Print a new collector credential for CLUSTER (POST agent/nodes and agent/report)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("cluster")
        parser.add_argument("--name", default="collector")

    def handle(self, *args, cluster: str, name: str, **options) -> None:
        target = Cluster.objects.filter(name=cluster).first()
        if target is None:
            raise CommandError(f"No cluster '{cluster}'.")
        _, plaintext = issue_cluster_credential(target, name=name)
        self.stdout.write(plaintext)
