"""MIG layouts as the agent and the server speak of them: profile names, layouts, and the
``nvidia-smi`` commands that make a GPU's layout what an operator wants.

A *profile* is the name NVIDIA gives a MIG instance: compute slices, ``g``, then its memory in
GB (``1g.10gb``, ``3g.40gb``, ``7g.80gb``), perhaps with a suffix for its engines (``1g.10gb+me``,
``1g.12gb-me``, ``1g.20gb+gfx``); the same grammar as a job's ``gpus: "a100:1g.10gb"``.
A *layout* is the list of profiles of one GPU's instances; ``[]`` is MIG off. Only instances
whose one compute instance spans the whole GPU instance are spoken of (what ``-cgi … -C``
makes), not compute instances cut smaller (``1c.3g.20gb``).

Standard library only: the agent imports this module, and so does the server.
"""

from __future__ import annotations

import re
import uuid

PROFILE = re.compile(r"^([1-8])g\.([1-9][0-9]{0,3})gb(?:[+-][a-z0-9]{1,8})?$", re.ASCII)
# The trailing profile of an NVML MIG device name ("NVIDIA A100-SXM4-80GB MIG 1g.10gb").
NAMED_PROFILE = re.compile(r"([1-8]g\.[1-9][0-9]{0,3}gb(?:[+-][a-z0-9]{1,8})?)\s*$", re.ASCII)
# A MIG instance's UUID as CUDA_VISIBLE_DEVICES takes it: "MIG-<uuid>" (or, from drivers
# before R470, "MIG-GPU-<uuid>/<GPU instance>/<compute instance>"); at most 64 characters.
MIG_UUID = re.compile(r"^MIG-[A-Za-z0-9/-]{1,60}$")
MAX_INSTANCES = 8  # per GPU: seven on an A100 or H100; the schema allows up to eight slices
MAX_SLICES = 8
FAKE_MEMORY_SHORTFALL_MB = 256  # a fake instance of NN GB has NN × 1024 − this MiB


class LayoutError(ValueError):
    """A profile or layout that is not one (the message says which and why)."""


def _parts(profile: object) -> tuple[int, int]:
    """(compute slices, GB) of a profile; ``LayoutError`` for anything else."""
    match = PROFILE.fullmatch(profile) if isinstance(profile, str) else None
    if match is None:
        raise LayoutError(f"{str(profile)[:40]!r} is not a MIG profile (like 1g.10gb or 3g.40gb+me)")
    return int(match.group(1)), int(match.group(2))


def slices(profile: str) -> int:
    """Compute slices of a profile (the ``N`` of ``Ng``); ``LayoutError`` for a non-profile."""
    return _parts(profile)[0]


def fake_memory_mb(profile: str) -> int:
    """What a fake instance of ``profile`` reports as its memory: its GB × 1024 less a little
    (a real ``1g.10gb`` has about 9.75 GiB)."""
    return _parts(profile)[1] * 1024 - FAKE_MEMORY_SHORTFALL_MB


def check_layout(profiles: object) -> list[str]:
    """``profiles`` as a layout: a list of at most ``MAX_INSTANCES`` profiles with at most
    ``MAX_SLICES`` compute slices in all (the driver has the last word on what fits where);
    ``LayoutError`` otherwise."""
    if not isinstance(profiles, list) or len(profiles) > MAX_INSTANCES:
        raise LayoutError(f"a MIG layout is a list of at most {MAX_INSTANCES} profiles")
    total = sum(slices(p) for p in profiles)
    if total > MAX_SLICES:
        raise LayoutError(f"{total} compute slices in all: a GPU has at most {MAX_SLICES}")
    return list(profiles)


def same_layout(a: list[str], b: list[str]) -> bool:
    """Whether two layouts have the same instances: the driver, not the order asked for, decides
    where each goes, so order does not count."""
    return sorted(a) == sorted(b)


def profile_of_name(name: str) -> str | None:
    """The profile at the end of an NVML MIG device name, None when there is none."""
    match = NAMED_PROFILE.search(name)
    return match.group(1) if match else None


def parse_fake_mig(spec: str) -> dict[int, list[str]]:
    """``--fake-mig "0:1g.10gb,1g.10gb,3g.40gb;1:7g.80gb"``: per GPU index, its layout (an index
    with nothing after the colon is in MIG mode without instances). ``LayoutError`` names the
    part that is wrong."""
    layouts: dict[int, list[str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        index, colon, profiles = part.partition(":")
        if not colon or not index.strip().isdigit() or int(index) > 63:
            raise LayoutError(f"{part[:40]!r}: expected GPU:PROFILE,PROFILE… (e.g. 0:1g.10gb,3g.40gb)")
        if int(index) in layouts:
            raise LayoutError(f"GPU {int(index)} appears twice")
        layouts[int(index)] = check_layout([p.strip() for p in profiles.split(",") if p.strip()])
    return layouts


def fake_instances(node: str, index: int, layout: list[str]) -> list[dict[str, object]]:
    """The instances of a fake GPU in MIG mode, as the agent reports them. UUIDs are stable for
    a node, GPU, slot and profile (``MIG-fake-<uuid5>``), so a restarted agent reports the same
    ones, and a changed layout gets new ones, as real hardware does."""
    return [
        {
            "slot": slot,
            "profile": profile,
            "uuid": f"MIG-fake-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{index}.{slot}.{profile}')}",
            "memory_mb": fake_memory_mb(profile),
            "slices": slices(profile),
        }
        for slot, profile in enumerate(layout)
    ]


def reconfigure_commands(nvidia_smi: str, index: int, layout: list[str], mig_on: bool) -> list[list[str]]:
    """The commands (argv lists, never shell strings) that give GPU ``index`` the layout: turn MIG
    mode on if it is off, destroy its compute instances then its GPU instances, and create one
    GPU instance per profile, each with its whole compute instance (``-C``); an empty layout
    turns MIG mode off instead. Destroying finds nothing to destroy on a GPU without instances:
    those two may fail, the others may not (``reconfigure`` in the agent's telemetry)."""
    if not layout and not mig_on:
        return []
    gpu = ["-i", str(index)]
    commands = [] if mig_on else [[nvidia_smi, *gpu, "-mig", "1"]]
    commands += [[nvidia_smi, "mig", *gpu, "-dci"], [nvidia_smi, "mig", *gpu, "-dgi"]]
    if layout:
        commands.append([nvidia_smi, "mig", *gpu, "-cgi", ",".join(check_layout(layout)), "-C"])
    elif mig_on:
        commands.append([nvidia_smi, *gpu, "-mig", "0"])
    return commands


def may_fail(command: list[str]) -> bool:
    """Whether a command of ``reconfigure_commands`` may fail without the change failing."""
    return command[-1] in ("-dci", "-dgi")
