from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from clusters.choices import ClusterKind, ClusterState, Identity
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
        parser.add_argument(
            "--uses", type=int, default=1, help="how many machines it admits (default 1; 0: any number)"
        )
        parser.add_argument(
            "--expires-in",
            type=int,
            default=None,
            metavar="SECONDS",
            help="how long it is valid (default ORRERY_JOIN_TOKEN_TTL_S, an hour)",
        )
        parser.add_argument(
            "--identity",
            choices=Identity.values,
            default=Identity.ACCOUNTS,
            help="for a cluster created here: whose POSIX account users' work runs under "
            "(default accounts: operators map each user; shared: one account, no isolation)",
        )

    def handle(
        self, *args, cluster: str, name: str, uses: int, expires_in: int | None, identity: str, **options
    ) -> None:
        if uses < 0 or (expires_in is not None and expires_in <= 0):
            raise CommandError("--uses must be 0 or more and --expires-in more than 0")
        target, created = Cluster.objects.get_or_create(
            name=cluster,
            defaults={"kind": ClusterKind.NATIVE, "state": ClusterState.ONBOARDING, "identity": identity},
        )
        if created:
            self.stderr.write(f"Created cluster '{cluster}' (kind native, identity {identity}).")
        elif target.kind != ClusterKind.NATIVE:
            raise CommandError(
                f"Cluster '{cluster}' is of kind {target.kind}: its nodes are reported by a collector."
            )
        expires_at = timezone.now() + timedelta(seconds=expires_in) if expires_in else None
        token, plaintext = create_join_token(target, name=name, expires_at=expires_at, max_uses=uses or None)
        self.stderr.write(
            f"Valid until {token.expires_at:%Y-%m-%d %H:%M:%S %Z} for "
            + (f"{uses} machine(s)." if uses else "any number of machines.")
        )
        self.stdout.write(plaintext)
