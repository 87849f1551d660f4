"""An attempt as Kubernetes objects (pure: tested on plain dicts, no client involved).

One attempt is one ``batch/v1`` Job named ``orrery-<attempt id>`` in the cluster's namespace,
labelled with Orrery's job id, attempt id and the cluster's tag (``LABEL_*``), so a retried
delivery finds the Job it already created and two Orrery installations sharing a cluster never
touch each other's Jobs. ``backoffLimit: 0`` and ``restartPolicy: Never``: Orrery owns retries
(its failover policy may place the next attempt elsewhere).

Placement: **required node affinity on the node's name** (``matchFields metadata.name``, the
way the DaemonSet controller pins its pods), not ``spec.nodeName``. ``nodeName`` skips the
scheduler: no fit check against pods Orrery did not place, taints ignored, and a pod the
kubelet cannot admit (its GPUs taken by a pod the device plugin already served) fails at
once with ``OutOfnvidia.com/gpu`` instead of waiting. With affinity the scheduler still checks
the node has the GPUs free and tolerations match, and a pod that does not fit stays Pending
with the scheduler's reason, which Orrery shows on the job.

Gangs (several nodes): one **Indexed Job** (``completions = parallelism = nodes``) and a
headless Service named like the Job, so pod *i* answers at ``<job>-<i>.<job>``. One pod template
cannot pin each index to a different node, so the template allows exactly the chosen nodes
(node affinity) and forbids two of the gang's pods on one node (required pod anti-affinity on
``kubernetes.io/hostname``): every chosen node gets one pod, but which index lands where is the
scheduler's choice. Orrery's GPUs per node are the same on every node of a gang, so nothing
depends on it. (One Job per rank would pin each rank, at the price of N Jobs to create, watch
and delete per attempt, and no Job-level "all indices succeeded".) Each pod gets the launch
environment (``clusters.adapters.launch``): ``MASTER_ADDR`` (index 0's name), ``MASTER_PORT``
(the same on every pod: each has its own network), ``NODE_RANK`` (its completion index),
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``RANK``.

Security: no service account token is mounted, no service links; the container runs as a
non-root uid (``Identity``: the cluster's shared uid or the user's mapped uid) with no
privilege escalation, every capability dropped and the runtime's seccomp profile. Environment
comes from the job alone plus the ``ORRERY_*`` names, never from the control plane.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from typing import Any

from clusters.adapters.base import Share, Work
from clusters.adapters.kubernetes.gpus import GPU, MIG_PREFIX, MIG_STRATEGY_LABEL, RESOURCE_LABEL
from clusters.adapters.launch import HEAD_NAMES, LAUNCH_NAMES, launch_env, local_world_size
from clusters.adapters.mig import parse_profile

LABEL_JOB = "orrery.io/job-id"
LABEL_ATTEMPT = "orrery.io/attempt-id"
LABEL_TAG = "orrery.io/tag"
MANAGED_BY = {"app.kubernetes.io/managed-by": "orrery"}
CONTAINER = "main"
_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Which GPUs a container sees is the device plugin's to say, never the job's: with the NVIDIA
# runtime's environment-variable strategy, a job naming ``all`` would see GPUs others hold.
_DEVICE_VARIABLES = frozenset({"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"})


class ManifestError(ValueError):
    """The attempt cannot become a Job (no image, a bad variable name, root): trying again
    would not help."""


def job_name(attempt_id: str) -> str:
    """The Job (and Service) of an attempt: a DNS-1123 label (``orrery-`` + a lowercase UUID is
    43 characters; an indexed pod's hostname adds ``-<index>``, well under 63)."""
    return f"orrery-{attempt_id.lower()}"


def selector(tag: str) -> str:
    """The label selector of every object one Orrery cluster creates."""
    return f"{LABEL_TAG}={tag}"


def gpu_request(share: Share, node_labels: Mapping[str, str]) -> str:
    """The resource a pod asks for its node's share of GPUs by, on a node with these labels (the
    inventory's). Whole GPUs: the node's GPU resource (``orrery.io/gpu-resource``:
    ``nvidia.com/gpu``, or ``nvidia.com/gpu.shared`` on a time-sliced node the plugin renamed).
    MIG instances: ``nvidia.com/mig-<profile>`` (``nvidia.com/gpu`` under GFD's single strategy,
    where the instances are the node's GPUs). A fraction of a shared GPU: one unit of the node's
    GPU resource; the fraction itself is Orrery's accounting, kept by the device plugin's
    time-slicing or MPS only where the node runs them (``docs/clusters/kubernetes.md``).
    Raises ``ManifestError`` for a profile that is not one."""
    if not share.mig_profile:
        return node_labels.get(RESOURCE_LABEL) or GPU
    profile = parse_profile(share.mig_profile)
    if profile is None:
        raise ManifestError(f"not a MIG profile: {share.mig_profile!r}")
    return GPU if node_labels.get(MIG_STRATEGY_LABEL) == "single" else f"{MIG_PREFIX}{profile.name}"


def labels(work: Work, tag: str) -> dict[str, str]:
    return {LABEL_JOB: str(work.job_id), LABEL_ATTEMPT: work.attempt_id, LABEL_TAG: tag, **MANAGED_BY}


def job_manifest(
    work: Work,
    tag: str,
    *,
    uid: int,
    gid: int,
    gpu_resource: str = GPU,
    tolerated: Sequence[str] = (),
) -> dict[str, Any]:
    """The Job of an attempt, run as ``uid``/``gid`` (never 0), asking for its GPUs on each node
    (``Work.gpus_per_node``: GPUs, MIG instances, or one unit of a shared GPU) as
    ``gpu_resource`` (``gpu_request``). Raises ``ManifestError``."""
    if not work.image:
        raise ManifestError("a Kubernetes cluster runs container images only: this job gives no image")
    if not work.shares:
        raise ManifestError("the attempt holds no node")
    if uid <= 0 or gid < 0:
        raise ManifestError("refusing to run a user's work as root")
    name = job_name(work.attempt_id)
    nodes = len(work.shares)
    meta = labels(work, tag)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": {"nodeAffinity": _on_nodes(work.nodes)},
        # GPU nodes commonly carry this taint so that only GPU pods land there; the cluster's
        # ``tolerated_taints`` are those its operator lets Orrery's pods run under (the
        # inventory does not count them as a cordon either).
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            *({"key": str(key), "operator": "Exists"} for key in tolerated),
        ],
        "containers": [_container(work, name, gpu_resource)],
    }
    spec: dict[str, Any] = {"backoffLimit": 0, "template": {"metadata": {"labels": meta}, "spec": pod_spec}}
    if work.time_limit_s:
        spec["activeDeadlineSeconds"] = int(work.time_limit_s)
    if nodes > 1:
        spec |= {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes}
        pod_spec["subdomain"] = name
        pod_spec["affinity"]["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_ATTEMPT: work.attempt_id}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": meta},
        "spec": spec,
    }


def secret_manifest(work: Work, tag: str) -> dict[str, Any] | None:
    """The attempt's secret environment as a Secret named like its Job, or None when it has
    none. The Job's spec only refers to it (``secretKeyRef``), so reading Jobs or pods does not
    show a secret value; the adapter deletes the Secret with the Job."""
    values = {k: str(v) for k, v in work.env.items() if k in work.secret_names}
    if not values:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": job_name(work.attempt_id), "labels": labels(work, tag)},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()},
    }


def service_manifest(work: Work, tag: str) -> dict[str, Any]:
    """The headless Service that gives a gang's pods their DNS names (``<job>-<i>.<job>``);
    ``publishNotReadyAddresses`` so rank 0 is reachable before every pod is ready."""
    name = job_name(work.attempt_id)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(work, tag)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"batch.kubernetes.io/job-name": name},
        },
    }


def _on_nodes(nodes: tuple[str, ...]) -> dict[str, Any]:
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": sorted(set(nodes))}]}
            ]
        }
    }


def _container(work: Work, name: str, gpu_resource: str) -> dict[str, Any]:
    gpus = work.gpus_per_node
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if work.cpu_millicores:
        requests["cpu"] = f"{work.cpu_millicores}m"
    if work.memory_bytes:
        # A memory limit as well: a job past what it asked is OOMKilled (and says so) instead of
        # starving its neighbours. CPU is not limited: throttling a GPU feeder wastes the GPUs.
        requests["memory"] = limits["memory"] = str(work.memory_bytes)
    if gpus:
        limits[gpu_resource] = str(gpus)  # extended resources: requests default to limits
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": work.image,
        "env": _env(work, name),
        "resources": {k: v for k, v in (("requests", requests), ("limits", limits)) if v},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if work.script:
        container["command"] = ["/bin/sh", "-c", _rank_prelude(work) + work.script]
    return container


def _env(work: Work, name: str) -> list[dict[str, Any]]:
    """The job's own env, then the ``ORRERY_*`` names and the launch environment
    (``clusters.adapters.launch``), which the job's env cannot override. A gang's head is pod 0
    of the headless Service (``<job>-0.<job>``) and each pod's rank its completion index; a
    single pod is its own head (its pod IP)."""
    nodes = len(work.shares)
    plain = {
        "ORRERY_JOB_ID": str(work.job_id),
        "ORRERY_ATTEMPT": str(work.number),
        "ORRERY_ATTEMPT_ID": work.attempt_id,
        "ORRERY_GPUS_PER_NODE": str(work.gpus_per_node),
    } | launch_env(
        nnodes=nodes,
        gpus_per_node=work.gpus_per_node,
        master_port=work.master_port,
        node_rank=0 if nodes <= 1 else None,
        head_addr=f"{name}-0.{name}" if nodes > 1 else None,
    )
    own = {str(k): str(v) for k, v in work.env.items()}
    bad = [k for k in own if not _ENV_NAME.fullmatch(k)]
    if bad:
        raise ManifestError(f"not an environment variable name: {bad[0]!r}")
    own = {k: v for k, v in own.items() if k not in _DEVICE_VARIABLES and k not in LAUNCH_NAMES}
    if not work.gpus_per_node:
        plain["NVIDIA_VISIBLE_DEVICES"] = "void"  # no GPU asked: none visible, whatever the image says
    env = [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": name, "key": k}}}
        if k in work.secret_names
        else {"name": k, "value": v}
        for k, v in (own | plain).items()
    ]
    if nodes <= 1:
        pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        return env + [{"name": n, **pod_ip} for n in HEAD_NAMES]
    index = {"valueFrom": {"fieldRef": {"fieldPath": _INDEX}}}
    env += [{"name": "NODE_RANK", **index}, {"name": "ORRERY_NODE_RANK", **index}]
    if local_world_size(work.gpus_per_node) == 1:
        env.append({"name": "RANK", **index})  # else the script's first line (``_rank_prelude``)
    return env


def _rank_prelude(work: Work) -> str:
    """What a gang's script starts with where ``RANK`` is not its node's index (several GPUs a
    node): a Kubernetes env entry can copy a field but not multiply it."""
    local = local_world_size(work.gpus_per_node)
    if len(work.shares) <= 1 or local == 1:
        return ""
    return f'export RANK="$((NODE_RANK * {local}))"; '
