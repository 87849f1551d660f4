from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from clusters.adapters.kubernetes.client import KubeError
from clusters.adapters.slurm.api import SlurmError
from clusters.choices import Identity
from clusters.services.onboarding import onboard_kubernetes, onboard_slurm


class Command(BaseCommand):
    help = (
        "Add a cluster after testing the connection. Kinds: slurm (slurmrestd URL and a JWT), "
        "kubernetes (a kubeconfig, or the API server URL, its CA and a bearer token)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--kind", required=True, choices=["slurm", "kubernetes"])
        parser.add_argument("--name", required=True)
        parser.add_argument(
            "--url",
            default="",
            help="slurmrestd (http://slurm-head:6820) or the Kubernetes API server (https://…)",
        )
        parser.add_argument("--token-file", type=Path, help="a file holding the JWT or the bearer token")
        parser.add_argument("--user", default="root", help="slurm: the Slurm user Orrery acts as")
        parser.add_argument(
            "--slurm-conf", default="", help="slurm: slurm.conf for the sbatch client (pins node lists)"
        )
        parser.add_argument(
            "--identity",
            choices=Identity.values,
            default=None,
            help="whose POSIX account users' work runs under (a new cluster: accounts on Slurm, shared on "
            "Kubernetes; an existing one keeps its own)",
        )
        parser.add_argument(
            "--output-dir",
            default="",
            help="slurm: where users' output goes, with {home} and {user} (default {home}/.orrery/slurm)",
        )
        parser.add_argument(
            "--gpu-type", default=None, help="slurm: the catalog's name for GPUs whose GRES names no type"
        )
        parser.add_argument(
            "--shards-per-gpu",
            type=int,
            default=None,
            help="slurm: shards a GPU has (Gres=gpu:N,shard:M: M/N), for jobs asking for a fraction of one",
        )
        parser.add_argument(
            "--mig-gres-type",
            action="append",
            default=[],
            metavar="PROFILE=TYPE",
            help="slurm: the site's GRES type of a MIG profile (1g.10gb=a100_1g.10gb), when not what "
            "the nodes report; repeat for more",
        )
        parser.add_argument(
            "--kubeconfig", type=Path, help="kubernetes: a kubeconfig file (credentials inline)"
        )
        parser.add_argument("--ca-file", type=Path, help="kubernetes: the API server's CA bundle (PEM)")
        parser.add_argument("--namespace", default="orrery", help="kubernetes: the namespace Orrery owns")
        parser.add_argument("--run-as-user", type=int, default=None, help="kubernetes: the uid pods run as")
        parser.add_argument("--run-as-group", type=int, default=None, help="kubernetes: the gid pods run as")

    def handle(self, *args, kind: str, **options) -> None:
        if kind == "kubernetes":
            self._kubernetes(**options)
        else:
            self._slurm(**options)

    def _slurm(
        self,
        *,
        name: str,
        url: str,
        token_file: Path | None,
        user: str,
        slurm_conf: str,
        identity: str | None,
        output_dir: str,
        gpu_type: str | None,
        shards_per_gpu: int | None,
        mig_gres_type: list[str],
        **options,
    ) -> None:
        if not url or token_file is None:
            raise CommandError("a Slurm cluster needs --url and --token-file")
        token = _read(token_file)
        gres: dict[str, Any] = {"gpu_type": gpu_type, "shards_per_gpu": shards_per_gpu}
        if mig_gres_type:
            pairs = [item.partition("=") for item in mig_gres_type]
            if any(not sep for _, sep, _ in pairs):
                raise CommandError("--mig-gres-type takes PROFILE=TYPE (1g.10gb=a100_1g.10gb)")
            gres["mig_gres_types"] = {profile: gres_type for profile, _, gres_type in pairs}
        try:
            cluster, collected = onboard_slurm(
                name,
                url,
                token,
                user=user,
                slurm_conf=slurm_conf,
                identity=identity,
                output_dir=output_dir,
                gres={k: v for k, v in gres.items() if v is not None},
            )
        except SlurmError as exc:
            if exc.field in ("output_dir", "gres"):
                raise CommandError(str(exc)) from exc
            raise CommandError(f"connection test failed: {exc}") from exc
        api = cluster.config["api"]
        self.stdout.write(
            f"Cluster {cluster.name} (slurm, {api}): {collected.nodes} nodes, {collected.gpus} GPUs."
        )
        self._identity(cluster, collected)

    def _kubernetes(
        self,
        *,
        name: str,
        url: str,
        token_file: Path | None,
        identity: str | None,
        kubeconfig: Path | None,
        ca_file: Path | None,
        namespace: str,
        run_as_user: int | None,
        run_as_group: int | None,
        **options,
    ) -> None:
        if kubeconfig is None and (not url or token_file is None):
            raise CommandError(
                "a Kubernetes cluster needs --kubeconfig, or --url, --token-file and --ca-file"
            )
        try:
            cluster, collected = onboard_kubernetes(
                name,
                kubeconfig=_read(kubeconfig) if kubeconfig else "",
                url=url,
                token=_read(token_file) if token_file else "",
                ca=_read(ca_file) if ca_file else "",
                namespace=namespace,
                identity=identity,
                run_as_uid=run_as_user,
                run_as_gid=run_as_group,
            )
        except KubeError as exc:
            prefix = "connection test failed: " if exc.apiserver or exc.field == "url" else ""
            raise CommandError(f"{prefix}{exc} ({exc.field})" if exc.field else f"{prefix}{exc}") from exc
        self.stdout.write(
            f"Cluster {cluster.name} (kubernetes, {cluster.config['api']}, namespace {namespace}): "
            f"{collected.nodes} nodes, {collected.gpus} GPUs."
        )
        self._identity(cluster, collected)

    def _identity(self, cluster, collected) -> None:
        self.stdout.write(f"Users' work runs under: {cluster.get_identity_display()}.")
        if collected.unknown_gpu_types:
            self.stderr.write(
                "GPU types not in the catalog (their GPUs are not scheduled): "
                + ", ".join(collected.unknown_gpu_types)
            )


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc}") from exc
