"""Whose Slurm job it is: the POSIX account an attempt runs as, resolved on the submit host, and
where that account's output lives.

The control-plane host that submits is a Slurm login node in all but name: it shares the
cluster's user database, holds its munge key and runs as root, so that ``sbatch --uid`` can
submit for a user. A user's work never runs as root, and never under a name the host cannot
resolve: such an attempt fails at once (``NoAccount``) rather than being tried again forever.

Output files live in the account's own directory (``{home}/.orrery/slurm`` unless the cluster
says otherwise), created by the account itself and readable by it only. The control plane reads
them back as root, so it opens a file only if it is a regular file owned by that account and
never follows a symbolic link there: a user cannot point it at anything they could not read.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusters.adapters.slurm.api import SlurmError

#: Where a user's output goes unless the cluster sets ``config["output_dir"]``.
DEFAULT_OUTPUT_DIR = "{home}/.orrery/slurm"
_PLACEHOLDER = re.compile(r"\{(home|user)\}")


class NoAccount(SlurmError):
    """The attempt has no account it may run as on this host: it fails, it is not retried."""


@dataclass(frozen=True)
class Account:
    """A POSIX account of the submit host. ``shared`` is the service account the control plane
    itself runs as (a cluster whose identity is ``shared``): ``sbatch`` runs as it, unchanged."""

    name: str
    uid: int
    gid: int
    home: str
    shared: bool = False


def account_for(run_as: str | None, cluster_name: str) -> Account:
    """The account ``Work.run_as`` names, as this host's user database has it (a name; "" for
    the service account itself). Raises ``NoAccount`` for no account (None), a name the host
    does not know, or root (uid or primary gid 0)."""
    if run_as is None:
        raise NoAccount(
            f"the job's owner has no POSIX account on cluster '{cluster_name}' (any more): an "
            "operator must map them to one before it can run there"
        )
    if run_as == "":
        me = pwd.getpwuid(os.geteuid())
        if me.pw_uid == 0:
            raise NoAccount(
                f"cluster '{cluster_name}' has a shared identity and the Orrery host submits as root: "
                "users' work never runs as root (map accounts, or run the dispatcher as a service account)"
            )
        return Account(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, shared=True)
    try:
        entry = pwd.getpwnam(run_as)
    except KeyError:
        raise NoAccount(
            f"no user '{run_as}' on the Orrery host that submits to cluster '{cluster_name}': it must "
            "share the cluster's user database"
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise NoAccount(f"refusing to run a user's work as root ('{run_as}' has uid or group 0)")
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def check_output_dir(template: str) -> str:
    """``template`` if it is a valid output directory template (an absolute path; ``{home}`` and
    ``{user}`` the only placeholders); raises ``SlurmError`` (field ``output_dir``) otherwise."""
    rest = _PLACEHOLDER.sub("x", template)
    if not template.startswith(("/", "{home}")) or "{" in rest or "}" in rest:
        raise SlurmError(
            "the output directory must be an absolute path, with {home} and {user} as its only "
            f"placeholders: {template!r}",
            "output_dir",
        )
    if ".." in Path(rest).parts or "\n" in template:
        raise SlurmError(f"the output directory cannot contain '..' or a newline: {template!r}", "output_dir")
    return template


def output_dir(template: str, account: Account) -> Path:
    """The directory ``template`` names for ``account`` (both placeholders replaced in one pass,
    so a home that happens to contain ``{user}`` is not read twice)."""
    values = {"home": account.home.rstrip("/") or "/", "user": account.name}
    return Path(_PLACEHOLDER.sub(lambda m: values[m.group(1)], check_output_dir(template)))


def output_path(config: Mapping[str, Any], account: Account, attempt_id: str) -> Path:
    """Where the output of an attempt running as ``account`` goes: the cluster's
    ``config["output_dir"]`` template if it has one, else the account's ``{home}/.orrery/slurm``;
    the shared service account keeps ``$ORRERY_SLURM_OUTPUT_DIR`` (default ``/tmp``)."""
    template = config.get("output_dir") or ("" if account.shared else DEFAULT_OUTPUT_DIR)
    if template:
        directory = output_dir(str(template), account)
    else:
        directory = Path(os.environ.get("ORRERY_SLURM_OUTPUT_DIR") or "/tmp")
    return directory / f"orrery-{attempt_id}.out"


def make_output_dir(directory: Path, account: Account) -> None:
    """Create ``directory`` (and its missing parents) as ``account`` itself, readable by it only.
    Run as the account, never as root: a symbolic link the user planted on the way leads only
    where the user could write anyway. An existing directory is left as it is."""
    if account.shared:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    if os.geteuid() != 0:
        raise SlurmError(f"submitting as '{account.name}' needs root on the Orrery host (sbatch --uid)")
    done = subprocess.run(
        ["mkdir", "-p", "--", str(directory)],
        capture_output=True,
        text=True,
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        umask=0o077,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    if done.returncode != 0:
        raise SlurmError(f"cannot create {directory} as '{account.name}': {done.stderr.strip()[:300]}")


def read_tail(path: Path, owner: int, limit: int) -> tuple[int, bytes] | None:
    """The last ``limit`` bytes of ``path`` and where they start, or None when there is no such
    file, or it is not a regular file owned by ``owner`` (a link, a FIFO, someone else's file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # missing (not written yet), a symbolic link (ELOOP), or unreadable
    with os.fdopen(fd, "rb") as f:
        seen = os.fstat(fd)
        if not stat.S_ISREG(seen.st_mode) or seen.st_uid != owner:
            return None
        start = max(seen.st_size - limit, 0)
        f.seek(start)
        return start, f.read(limit)
