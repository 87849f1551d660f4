from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from clusters.adapters.slurm.api import SlurmError
from clusters.choices import Identity
from clusters.services.onboarding import onboard_slurm


class Command(BaseCommand):
    help = "Add a cluster after testing the connection. Kinds: slurm (slurmrestd URL and a JWT)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--kind", required=True, choices=["slurm"])
        parser.add_argument("--name", required=True)
        parser.add_argument("--url", required=True, help="slurmrestd, e.g. http://slurm-head:6820")
        parser.add_argument("--token-file", required=True, type=Path, help="a file holding the JWT")
        parser.add_argument("--user", default="root", help="the Slurm user Orrery acts as")
        parser.add_argument(
            "--slurm-conf", default="", help="slurm.conf for the sbatch client (pins node lists)"
        )
        parser.add_argument(
            "--identity",
            choices=Identity.values,
            default=None,
            help="whose POSIX account users' work runs under (a new cluster: accounts; "
            "an existing one keeps its own)",
        )
        parser.add_argument(
            "--output-dir",
            default="",
            help="where users' output goes, with {home} and {user} (default {home}/.orrery/slurm)",
        )

    def handle(
        self,
        *args,
        kind: str,
        name: str,
        url: str,
        token_file: Path,
        user: str,
        slurm_conf: str,
        identity: str | None,
        output_dir: str,
        **options,
    ) -> None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise CommandError(f"cannot read {token_file}: {exc}") from exc
        try:
            cluster, collected = onboard_slurm(
                name, url, token, user=user, slurm_conf=slurm_conf, identity=identity, output_dir=output_dir
            )
        except SlurmError as exc:
            if exc.field == "output_dir":
                raise CommandError(str(exc)) from exc
            raise CommandError(f"connection test failed: {exc}") from exc
        api = cluster.config["api"]
        self.stdout.write(
            f"Cluster {cluster.name} (slurm, {api}): {collected.nodes} nodes, {collected.gpus} GPUs."
        )
        self.stdout.write(f"Users' work runs under: {cluster.get_identity_display()}.")
        if collected.unknown_gpu_types:
            self.stderr.write(
                "GPU types not in the catalog (their GPUs are not scheduled): "
                + ", ".join(collected.unknown_gpu_types)
            )
