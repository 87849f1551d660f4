"""MIG instances: the rows kept in line with what nodes report, and the layouts operators want.

* ``sync_mig_instances`` — make a node's ``MigInstance`` rows match the instances it reports,
  slot by slot (called by ``upsert_node``). An instance an active allocation holds is never
  changed nor deleted: if the node reports something else in its slot, the row stays as it is
  and the change is logged; it is taken up at the next report after the allocation ends. An
  instance that is gone or changed is deleted, and the released allocations that named it
  forget it (the scheduling app's port ``retire_mig_instances``: what holds an instance is its
  business). A change of layout is written to the node's history (a ``NodeEvent``).
* ``check_mig_layout`` / ``want_mig_layout`` — an operator's wish for a GPU's layout
  (``GpuDevice.mig_layout_wanted``: a list of profiles, ``[]`` MIG off, None leave it be),
  checked when it is set: NVIDIA's A100 and H100 have 7 compute slices and up to 7 instances,
  and a layout that asks for more can never be applied. Whether a profile exists on a given
  model is the GPU's to say: the agent reports what it applied. The node's agent applies a wish
  once no attempt holds the GPU, then describes itself again.
* ``mig_layouts_for_node`` — what a heartbeat's answer tells a node: the wanted layouts of its
  GPUs whose reported layout differs. Only nodes with a wish ask (``NodeIdentity.mig_wanted``),
  and the answer is cached per node like ``desired`` (one indexed query per miss), dropped when
  the node describes itself or a wish changes through ``want_mig_layout`` (a console edit is
  seen within ``LAYOUTS_TTL_S``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import transaction

from clusters import ports
from clusters.agent.mig import PROFILE, LayoutError, check_layout, same_layout, slices
from clusters.models import GpuDevice, MigInstance, Node, NodeEvent

log = logging.getLogger(__name__)
LAYOUTS_TTL_S = 30
MAX_SLICES = 7  # what an operator may ask of one GPU
MAX_INSTANCES = 7


@dataclass(frozen=True)
class MigDescription:
    """One MIG instance as its node reports it (validated by the caller)."""

    slot: int
    profile: str
    uuid: str
    memory_mb: int
    slices: int


def sync_mig_instances(
    node: Node,
    devices: dict[int, GpuDevice],
    described: dict[int, tuple[MigDescription, ...] | None],
) -> None:
    """Make the MIG mode and instance rows of ``devices`` (the node's GPUs by index, saved)
    match ``described`` (by index: the instances reported, None for a GPU not in MIG mode); see
    the module. A GPU reported out of MIG mode while an instance of it is held stays in MIG mode
    until it is released. Idempotent."""
    by_gpu: dict[int, dict[int, MigInstance]] = defaultdict(dict)
    for row in MigInstance.objects.filter(gpu__in=list(devices.values())):
        by_gpu[row.gpu_id][row.slot] = row
    reported = {index: {m.slot: m for m in described.get(index) or ()} for index in devices}
    stale = [
        row
        for index, device in devices.items()
        for slot, row in by_gpu[device.pk].items()
        if (m := reported[index].get(slot)) is None or (m.profile, m.uuid) != (row.profile, row.uuid)
    ]
    held = ports.retire_mig_instances()([row.pk for row in stale]) if stale else set()
    gone = {row.pk for row in stale if row.pk not in held}
    if gone:
        MigInstance.objects.filter(pk__in=gone).delete()
    new: list[MigInstance] = []
    modes: dict[bool, list[int]] = {True: [], False: []}
    changes = []
    for index, device in devices.items():
        rows = by_gpu[device.pk]
        kept = {slot: row for slot, row in rows.items() if row.pk in held}
        for slot in sorted(kept):
            log.warning("%s GPU %d: MIG slot %d is held; its reported change waits", node.name, index, slot)
        for slot, m in reported[index].items():
            row = rows.get(slot)
            if slot in kept:
                continue
            if row is not None and row.pk not in gone:  # the same instance: its sizes may be new
                if (row.memory_mb, row.slices) != (m.memory_mb, m.slices):
                    MigInstance.objects.filter(pk=row.pk).update(memory_mb=m.memory_mb, slices=m.slices)
                continue
            new.append(
                MigInstance(
                    gpu=device,
                    slot=slot,
                    profile=m.profile,
                    uuid=m.uuid,
                    memory_mb=m.memory_mb,
                    slices=m.slices,
                )
            )
        mig_on = described.get(index) is not None or bool(kept)
        now = sorted(
            [r.profile for r in kept.values()]
            + [m.profile for s, m in reported[index].items() if s not in kept]
        )
        if (device.mig_enabled, sorted(r.profile for r in rows.values())) != (mig_on, now):
            changes.append(f"GPU {index} MIG " + (",".join(now) or "on, no instances" if mig_on else "off"))
        if device.mig_enabled != mig_on:
            modes[mig_on].append(device.pk)
    _create(node, new)
    for mig_on, pks in modes.items():
        if pks:
            GpuDevice.objects.filter(pk__in=pks).update(mig_enabled=mig_on)
    if changes:
        NodeEvent.objects.create(
            node=node, from_state=node.state, to_state=node.state, reason="; ".join(changes)[:255]
        )
    transaction.on_commit(lambda: forget_mig_layouts(node.pk))


def _create(node: Node, new: list[MigInstance]) -> None:
    """Create the new rows, but none whose UUID another instance has (a node reporting what is
    not its own): that one is left out and logged, and the rest of the report stands."""
    # Instances a collector reports have no UUID (Slurm, Kubernetes): "" is nobody's.
    taken = set(
        MigInstance.objects.filter(uuid__in=[row.uuid for row in new if row.uuid]).values_list(
            "uuid", flat=True
        )
    )
    for row in new:
        if row.uuid and row.uuid in taken:
            log.warning("%s reports MIG instance %s, which is another GPU's: left out", node.name, row.uuid)
    MigInstance.objects.bulk_create([row for row in new if not row.uuid or row.uuid not in taken])


def check_mig_layout(value: Any) -> list[str] | None:
    """The layout as stored (profiles lowercased), or None to leave the layout as it is; raises
    ``ValidationError`` saying what is wrong."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValidationError(
            'A MIG layout is a list of profiles, e.g. ["3g.40gb", "3g.40gb"] ([] turns MIG off).'
        )
    profiles = []
    for i, item in enumerate(value):
        profile = item.strip().lower() if isinstance(item, str) else ""
        if not PROFILE.fullmatch(profile):
            raise ValidationError(f"Item {i + 1} is not a MIG profile such as 1g.10gb or 3g.40gb.")
        profiles.append(profile)
    total = sum(slices(p) for p in profiles)
    if len(profiles) > MAX_INSTANCES or total > MAX_SLICES:
        raise ValidationError(
            f"A GPU holds at most {MAX_INSTANCES} instances and {MAX_SLICES} compute slices; "
            f"this layout asks for {len(profiles)} instances and {total} slices."
        )
    return profiles


@transaction.atomic
def want_mig_layout(gpu: GpuDevice, layout: list[str] | None, *, actor: Any = None) -> GpuDevice:
    """Ask for ``layout`` on ``gpu`` (profiles; ``[]`` MIG off; None: leave the layout as it is),
    checked by ``check_mig_layout`` (``ValidationError``). The node's agent learns of it within
    ``CACHE_TTL_S`` seconds of its credential cache and applies it once the GPU is idle."""
    gpu.mig_layout_wanted = check_mig_layout(layout)
    gpu.save(update_fields=["mig_layout_wanted"])
    log.info("%s GPU %d: MIG layout %s wanted (by %s)", gpu.node_id, gpu.index, layout, actor or "the system")
    transaction.on_commit(lambda: forget_mig_layouts(gpu.node_id))
    return gpu


def mig_layouts_for_node(node_id: int) -> list[dict[str, Any]]:
    """``[{"gpu": index, "profiles": [...]}]`` for the node's GPUs whose wanted layout differs
    from the one reported (cached; see the module)."""
    key = _key(node_id)
    cached = cache.get(key)
    if cached is None:
        cached = _layouts(node_id)
        cache.set(key, cached, LAYOUTS_TTL_S)
    return cached


def _layouts(node_id: int) -> list[dict[str, Any]]:
    """One query on the GPUs' node index: the GPUs with a wish, joined to their instances."""
    gpus: dict[int, tuple[Any, bool, list[str]]] = {}
    for index, wanted, enabled, profile in GpuDevice.objects.filter(
        node_id=node_id, mig_layout_wanted__isnull=False
    ).values_list("index", "mig_layout_wanted", "mig_enabled", "mig_instances__profile"):
        gpus.setdefault(index, (wanted, enabled, []))[2].extend([profile] if profile else [])
    out = []
    for index, (wanted, enabled, profiles) in sorted(gpus.items()):
        try:
            layout = check_layout(wanted)
        except LayoutError as exc:  # written around the service (a raw edit): not sent to the node
            log.error("node %d GPU %d: the wanted MIG layout %r is not one: %s", node_id, index, wanted, exc)
            continue
        if enabled != bool(layout) or not same_layout(profiles, layout):
            out.append({"gpu": index, "profiles": layout})
    return out


def forget_mig_layouts(node_id: int) -> None:
    cache.delete(_key(node_id))


def _key(node_id: int) -> str:
    return f"orrery:mig-layouts:{node_id}"
