"""Running attempts on a Kubernetes cluster: dispatch as Jobs on the nodes the scheduler chose,
state sync from watches, output from pod logs, cancel.

Every object this adapter creates lives in the cluster's namespace, is named after its attempt
(``manifests.job_name``) and carries the cluster's tag (``orrery.io/tag``, made at onboarding):
a retried dispatch finds the Job it already created (``409 AlreadyExists`` on a Job of ours is
success; on anyone else's it is an error), sync and orphan detection look at objects carrying
the tag only, so two Orrery installations on one cluster never touch each other's work.

Sync reads Jobs and pods from watches (``informer.watched``: one list, then a watch kept open in
the background, per process), never by polling the API server; the pass itself only reads the
local store. What the watches say becomes Orrery's states through ``states.attempt_state``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any, ClassVar

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from clusters.adapters.base import (
    AdapterError,
    Inventory,
    LogChunk,
    Orphan,
    Phase,
    Sent,
    Synced,
    Work,
)
from clusters.adapters.kubernetes.client import TIMEOUT, KubeError, api_for, namespace_of
from clusters.adapters.kubernetes.gpus import GPU
from clusters.adapters.kubernetes.informer import forget, watched, watched_clusters
from clusters.adapters.kubernetes.inventory import (
    STALE_AFTER_S,
    VANISHED,
    credentials_of,
    take_inventory,
)
from clusters.adapters.kubernetes.manifests import (
    CONTAINER,
    LABEL_ATTEMPT,
    LABEL_TAG,
    ManifestError,
    gpu_request,
    job_manifest,
    secret_manifest,
    selector,
    service_manifest,
)
from clusters.adapters.kubernetes.states import attempt_state
from clusters.adapters.tags import cluster_tag
from clusters.choices import ClusterKind, Identity
from clusters.models import Cluster, Node

log = logging.getLogger(__name__)
LOG_LIMIT = 1 << 20  # the first MiB of each pod's output is copied (JobLog keeps one MiB per node)
SYNCED_WITHIN_S = 5.0  # how long a sync waits for the watches' first lists (they go on in the background)
DEFAULT_UID = 1000


class NoAccount(Exception):
    """The attempt has no uid it may run as on this cluster."""


class KubernetesAdapter:
    """A Kubernetes cluster through its API server (the official client), as ``batch/v1`` Jobs."""

    kind: ClassVar[str] = ClusterKind.KUBERNETES
    runs_images: ClassVar[bool] = True
    image_label: ClassVar[str | None] = None
    needs_image: ClassVar[bool] = True
    shares_node_network: ClassVar[bool] = False  # a pod per node, each its own network
    runs_user_code: ClassVar[bool] = True
    pulls_inventory: ClassVar[bool] = True
    inventory_every_s: ClassVar[float] = 2.0  # a pass reads the informers; unchanged, it skips
    dispatch_batch: ClassVar[int] = 100
    sync_every_s: ClassVar[float | None] = 2.0  # a pass reads the watches' local store only

    def inventory(self, cluster: Cluster) -> Inventory:
        return take_inventory(cluster, _api(cluster))

    def dispatch(self, cluster: Cluster, works: Sequence[Work]) -> Iterator[Sent]:
        """Create each attempt's Job (and a gang's Service), yielding its ``Sent`` as soon as it is
        known. What can never run (no image, no uid, a bad variable name) fails at once; a
        refusal of the API server (403, 422, a foreign Job under the name) or an unreachable one is
        that work's error, tried again later."""
        api = _api(cluster)
        namespace, tag = namespace_of(cluster), cluster_tag(cluster)
        batch, core = k8s.BatchV1Api(api), k8s.CoreV1Api(api)
        node_labels = _node_labels(cluster, works)
        tolerated = [str(k) for k in cluster.config.get("tolerated_taints") or ()]
        for work in works:
            try:
                uid, gid = uid_for(cluster, work.run_as)
                job = job_manifest(
                    work,
                    tag,
                    uid=uid,
                    gid=gid,
                    gpu_resource=gpu_request(work.shares[0], node_labels.get(work.nodes[0], {}))
                    if work.shares
                    else GPU,
                    tolerated=tolerated,
                )
                service = service_manifest(work, tag) if len(work.shares) > 1 else None
                secret = secret_manifest(work, tag)
            except (NoAccount, ManifestError) as exc:
                log.warning("attempt %s cannot run on %s: %s", work.attempt_id, cluster.name, exc)
                yield Sent(work.attempt_id, phase=Phase.FAILED, message=str(exc)[:1000])
                continue
            made = []  # what this delivery created before its Job: removed if the Job is not made
            try:
                if secret is not None:  # first: the Job's pods read their secret env from it
                    _create(
                        core.create_namespaced_secret, core.read_namespaced_secret, namespace, secret, tag
                    )
                    made.append(core.delete_namespaced_secret)
                if service is not None:
                    _create(
                        core.create_namespaced_service, core.read_namespaced_service, namespace, service, tag
                    )
                    made.append(core.delete_namespaced_service)
                _create(batch.create_namespaced_job, batch.read_namespaced_job, namespace, job, tag)
            except (ApiException, urllib3.exceptions.HTTPError, KubeError) as exc:
                log.warning("dispatch of %s to %s failed: %s", work.attempt_id, cluster.name, exc)
                for delete in made:  # no secret value left behind by an attempt that never ran
                    with contextlib.suppress(ApiException, urllib3.exceptions.HTTPError):
                        _gone_ok(delete, job["metadata"]["name"], namespace, _request_timeout=TIMEOUT)
                yield Sent(work.attempt_id, error=describe(exc)[:1000])
            else:
                yield Sent(work.attempt_id, remote_id=job["metadata"]["name"])

    def sync(self, cluster: Cluster, works: Sequence[Work]) -> Synced:
        """States and output of the asked attempts, from the Job and pod watches, and the orphans:
        Jobs carrying this cluster's tag for attempts not asked about (ended ones too: deleting
        them once Orrery has recorded their end is how finished Jobs are cleaned up)."""
        api = _api(cluster)
        jobs, pods = _watches(cluster, api)
        found, by_attempt = group(jobs.objects().values(), pods.objects().values())
        gone = _gone_nodes(cluster, works)
        asked = {w.attempt_id for w in works}
        states, output = [], []
        for work in works:
            job = found.get(work.attempt_id)
            if job is None and work.remote_id:
                job = _read_job(api, cluster, work.remote_id)  # created after the watch's last event?
            state = attempt_state(
                work.attempt_id,
                job,
                by_attempt.get(work.attempt_id, []),
                remote_id=work.remote_id,
                nodes=work.nodes,
                gone_nodes=gone,
            )
            if state is None:
                continue
            states.append(state)
            output += _logs(api, cluster, work, by_attempt.get(work.attempt_id, []))
        orphans = [
            Orphan(attempt, str(job["metadata"]["name"]))
            for attempt, job in found.items()
            if attempt and attempt not in asked
        ]
        return Synced(states=states, output=output, orphans=orphans)

    def forget_others(self, keep: set[int]) -> int:
        """Stop this process's watches of clusters no longer enabled (deleted, disabled): the
        inventory pass calls it with the enabled ones. Returns how many informers stopped."""
        return sum(forget(key) for key in watched_clusters() - keep)

    def cancel(self, cluster: Cluster, remote_ids: Sequence[str]) -> int:
        """Delete Jobs (background propagation), and their pods and Service ourselves: a cluster
        without a garbage collector running (or a slow one) must not keep GPUs busy. Returns how
        many Jobs were deleted or already gone; a refusal is logged and the rest go on."""
        return self._delete(cluster, remote_ids, None)

    def signal(self, cluster: Cluster, remote_ids: Sequence[str], signal: str, grace_s: int) -> int:
        """The stop of a preemption (``SupportsSignal``): delete the Jobs and their pods with
        ``grace_s`` as the pods' grace period. The kubelet sends the container its stop signal
        (the image's ``STOPSIGNAL``, SIGTERM by default: Kubernetes takes no other), then SIGKILL
        once the grace period is over; ``signal`` is not used."""
        return self._delete(cluster, remote_ids, max(int(grace_s), 0))

    def _delete(self, cluster: Cluster, remote_ids: Sequence[str], grace_s: int | None) -> int:
        """Delete Jobs, their pods (with ``grace_s`` when given, else each pod's own grace
        period), their Service and Secret; returns how many Jobs were deleted or already gone."""
        graceful = {} if grace_s is None else {"grace_period_seconds": grace_s}
        api = _api(cluster)
        namespace = namespace_of(cluster)
        batch, core = k8s.BatchV1Api(api), k8s.CoreV1Api(api)
        done = 0
        for name in remote_ids:
            try:
                _gone_ok(
                    batch.delete_namespaced_job,
                    name,
                    namespace,
                    propagation_policy="Background",
                    _request_timeout=TIMEOUT,
                    **graceful,
                )
                pods = core.list_namespaced_pod(
                    namespace,
                    label_selector=f"batch.kubernetes.io/job-name={name}",
                    _preload_content=False,
                    _request_timeout=TIMEOUT,
                )
                for pod in json.loads(pods.data).get("items") or []:
                    _gone_ok(
                        core.delete_namespaced_pod,
                        pod["metadata"]["name"],
                        namespace,
                        _request_timeout=TIMEOUT,
                        **graceful,
                    )
                _gone_ok(core.delete_namespaced_service, name, namespace, _request_timeout=TIMEOUT)
                _gone_ok(core.delete_namespaced_secret, name, namespace, _request_timeout=TIMEOUT)
                done += 1
            except (ApiException, urllib3.exceptions.HTTPError) as exc:
                log.warning("could not delete Job %s on %s: %s", name, cluster.name, describe(exc))
        return done


def group(
    jobs: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Jobs by attempt, and each attempt's pods: those its Job's controller made (the
    ``batch.kubernetes.io/job-name`` label), not any pod that copied the attempt's label."""
    found: dict[str, dict[str, Any]] = {}
    for job in jobs:
        attempt = ((job.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT, "")
        if attempt:
            found[attempt] = job
    names = {str(job["metadata"].get("name")): attempt for attempt, job in found.items()}
    by_attempt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        attempt = names.get(labels.get("batch.kubernetes.io/job-name", ""))
        if attempt and labels.get(LABEL_ATTEMPT) == attempt:
            by_attempt[attempt].append(pod)
    return found, by_attempt


def uid_for(cluster: Cluster, run_as: str | None) -> tuple[int, int]:
    """The uid and gid an attempt runs as: the cluster's shared uid (``run_as == ""``), or the
    uid mapped to the attempt's account name in the cluster's ``uids``. Never 0."""
    config = cluster.config
    if run_as is None:
        raise NoAccount(f"no account to run as on cluster '{cluster.name}'")
    if run_as == "" or cluster.identity == Identity.SHARED:
        uid = int(config.get("run_as_uid") or DEFAULT_UID)
        return uid, int(config.get("run_as_gid") or uid)
    uids = config.get("uids") or {}
    if run_as not in uids:
        raise NoAccount(
            f"account '{run_as}' has no uid on Kubernetes cluster '{cluster.name}' "
            "(onboard the cluster again with a uid for it)"
        )
    uid = int(uids[run_as])
    return uid, uid


def describe(exc: BaseException) -> str:
    """What went wrong, in the API server's words where it answered."""
    if isinstance(exc, ApiException):
        try:
            body = json.loads(exc.body or "{}")
        except (TypeError, ValueError):
            body = {}
        if not isinstance(body, dict):
            body = {}
        return f"{exc.status} {body.get('reason') or exc.reason}: {body.get('message') or ''}".strip()
    return f"{type(exc).__name__}: {exc}"


def _node_labels(cluster: Cluster, works: Sequence[Work]) -> dict[str, dict[str, str]]:
    """The labels of each node the works run on: which GPU resources it offers (the
    inventory's ``orrery.io/gpu-resource``, GFD's MIG strategy), for ``gpu_request``."""
    names = {n for w in works for n in w.nodes}
    rows = Node.objects.filter(cluster=cluster, name__in=names).values_list("name", "labels")
    return {name: labels or {} for name, labels in rows}


def _gone_nodes(cluster: Cluster, works: Sequence[Work]) -> set[str]:
    """The attempts' nodes the inventory saw leave the cluster (deleted, or no GPUs any more)."""
    names = {n for w in works for n in w.nodes}
    if not names:
        return set()
    return set(
        Node.objects.filter(cluster=cluster, name__in=names, state_reason=VANISHED).values_list(
            "name", flat=True
        )
    )


def _api(cluster: Cluster) -> k8s.ApiClient:
    try:
        return api_for(cluster)
    except KubeError as exc:
        raise AdapterError(str(exc)) from None


def _watches(cluster: Cluster, api: k8s.ApiClient) -> tuple[Any, Any]:
    """The running Job and pod informers of this cluster's tag (started on first use); raises
    ``AdapterError`` while they have not listed yet."""
    namespace, tag = namespace_of(cluster), cluster_tag(cluster)
    generation = credentials_of(api) + "/" + namespace
    batch, core = k8s.BatchV1Api(api), k8s.CoreV1Api(api)
    jobs = watched(
        cluster.pk,
        "orrery-jobs",
        partial(batch.list_namespaced_job, namespace),
        generation=generation,
        label_selector=selector(tag),
    )
    pods = watched(
        cluster.pk,
        "orrery-pods",
        partial(core.list_namespaced_pod, namespace),
        generation=generation,
        label_selector=selector(tag),
    )
    for informer in (jobs, pods):
        if not informer.wait_synced(SYNCED_WITHIN_S):
            raise AdapterError(
                f"the {informer.name} watch has not listed yet: {informer.last_error or 'waiting'}"
            )
        if informer.failing_for() > STALE_AFTER_S:
            raise AdapterError(f"the {informer.name} watch has failed for a while: {informer.last_error}")
    return jobs, pods


def _create(create: Any, read: Any, namespace: str, body: dict[str, Any], tag: str) -> None:
    """Create an object; an existing one of that name is fine when it is ours (same attempt,
    same tag), an error otherwise."""
    try:
        create(namespace, body, _preload_content=False, _request_timeout=TIMEOUT)
    except ApiException as exc:
        if exc.status != 409:
            raise
        name = body["metadata"]["name"]
        existing = json.loads(read(name, namespace, _preload_content=False, _request_timeout=TIMEOUT).data)
        theirs = (existing.get("metadata") or {}).get("labels") or {}
        want = body["metadata"]["labels"]
        if theirs.get(LABEL_TAG) != tag or theirs.get(LABEL_ATTEMPT) != want[LABEL_ATTEMPT]:
            raise KubeError(
                f"a {body['kind']} named {name} already exists in namespace {namespace} and is not this "
                "attempt's (another Orrery, or someone else's)"
            ) from None


def _read_job(api: k8s.ApiClient, cluster: Cluster, name: str) -> dict[str, Any] | None:
    try:
        response = k8s.BatchV1Api(api).read_namespaced_job(
            name, namespace_of(cluster), _preload_content=False, _request_timeout=TIMEOUT
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise AdapterError(describe(exc)) from None
    except urllib3.exceptions.HTTPError as exc:
        raise AdapterError(describe(exc)) from None
    job = json.loads(response.data)
    labels = (job.get("metadata") or {}).get("labels") or {}
    return job if labels.get(LABEL_TAG) == cluster_tag(cluster) else None


def _logs(api: k8s.ApiClient, cluster: Cluster, work: Work, pods: list[dict[str, Any]]) -> list[LogChunk]:
    """Each pod's output from its start (the first ``LOG_LIMIT`` bytes), as its node's stream.
    A pod with no node yet (204), a kubelet that cannot be reached (500) or a pod gone (404)
    gives nothing this time."""
    core = k8s.CoreV1Api(api)
    chunks = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase not in ("Running", "Succeeded", "Failed"):
            continue
        try:
            response = core.read_namespaced_pod_log(
                pod["metadata"]["name"],
                namespace_of(cluster),
                container=CONTAINER,
                limit_bytes=LOG_LIMIT,
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            log.info("no log of %s on %s yet: %s", pod["metadata"]["name"], cluster.name, describe(exc))
            continue
        data = response.data or b""
        if data:
            chunks.append(LogChunk(work.attempt_id, node, 0, data.decode("utf-8", "replace")))
    return chunks


def _gone_ok(call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, _preload_content=False, **kwargs)
    except ApiException as exc:
        if exc.status != 404:
            raise
