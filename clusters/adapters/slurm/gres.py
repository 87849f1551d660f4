"""Slurm's GRES in Orrery's terms, both ways (pure: tested on recorded and constructed strings).

**Reading a node's GRES** (``gres`` as slurmrestd and ``scontrol show node`` give it: entries
``name[:type]:count[(S:…)]`` joined by commas). ``gpu`` entries are GPUs; ``shard`` entries
count the node's shards. A GPU entry's type is one of:

* a GPU type (``gpu:a100:4``): whole GPUs of that type, mapped through the catalog's aliases;
* a MIG type (``gpu:1g.10gb:7``, ``gpu:a100_3g.20gb:2``, ``gpu:nvidia_a100_3g.20gb:2``):
  instances of that profile. With ``AutoDetect=nvml`` Slurm's MIG types are substrings of the
  "MIG Profile" string slurmd logs (``nvidia_a100_3g.20gb``): the profile is the type's end,
  what comes before the last ``_`` the GPU type of the parent (``a100``; ``nvidia_`` dropped);
* none (``gpu:4``): whole GPUs of the cluster's ``gpu_type`` (``Cluster.config``), if it says.

Entries that match none of this (a malformed count, a type with odd characters, a count past
any real node) are ignored: a node's GRES never stops an inventory pass.

**Asking for GPUs** (``gres_request``): whole GPUs ``gpu[:type]:N``; MIG instances
``gpu:<the node's type for the profile>:N`` (``Cluster.config["mig_gres_types"]`` maps a
profile to the site's type name where it differs from what the node reports); a fraction of a
shared GPU ``shard:N`` with ``N = ⌈share × shards_per_gpu⌉`` (``Cluster.config
["shards_per_gpu"]``), refused (``GresRefused``) on a cluster that does not say it has shards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusters.adapters.base import Share
from clusters.adapters.mig import parse_profile
from clusters.adapters.slurm.api import SlurmError

MAX_COUNT = 4096  # past any real node: an entry counting more is nonsense, and ignored
MAX_GRES_CHARS = 4096
_ENTRY = re.compile(r"^(gpu|shard)(?::([A-Za-z0-9_.+-]{1,64}))?:([0-9]{1,7})(?:\([^()]{0,256}\))?$")
_TYPE_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")
_VENDOR_PREFIX = "nvidia_"


class GresRefused(SlurmError):
    """The attempt cannot be asked of this Slurm cluster as it is set up: trying again would not
    help (the dispatcher fails it at once, with this message)."""


@dataclass(frozen=True)
class MigEntry:
    """Instances of one profile on a node: Slurm's type name for them, and how many."""

    gres_type: str
    count: int
    parent_type: str | None  # the GPU type the type names ("a100"), None when it names none


@dataclass(frozen=True)
class NodeGres:
    """What a node's GRES offers: whole GPUs by type (None: untyped), MIG instances by profile,
    and shards."""

    gpus: dict[str | None, int] = field(default_factory=dict)
    mig: dict[str, MigEntry] = field(default_factory=dict)
    shards: int = 0

    @property
    def gpu_type(self) -> str | None:
        """The type of the node's whole GPUs: the first entry's (Orrery has one model a node)."""
        return next(iter(self.gpus), None)

    def mig_type(self, profile: str) -> str:
        """Slurm's type name for the node's instances of ``profile`` ("" when it has none)."""
        entry = self.mig.get(profile)
        return entry.gres_type if entry else ""


def split_entries(gres: str) -> list[str]:
    """Comma-separated entries, commas inside parentheses kept (``gpu:a100:4(S:0,2)``)."""
    entries, depth, start = [], 0, 0
    for i, char in enumerate(gres):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            entries.append(gres[start:i])
            start = i + 1
    entries.append(gres[start:])
    return [e.strip() for e in entries if e.strip()]


def mig_type(gres_type: str) -> tuple[str | None, str] | None:
    """``"a100_3g.20gb"`` → ``("a100", "3g.20gb")``; ``"1g.10gb"`` → ``(None, "1g.10gb")``;
    None for a type that names no MIG profile (``"a100"``)."""
    head, _, tail = gres_type.rpartition("_")
    profile = parse_profile(tail)
    if profile is None:
        return None
    parent = head.lower().removeprefix(_VENDOR_PREFIX) if head else None
    return (parent or None), profile.name


def parse_node_gres(gres: Any) -> NodeGres:
    """A node's GRES string in Orrery's terms (module docstring); anything unreadable counts for
    nothing."""
    if not isinstance(gres, str) or len(gres) > MAX_GRES_CHARS:
        return NodeGres()
    gpus: dict[str | None, int] = {}
    mig: dict[str, MigEntry] = {}
    shards = 0
    for entry in split_entries(gres):
        match = _ENTRY.fullmatch(entry)
        if match is None:
            continue
        name, gres_type, count = match.group(1), match.group(2), int(match.group(3))
        if not 0 < count <= MAX_COUNT:
            continue
        if name == "shard":
            shards += count
            continue
        found = mig_type(gres_type) if gres_type else None
        if found is None:
            gpus[gres_type] = gpus.get(gres_type, 0) + count
            continue
        parent, profile = found
        known = mig.get(profile)
        if known is None or known.gres_type == gres_type:
            mig[profile] = MigEntry(gres_type, (known.count if known else 0) + count, parent)
    return NodeGres(gpus, mig, shards)


def gres_request(
    share: Share,
    *,
    gpu_type: str = "",
    node_mig_types: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> str:
    """The ``--gres`` value asking for one node's share of an attempt ("" for none), on a node
    whose whole GPUs are of ``gpu_type`` and whose MIG types are ``node_mig_types`` (profile →
    Slurm type). Raises ``GresRefused`` for what this cluster cannot be asked."""
    config = config or {}
    if share.mig_profile:
        profile = parse_profile(share.mig_profile)
        if profile is None:
            raise GresRefused(f"not a MIG profile: {share.mig_profile!r}")
        site = config.get("mig_gres_types") or {}
        site = site if isinstance(site, Mapping) else {}
        name = site.get(profile.name) or (node_mig_types or {}).get(profile.name) or profile.name
        return f"gpu:{_type_name(name, 'mig_gres_types')}:{len(share.gpu_indices)}"
    if share.gpu_memory_mb > 0:
        return f"shard:{shards_for(share.gpu_share, config.get('shards_per_gpu'))}"
    if not share.gpu_indices:
        return ""
    count = len(share.gpu_indices)
    return f"gpu:{_type_name(gpu_type, 'gpu type')}:{count}" if gpu_type else f"gpu:{count}"


def shards_for(share: float, shards_per_gpu: Any) -> int:
    """Shards for ``share`` of a GPU: ``⌈share × shards_per_gpu⌉``, at least 1, at most a whole
    GPU's. ``GresRefused`` when the cluster does not say how many shards a GPU has."""
    if isinstance(shards_per_gpu, bool) or not isinstance(shards_per_gpu, int) or shards_per_gpu <= 0:
        raise GresRefused(
            "this Slurm cluster has no shards configured for shared GPUs: an operator sets "
            "shards_per_gpu in the cluster's settings (Slurm's GresTypes=shard), or the job asks "
            "for whole GPUs or MIG instances"
        )
    if not 0 < share <= 1:
        return shards_per_gpu  # the fraction is unknown (or whole): the whole GPU's shards
    # Rounded first: 0.3 × 10 is 3.0000000000000004 in binary, and must ask 3 shards, not 4.
    return min(max(math.ceil(round(share * shards_per_gpu, 6)), 1), shards_per_gpu)


#: The cluster settings (``Cluster.config``) that say how its GPUs are named and shared.
SETTINGS = ("gpu_type", "mig_gres_types", "shards_per_gpu")
MAX_SHARDS_PER_GPU = 10_000


def check_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU settings of a Slurm cluster, checked (``SETTINGS``; None or empty drops one):
    ``gpu_type``, the catalog's name for GPUs whose GRES names no type; ``mig_gres_types``,
    ``{profile: the site's GRES type}``; ``shards_per_gpu``, how many shards a GPU has (Slurm's
    ``Gres=gpu:N,shard:M``: M ÷ N). Raises ``SlurmError`` (field ``gres``) saying what is wrong."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if key not in SETTINGS:
            raise SlurmError(f"not a GPU setting of a Slurm cluster: {key!r}", "gres")
        if value in (None, "", {}, 0):
            continue
        if key == "gpu_type":
            out[key] = _setting_name(value, "gpu_type")
        elif key == "shards_per_gpu":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SHARDS_PER_GPU:
                raise SlurmError(
                    f"shards_per_gpu must be a whole number from 1 to {MAX_SHARDS_PER_GPU}", "gres"
                )
            out[key] = value
        else:
            if not isinstance(value, Mapping) or len(value) > 64:
                raise SlurmError("mig_gres_types maps MIG profiles to GRES types (at most 64)", "gres")
            types = {}
            for profile, gres_type in value.items():
                found = parse_profile(profile)
                if found is None:
                    raise SlurmError(f"mig_gres_types: not a MIG profile: {str(profile)[:40]!r}", "gres")
                types[found.name] = _setting_name(gres_type, f"mig_gres_types[{found.name}]")
            out[key] = types
    return out


def _setting_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _TYPE_NAME.fullmatch(value):
        raise SlurmError(
            f"{what} must be a GRES type name (letters, digits, . _ + -): {str(value)[:40]!r}", "gres"
        )
    return value


def _type_name(name: str, what: str) -> str:
    """A GRES type as it may appear in ``--gres`` (a comma or colon would ask for more)."""
    if not _TYPE_NAME.fullmatch(name):
        raise GresRefused(f"not a Slurm GRES type name ({what}): {name!r}")
    return name
