"""MIG instances as the kinds that only count them see them (Slurm's GRES, Kubernetes'
``nvidia.com/mig-<profile>`` resources): profile names read, and instances grouped into the GPUs
Orrery's resource model hangs them under. Pure: no Django.

**Profiles** are NVIDIA's names: ``<g>g.<memory>gb`` (``1g.10gb``, ``3g.40gb``, ``7g.80gb``),
with an optional compute-instance prefix (``1c.3g.40gb``) and suffix (``1g.10gb+me``, media
extensions; ``+gfx``). ``g`` is the instance's compute slices, of ``SLICES_PER_GPU`` on the GPUs
that have MIG (A100, H100, H200). Anything else is not a profile, and is ignored where one is
expected.

**Parent GPUs.** A cluster that only counts instances (``gpu:1g.10gb:14``,
``nvidia.com/mig-1g.10gb: 14``) does not say which physical GPU holds which. Orrery groups them
all the same, the way the hardware would: instances are packed largest first, each into the
first GPU with enough compute slices (7 a GPU) and memory slices (8 a GPU) left, a new GPU when
none has. A memory slice is an eighth of the GPU's memory when the cluster says how much that
is (``3g.40gb`` on an 80 GB GPU: 4), else the usual share of a profile of that many compute
slices (1, 2, 4, 4 and 8 for 1g, 2g, 3g, 4g and 7g). A count that fits real hardware gives as
many GPUs as the hardware has (14 × ``1g.10gb``: 2 GPUs; 2 × ``3g.40gb``: 1; 2 × ``4g.40gb``:
2; 2 × ``3g.40gb`` and a ``1g.10gb``: 2, the memory being spent). The grouping is a tally, as
GPU indices already are on Kubernetes: the cluster (Slurm's GRES plugin, the device plugin)
picks the physical instance; Orrery's count of free instances per profile is what placement
relies on.

An instance is reported in the shape the node agent reports one (``{"slot", "profile", "uuid",
"memory_mb", "slices"}``), with no UUID (the cluster names devices itself) and, when the
cluster does not say, a nominal memory (the profile's gigabytes × 1024 MiB).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLICES_PER_GPU = 7
MEMORY_SLICES_PER_GPU = 8
# A profile's memory slices by its compute slices, when the GPU's memory is not known.
_MEMORY_SLICES = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8}
_PROFILE = re.compile(r"^(?:[1-7]c\.)?([1-7])g\.([1-9][0-9]{0,3})gb(?:\+[a-z0-9]{1,8})?$", re.ASCII)


@dataclass(frozen=True)
class Profile:
    """A MIG profile: its name, compute slices and nominal memory."""

    name: str
    slices: int
    memory_mb: int


def parse_profile(name: Any) -> Profile | None:
    """``"3g.40gb"`` → ``Profile("3g.40gb", 3, 40960)``; None for anything that is not a profile
    (the name is kept as written, lower case: it is what the cluster is asked for)."""
    if not isinstance(name, str) or len(name) > 32:
        return None
    match = _PROFILE.fullmatch(name.strip().lower())
    if match is None:
        return None
    return Profile(name.strip().lower(), int(match.group(1)), int(match.group(2)) * 1024)


def memory_slices(profile: Profile, gpu_memory_mb: int = 0) -> int:
    """Eighths of the GPU's memory the profile takes (module docstring)."""
    if gpu_memory_mb > 0:
        return min(max(round(profile.memory_mb * MEMORY_SLICES_PER_GPU / gpu_memory_mb), 1), 8)
    return _MEMORY_SLICES[profile.slices]


def pack(
    counts: Mapping[str, int],
    *,
    max_gpus: int,
    memory_mb: Mapping[str, int] | None = None,
    gpu_memory_mb: int = 0,
) -> tuple[list[list[dict[str, Any]]], int]:
    """Instances of each profile (``counts``, names that are not profiles ignored) grouped into
    GPUs in MIG mode (module docstring): ``(GPUs, each its instances in the agent-report shape;
    how many instances did not fit in max_gpus GPUs)``. ``memory_mb`` gives a profile's memory
    where the cluster says it, ``gpu_memory_mb`` a whole GPU's (0: not known). Deterministic:
    the same counts give the same layout."""
    wanted: dict[Profile, int] = {}
    for name, count in counts.items():
        profile = parse_profile(name)
        if profile is not None and isinstance(count, int) and not isinstance(count, bool) and count > 0:
            wanted[profile] = wanted.get(profile, 0) + count
    gpus: list[list[dict[str, Any]]] = []
    room: list[tuple[int, int]] = []  # compute and memory slices left on each GPU
    dropped = 0
    for profile in sorted(wanted, key=lambda p: (-p.slices, -memory_slices(p, gpu_memory_mb), p.name)):
        count = wanted[profile]
        memory = (memory_mb or {}).get(profile.name) or profile.memory_mb
        need = (profile.slices, memory_slices(profile, gpu_memory_mb))
        for n in range(count):
            spot = next((i for i, left in enumerate(room) if left[0] >= need[0] and left[1] >= need[1]), None)
            if spot is None:
                if len(gpus) >= max_gpus:
                    dropped += count - n  # no GPU left to open: the rest of this profile is left out
                    break
                gpus.append([])
                room.append((SLICES_PER_GPU, MEMORY_SLICES_PER_GPU))
                spot = len(gpus) - 1
            room[spot] = (room[spot][0] - need[0], room[spot][1] - need[1])
            gpus[spot].append(
                {
                    "slot": len(gpus[spot]),
                    "profile": profile.name,
                    "uuid": "",
                    "memory_mb": int(memory),
                    "slices": profile.slices,
                }
            )
    return gpus, dropped


def layout_label(counts: Mapping[str, int]) -> str:
    """A node's MIG instances in a few words (``1g.10gb:7,3g.40gb:2``): a node label that changes
    whenever the layout does, so the inventory sees it changed."""
    return ",".join(
        f"{name}:{count}"
        for name, count in sorted(counts.items())
        if parse_profile(name) is not None and count > 0
    )
