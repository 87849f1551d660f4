from django.core.management.base import BaseCommand, CommandError, CommandParser

from clusters.choices import ClusterKind, ClusterState
from clusters.models import Cluster
from clusters.services.credentials import create_join_token


class Command(BaseCommand):
    help = (
        "Print a new join token for CLUSTER: agents trade it for their node credential. "
        "A missing cluster is created as kind 'native' (machines running orrery-agent)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("cluster")
        parser.add_argument("--name", default="default", help="a label to tell tokens apart")

    def handle(self, *args, cluster: str, name: str, **options) -> None:
        target, created = Cluster.objects.get_or_create(
            name=cluster, defaults={"kind": ClusterKind.NATIVE, "state": ClusterState.ONBOARDING}
        )
        if created:
            self.stderr.write(f"Created cluster '{cluster}' (kind native).")
        elif target.kind != ClusterKind.NATIVE:
            raise CommandError(
                f"Cluster '{cluster}' is of kind {target.kind}: its nodes are reported by a collector."
            )
        _, plaintext = create_join_token(target, name=name)
        self.stdout.write(plaintext)
