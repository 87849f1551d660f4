"""From a parsed spec to job requests: resolve names against the database and refuse what can
never run, each refusal naming the field at fault. Access (may this user use this project and
queue?) is decided by the caller; this module only checks that the names exist and fit."""

from __future__ import annotations

import math
from typing import Any

from clusters import facts
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.models import GpuModel, Node
from clusters.selectors import gpu_capacity_histogram, mig_capacity, shareable_memory_mb
from clusters.services.identity import eligible_clusters
from scheduling.models import Queue
from scheduling.services import budgets
from scheduling.services.jobs import JobRequest
from scheduling.spec import JobSpec, SpecError


def build_requests(
    spec: JobSpec,
    queue: Queue,
    *,
    owner: Any,
    path: str = "",
    models: dict[Any, Any] | None = None,
    privileged: bool = False,
) -> list[JobRequest]:
    """One ``JobRequest`` per job the spec makes (an array makes many); raises ``SpecError``.
    ``owner`` is the submitting user: the job goes only to clusters where that user has a POSIX
    account. ``privileged`` (a manager of the queue's project, or an operator; decided by the
    caller) may ask for a priority above the queue's limit for members. ``models`` memoises
    lookups (GPU models, accounts) across the specs of one batch of one owner."""
    p = f"{path}." if path else ""
    errors = queue_limit_errors(spec, queue, privileged=privileged, path=path)
    time_limit_s = spec.time_limit_s if spec.time_limit_s is not None else queue.max_time_limit_s
    if refusal := budgets.time_limit_refusal(queue, spec.gpus.count, time_limit_s):
        errors.append((f"{p}spec.timeLimit", refusal))  # its ask could not be counted
    models = {} if models is None else models
    gpu_model, gpu_models, gpu_errors = resolve_gpus(spec, models, path=path)
    errors += gpu_errors
    if spec.clusters:
        known = {cluster.name for cluster in facts.clusters(spec.clusters)}
        errors += [
            (f"{p}spec.placement.clusters[{i}]", f"no cluster named '{name}'")
            for i, name in enumerate(spec.clusters)
            if name not in known
        ]
    clusters = list(spec.clusters)
    selector = dict(spec.node_selector)
    if spec.image and not errors:
        key = ("images", tuple(spec.clusters))
        if key not in models:
            models[key] = image_clusters(spec.clusters)
        clusters, labels, refusal = models[key]
        clusters = list(clusters)
        selector |= {label: "podman" for label in labels}  # only the nodes that run images
        if refusal:
            errors.append((f"{p}spec.image", refusal))
    elif not errors:
        key = ("commands", tuple(spec.clusters))
        if key not in models:
            models[key] = command_clusters(spec.clusters)
        clusters, refusal = models[key]
        clusters = list(clusters)
        if refusal:
            errors.append((f"{p}spec.image", refusal))
    if not errors:
        key = ("accounts", tuple(clusters), bool(spec.clusters))  # a batch: one owner, few clusters
        if key not in models:
            models[key] = account_clusters(owner, clusters, explicit=bool(spec.clusters))
        clusters, refusals = models[key]
        clusters = list(clusters)
        errors += [(f"{p}{field}", why) for field, why in refusals]
    if errors:
        raise SpecError(errors)

    slugs = [m.slug for m in gpu_models]
    normalised = normalised_spec(spec, queue, gpu_model.slug if gpu_model else None, slugs)
    normalised["placement"]["clusters"] = clusters
    normalised["placement"]["nodeSelector"] = selector
    placement: dict[str, Any] = {"clusters": clusters, "nodeSelector": selector}
    if spec.topology:
        placement["topology"] = normalised["placement"]["topology"] = spec.topology
    if spec.gpus.any_model:
        placement["gpuModels"] = slugs  # best first; empty: any model, in the queue's order
    base = dict(
        queue=queue,
        gpu_model=gpu_model,
        gpus_per_node=spec.gpus.count,
        gpu_slice=spec.gpus.mig,
        gpu_memory_mb=spec.gpu_memory_mb,
        gpu_share=spec.gpu_share,
        nodes=spec.nodes,
        cpu_millicores_per_node=spec.cpu_millicores,
        memory_bytes_per_node=spec.memory_bytes,
        time_limit_s=time_limit_s,
        command=spec.run,
        priority=spec.priority,
        placement=placement,
        preemptible=spec.preemptible,
        retries=spec.retries,
        failover_policy=spec.failover,
        secret_env=spec.secret_env,
        dependency=spec.dependency,
    )
    normalised["timeLimitSeconds"] = time_limit_s
    if spec.array is None:
        return [JobRequest(name=spec.name, labels=spec.labels, spec=normalised, **base)]
    return array_requests(spec, normalised, base)


def array_requests(spec: JobSpec, normalised: dict[str, Any], base: dict[str, Any]) -> list[JobRequest]:
    """The members of an array, in index order: each named ``NAME-INDEX``, labelled with the
    array's name and its index, with Slurm's array variables in its environment
    (``ORRERY_ARRAY_INDEX``, ``_TASK_COUNT``, ``_TASK_MIN``, ``_TASK_MAX``; the array's id,
    ``ORRERY_ARRAY_ID``, is known once the first member has one: ``arrays.number``). The first
    member starts the array: the members after it, up to the next start, are its own."""
    indices = spec.array or []
    shared = {
        "ORRERY_ARRAY_TASK_COUNT": str(len(indices)),
        "ORRERY_ARRAY_TASK_MIN": str(indices[0]),
        "ORRERY_ARRAY_TASK_MAX": str(indices[-1]),
    }
    requests = []
    for index in indices:
        task = normalised | {
            "env": normalised["env"] | shared | {"ORRERY_ARRAY_INDEX": str(index)},
            "arrayIndex": index,
            "arrayThrottle": spec.array_throttle,
        }
        labels = spec.labels | {"orrery.io/array": spec.name, "orrery.io/array-index": str(index)}
        requests.append(
            JobRequest(
                name=f"{spec.name}-{index}",
                labels=labels,
                spec=task,
                array_index=index,
                array_throttle=spec.array_throttle,
                array_first=not requests,
                **base,
            )
        )
    return requests


def resolve_gpus(
    spec: JobSpec, memo: dict[Any, Any], *, path: str = ""
) -> tuple[GpuModel | None, list[GpuModel], list[tuple[str, str]]]:
    """The GPU model a spec names (or None), the models an any-model request allows (its
    ``models`` resolved, best first; empty for any model), and the refusals: an unknown model,
    or a request no node of the fleet could ever hold — for any model, none of the allowed
    models has enough nodes with that many GPUs. ``memo`` keeps lookups across a batch."""
    if not spec.gpus.count:
        return None, [], []
    where = f"{path}.spec.resources.gpus" if path else "spec.resources.gpus"

    def lookup(name: str) -> GpuModel | None:
        if name not in memo:
            memo[name] = facts.gpu_model(name)
        return memo[name]

    if not spec.gpus.any_model:
        gpu_model = lookup(spec.gpus.model or "")
        if gpu_model is None:
            return None, [], [(where, f"unknown GPU model '{spec.gpus.model}'")]
        if spec.gpus.mig or spec.gpu_memory_mb or spec.gpu_share:
            return gpu_model, [], _fraction_refusals(spec, gpu_model, path)
        fits = _nodes_that_fit(gpu_model, spec.gpus.count, memo)
        if fits >= spec.nodes:
            return gpu_model, [], []
        most = max(gpu_capacity_histogram(gpu_model.pk) or {0: 0})
        why = (
            f"{spec.nodes} node(s) with {spec.gpus.count} {gpu_model.slug} each can never run: "
            f"{fits} node(s) in the fleet have that many (the most on one node is {most})"
        )
        return gpu_model, [], [(where, why)]

    allowed: list[GpuModel] = []
    errors = []
    for i, name in enumerate(spec.gpus.models):
        found = lookup(name)
        if found is None:
            errors.append((f"{where}.models[{i}]", f"unknown GPU model '{name}'"))
        elif found not in allowed:  # an alias and its slug are one model
            allowed.append(found)
    if errors:
        return None, [], errors
    if ("catalog",) not in memo:
        memo[("catalog",)] = list(GpuModel.objects.order_by("slug"))
    candidates = allowed or memo[("catalog",)]
    fits = max((_nodes_that_fit(m, spec.gpus.count, memo) for m in candidates), default=0)
    if fits < spec.nodes:
        which = f"any of {', '.join(m.slug for m in allowed)}" if allowed else "any model"
        most = max((max(gpu_capacity_histogram(m.pk) or {0: 0}) for m in candidates), default=0)
        why = (
            f"{spec.nodes} node(s) with {spec.gpus.count} GPUs of one model ({which}) each can never "
            f"run: at most {fits} node(s) in the fleet have that many of one model (the most of one "
            f"model on one node is {most})"
        )
        errors.append((where, why))
    return None, allowed, errors


def _fraction_refusals(spec: JobSpec, gpu_model: GpuModel, path: str) -> list[tuple[str, str]]:
    """A request smaller than whole GPUs that no GPU of the fleet could ever hold: a MIG profile
    no node has ``count`` instances of, a fraction larger than every shareable GPU of the model."""
    p = f"{path}." if path else ""
    if spec.gpus.mig:
        most = mig_capacity(gpu_model.pk, spec.gpus.mig)
        if most >= spec.gpus.count:
            return []
        return [
            (
                f"{p}spec.resources.gpus",
                f"{spec.gpus.count} MIG {spec.gpus.mig} instance(s) of {gpu_model.slug} on one node can "
                f"never run: the most any node has is {most} (an operator sets GPUs' MIG layouts)",
            )
        ]
    largest = shareable_memory_mb(gpu_model.pk)
    need = spec.gpu_memory_mb or math.ceil((spec.gpu_share or 0) * largest)
    if largest and need <= largest:
        return []
    field = "gpuMemory" if spec.gpu_memory_mb else "gpuShare"
    why = (
        f"no {gpu_model.slug} is offered in fractions (an operator marks GPUs shareable)"
        if not largest
        else f"{need} MiB is more than the largest shareable {gpu_model.slug} has ({largest} MiB)"
    )
    return [(f"{p}spec.resources.{field}", why)]


def _nodes_that_fit(gpu_model: GpuModel, count: int, memo: dict[Any, Any]) -> int:
    """How many nodes of the fleet, whatever their state, have ``count`` GPUs of the model
    (the fleet's histogram read once per batch)."""
    key = ("histogram", gpu_model.pk)
    if key not in memo:
        memo[key] = gpu_capacity_histogram(gpu_model.pk)
    return sum(n for gpus, n in memo[key].items() if gpus >= count)


def queue_limit_errors(
    spec: JobSpec, queue: Queue, *, privileged: bool, path: str = ""
) -> list[tuple[str, str]]:
    """What the queue does not allow: a priority above its limit for members (managers and
    operators may go up to the spec's own bound), a time limit above its longest, more GPUs than
    one user may hold in it (such a job could never start), a grace period on preemption above
    its own."""
    p = f"{path}." if path else ""
    errors = []
    if spec.priority > queue.max_member_priority and not privileged:
        errors.append(
            (
                f"{p}spec.priority",
                f"queue {queue} lets members ask for a priority of at most {queue.max_member_priority}; "
                "a project manager or an operator may set a higher one",
            )
        )
    if queue.max_time_limit_s is not None and (spec.time_limit_s or 0) > queue.max_time_limit_s:
        errors.append(
            (
                f"{p}spec.timeLimit",
                f"queue {queue} allows at most {queue.max_time_limit_s} seconds; ask for less or use "
                "another queue",
            )
        )
    total_gpus = spec.nodes * spec.gpus.count
    if queue.max_gpus_per_user is not None and total_gpus > queue.max_gpus_per_user:
        errors.append(
            (
                f"{p}spec.resources.gpus",
                f"queue {queue} lets one user hold at most {queue.max_gpus_per_user} GPUs; this job asks "
                f"for {total_gpus}, so it could never start",
            )
        )
    grace = spec.preemption_grace_s
    if grace is not None and grace > queue.preemption_grace_s:
        errors.append(
            (
                f"{p}spec.preemption.grace",
                f"queue {queue} gives a preempted job at most {queue.preemption_grace_s} seconds between "
                "its signal and the kill; ask for less (a bare number is minutes: write e.g. 30s)",
            )
        )
    return errors


def image_clusters(asked: list[str]) -> tuple[list[str], set[str], str]:
    """Where a container-image job may go: the clusters asked for (or all) whose kind runs
    images — where only labelled nodes do (agents with podman), clusters that have one — the
    node labels placement must then require, and a refusal when there is no such cluster: at
    submission, never after placement."""
    named = {cluster.name: cluster.kind for cluster in facts.clusters(asked or None)}
    kinds = {name: adapter_for(kind) for name, kind in named.items() if kind in ADAPTERS}
    # Clusters where only labelled nodes run images: those that have such a node (one query
    # per label, and every kind that needs one names the same label today).
    per_label: dict[str, list[str]] = {}
    for name, adapter in kinds.items():
        if adapter.runs_images and adapter.image_label:
            per_label.setdefault(adapter.image_label, []).append(name)
    labelled = {
        name
        for label, names in per_label.items()
        for name in Node.objects.filter(cluster__name__in=names, labels__has_key=label)
        .order_by()
        .values_list("cluster__name", flat=True)
        .distinct()
    }
    able = sorted(
        name
        for name, adapter in kinds.items()
        if adapter.runs_images and (not adapter.image_label or name in labelled)
    )
    labels = {kinds[name].image_label for name in able if kinds[name].image_label}
    if able:
        return able, labels, ""
    where = f"none of the clusters {', '.join(sorted(named))}" if asked else "no cluster in this fleet"
    return [], set(), f"{where} can run container images; give `run` (a shell command) instead"


def command_clusters(asked: list[str]) -> tuple[list[str], str]:
    """Where a job given as a bare command (no image) may go: ``asked`` (empty: anywhere) less
    the clusters whose kind runs container images only (Kubernetes), and a refusal when none is
    left: at submission, never after placement. An empty list back means "anywhere"."""
    named = {cluster.name: cluster.kind for cluster in facts.clusters(asked or None)}
    only_images = sorted(n for n, kind in named.items() if kind in ADAPTERS and adapter_for(kind).needs_image)
    if not only_images:
        return list(asked), ""
    able = sorted(set(named) - set(only_images))
    if able:
        return able, ""
    where = f"cluster{'s' if len(only_images) > 1 else ''} {', '.join(only_images)}"
    return [], f"{where} run{'' if len(only_images) > 1 else 's'} container images only; give `image`"


def account_clusters(
    owner: Any, names: list[str], *, explicit: bool
) -> tuple[list[str], list[tuple[str, str]]]:
    """Narrow ``names`` (empty: every cluster) to the clusters where ``owner`` has a POSIX account.
    Clusters the user named (``explicit``) without an account there are refused one by one;
    otherwise the job is refused only when no cluster at all is left. An empty list back means
    "anywhere" (every cluster qualifies)."""
    rows = facts.clusters(names or None)
    eligible = eligible_clusters(owner, rows, facts.accounts(owner, [cluster.pk for cluster in rows]))
    if explicit:
        order = {name: i for i, name in enumerate(names)}
        return eligible.names, [
            (f"spec.placement.clusters[{order[name]}]", why) for name, why in sorted(eligible.refused.items())
        ]
    if not eligible.refused:
        return list(names), []
    if eligible.names:
        return eligible.names, []
    where = ", ".join(sorted(eligible.refused))
    first = next(iter(sorted(eligible.refused.values())))
    return [], [
        ("spec.placement.clusters", f"no cluster this job may use lets you run work ({where}); {first}")
    ]


def normalised_spec(
    spec: JobSpec, queue: Queue, gpu_model: str | None, gpu_models: list[str] | None = None
) -> dict[str, Any]:
    """The spec as Orrery understood it, in base units, stored on the job and shown back. An
    any-model request shows ``models`` (slugs, best first; empty: any); ``preemption`` is what
    ``scheduling.services.preemption.stop_terms`` reads (``graceSeconds`` None: the queue's)."""
    gpus: dict[str, Any] = {"model": gpu_model, "count": spec.gpus.count}
    if spec.gpus.any_model:
        gpus = {"model": None, "models": list(gpu_models or []), "count": spec.gpus.count}
    if spec.gpus.mig:
        gpus["mig"] = spec.gpus.mig
    fraction: dict[str, Any] = {}
    if spec.gpu_memory_mb:
        fraction["gpuMemoryMiB"] = spec.gpu_memory_mb
    if spec.gpu_share is not None:
        fraction["gpuShare"] = spec.gpu_share
    return {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": spec.name, "project": queue.project.name, "labels": spec.labels},
        "queue": queue.name,
        "priority": spec.priority,
        "resources": {
            "nodes": spec.nodes,
            "gpus": gpus,
            "cpuMillicores": spec.cpu_millicores,
            "memoryBytes": spec.memory_bytes,
            **fraction,
        },
        "timeLimitSeconds": spec.time_limit_s,
        "run": spec.run,
        "setup": spec.setup,
        "image": spec.image,
        "env": spec.env,
        "secretEnv": sorted(spec.secret_env),  # names only: the values are sealed on the job
        "workdir": spec.workdir,
        "placement": {"clusters": spec.clusters, "nodeSelector": spec.node_selector}
        | ({"topology": spec.topology} if spec.topology else {}),
        "retries": spec.retries,
        "failover": spec.failover,
        "sim": {"durationSeconds": spec.sim_duration_s, "exitCode": spec.sim_exit_code},
        "preemptible": spec.preemptible,
        "preemption": {"signal": spec.preemption_signal, "graceSeconds": spec.preemption_grace_s},
    }
