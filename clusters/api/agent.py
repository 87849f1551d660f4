"""The agent protocol: register, describe, inventory, heartbeat, report, attempts, ended (plain
Django views: this is the hot path, so no serializer per record and no database write per
report).

Every error is JSON ``{"detail", "errors": [{"path", "message"}]}``: 400 for a malformed
payload, 401 for a missing or refused credential, 403 for a report about a node or cluster
the credential does not speak for. Two answers ask the agent to come back later, with a
``Retry-After`` header and the same number of seconds as ``retryAfter`` in the body
(``clusters.ingest.flow``): 429 when this process serves too many heartbeats and reports at
once, 503 when the heartbeat buffer (Redis) or the database cannot be reached. Nothing of a
refused request was stored.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from clusters import ports
from clusters.adapters.registry import adapter_for
from clusters.agent import mig
from clusters.choices import ClusterKind
from clusters.ingest.buffer import BufferUnavailable, get_buffer
from clusters.ingest.flow import in_flight, retry_after
from clusters.ingest.records import ReportError, node_name, parse_report
from clusters.metrics import INGEST_REFUSED, JOB_END_RINGS, REPORTS
from clusters.models import Cluster, Node
from clusters.selectors import resolve_gpu_model
from clusters.services.credentials import (
    CredentialRefused,
    GpuDescription,
    NodeDescription,
    NodeIdentity,
    NodeTaken,
    authenticate_cluster,
    authenticate_node,
    register_node,
    upsert_node,
)
from clusters.services.mig import MigDescription, mig_layouts_for_node

MAX_NODES_PER_REPORT = 5000
MAX_LOG_OFFSET = 1 << 40  # a job's output stream beyond a terabyte is not output
FLOW_CONTROLLED = {"heartbeat", "report", "ended"}  # the hot ingest: past the in-flight limit, 429
_NAME_MAP_TTL_S = 30.0


Answer = tuple[int, dict[str, Any]]


def _error(status: int, detail: str, path: str | None = None, message: str | None = None) -> Answer:
    errors = [{"path": path, "message": message}] if path else []
    return status, {"detail": detail, "errors": errors}


def bearer_of(header: str) -> str:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _come_back(status: int, reason: str, detail: str) -> Answer:
    INGEST_REFUSED.labels(reason).inc()
    return status, {"detail": detail, "errors": [], "retryAfter": retry_after()}


def retry_headers(body: dict[str, Any]) -> list[tuple[str, str]]:
    """``Retry-After`` for an answer that asks the client to come back (see the module)."""
    return [("Retry-After", str(body["retryAfter"]))] if "retryAfter" in body else []


def handle(endpoint: str, raw: bytes, bearer: str) -> Answer:
    """Run one agent endpoint on a raw body; used by the Django views and by the WSGI fast
    path (``clusters.api.fastpath``), so both answer exactly alike."""
    with in_flight.slot() as free:
        if not free and endpoint in FLOW_CONTROLLED:
            return _come_back(429, "busy", "Too many reports at once; retry after the suggested wait.")
        try:
            return _handle(endpoint, raw, bearer)
        except BufferUnavailable:
            return _come_back(503, "buffer", "The heartbeat buffer is unavailable; retry later.")
        except (OperationalError, InterfaceError):
            # The database is away (restarting, failing over): Django drops the broken
            # connection when the request ends, and the agent's retry finds a new one.
            return _come_back(503, "database", "The database is unavailable; retry later.")


def _handle(endpoint: str, raw: bytes, bearer: str) -> Answer:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _error(400, f"Malformed JSON: {exc}")
    try:
        return ENDPOINTS[endpoint](body, bearer)
    except CredentialRefused as exc:
        REPORTS.labels("refused").inc()
        return _error(401, f"Credential refused: {exc}.")
    except ReportError as exc:
        REPORTS.labels("malformed").inc()
        return _error(400, "Malformed report.", exc.path, exc.message)
    except NodeTaken as exc:
        return _error(409, f"{exc}.")


def django_view(endpoint: str) -> Callable[[HttpRequest], HttpResponse]:
    """The endpoint as a Django view: POST only, no CSRF (bearer credentials, no cookies)."""

    @csrf_exempt
    @require_POST
    def view(request: HttpRequest) -> HttpResponse:
        status, body = handle(endpoint, request.body, bearer_of(request.headers.get("Authorization", "")))
        response = HttpResponse(orjson.dumps(body), status=status, content_type="application/json")
        for name, value in retry_headers(body):
            response.headers[name] = value
        return response

    view.__name__ = endpoint
    return view


def _text(value: Any, path: str, max_length: int = 120) -> str:
    if not isinstance(value, str) or not value or len(value) > max_length or "\x00" in value:
        raise ReportError(path, f"must be a non-empty string of at most {max_length} characters")
    return value


def _count(value: Any, path: str, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise ReportError(path, f"must be an integer between 0 and {high}")
    return value


def parse_node_description(data: Any, path: str = "") -> NodeDescription:
    """A node's description of itself, GPU product strings resolved through the catalog."""
    p = f"{path}." if path else ""
    if not isinstance(data, dict):
        raise ReportError(path or "(body)", "must be an object")
    gpus_raw = data.get("gpus") or []
    if not isinstance(gpus_raw, list) or len(gpus_raw) > 64:
        raise ReportError(f"{p}gpus", "must be a list of at most 64 GPUs")
    gpus, seen, uuids = [], set(), set()
    for i, gpu in enumerate(gpus_raw):
        g = f"{p}gpus[{i}]"
        if not isinstance(gpu, dict):
            raise ReportError(g, "must be an object")
        index = _count(gpu.get("index", i), f"{g}.index", 63)
        if index in seen:
            raise ReportError(f"{g}.index", f"index {index} appears twice")
        seen.add(index)
        model = resolve_gpu_model(_text(gpu.get("model"), f"{g}.model"))
        if model is None:
            raise ReportError(
                f"{g}.model", f"unknown GPU model '{gpu.get('model')}'; an operator adds it to the catalog"
            )
        gpus.append(
            GpuDescription(
                index=index,
                model=model,
                uuid=str(gpu.get("uuid") or "")[:64].replace("\x00", ""),
                memory_mb=_count(gpu.get("memory_total_mb") or 0, f"{g}.memory_total_mb", 10**7),
                topology_group=str(gpu.get("topology_group") or "")[:63].replace("\x00", ""),
                mig=None if gpu.get("mig") is None else _mig_instances(gpu["mig"], f"{g}.mig", uuids),
            )
        )
    labels = data.get("labels") or {}
    if (
        not isinstance(labels, dict)
        or len(labels) > 64
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= 120
            and len(v) <= 512
            and "\x00" not in k + v
            for k, v in labels.items()
        )
    ):
        raise ReportError(f"{p}labels", "must map at most 64 names to strings, without NUL")
    for field in ("agent_version", "boot_id", "rack"):
        if "\x00" in str(data.get(field) or ""):
            raise ReportError(f"{p}{field}", "must not contain NUL")
    return NodeDescription(
        name=_text(data.get("name"), f"{p}name"),
        cpu_millicores=_count(data.get("cpu_millicores", 0), f"{p}cpu_millicores", 10**8),
        memory_bytes=_count(data.get("memory_bytes", 0), f"{p}memory_bytes", 2**60),
        gpus=gpus,
        labels=labels,
        agent_version=str(data.get("agent_version") or "")[:40],
        boot_id=str(data.get("boot_id") or "")[:64],
        rack=str(data.get("rack") or "")[:63],
    )


def _mig_instances(data: Any, path: str, uuids: set[str]) -> tuple[MigDescription, ...]:
    """A GPU's MIG instances (``[{"slot", "profile", "uuid", "memory_mb", "slices"}]``): at most
    ``MAX_INSTANCES``, each slot once, each UUID once on the node, slices as the profile says
    and at most ``MAX_SLICES`` in all; ``ReportError`` names the first bad field."""
    if not isinstance(data, list) or len(data) > mig.MAX_INSTANCES:
        raise ReportError(path, f"must be a list of at most {mig.MAX_INSTANCES} MIG instances")
    found, slots = [], set()
    for k, item in enumerate(data):
        m = f"{path}[{k}]"
        if not isinstance(item, dict):
            raise ReportError(m, "must be an object")
        slot = _count(item.get("slot", k), f"{m}.slot", mig.MAX_INSTANCES - 1)
        if slot in slots:
            raise ReportError(f"{m}.slot", f"slot {slot} appears twice")
        slots.add(slot)
        profile = item.get("profile")
        if not isinstance(profile, str) or not mig.PROFILE.fullmatch(profile):
            raise ReportError(f"{m}.profile", "must be a MIG profile such as 1g.10gb or 3g.40gb+me")
        uuid = item.get("uuid")
        if not isinstance(uuid, str) or not mig.MIG_UUID.fullmatch(uuid):
            raise ReportError(
                f"{m}.uuid", "must be a MIG UUID ('MIG-' and at most 60 letters, digits, '-', '/')"
            )
        if uuid in uuids:
            raise ReportError(f"{m}.uuid", "appears twice on this node")
        uuids.add(uuid)
        slices = _count(item.get("slices", mig.slices(profile)), f"{m}.slices", mig.MAX_SLICES)
        if slices != mig.slices(profile):
            raise ReportError(f"{m}.slices", f"must be {mig.slices(profile)}, as its profile {profile} says")
        memory = _count(item.get("memory_mb"), f"{m}.memory_mb", 10**7)
        found.append(MigDescription(slot, profile, uuid, memory, slices))
    if sum(i.slices for i in found) > mig.MAX_SLICES:
        raise ReportError(path, f"more than {mig.MAX_SLICES} compute slices in all")
    return tuple(found)


def register(body: Any, bearer: str) -> Answer:
    """``POST agent/register`` with a join token: the node's per-node credential (shown once).
    A name already registered needs its current credential in ``credential`` (409 otherwise)."""
    description = parse_node_description(body)
    current = body.get("credential") if isinstance(body.get("credential"), str) else ""
    node, credential = register_node(bearer, description, current)
    return (
        201,
        {
            "node": node.name,
            "nodeId": node.pk,
            "cluster": node.cluster.name,
            "credential": credential,
            "interval": settings.ORRERY_HEARTBEAT_INTERVAL,
            "failover_after_s": settings.NODE_FAILOVER_AFTER,
        },
    )


def describe(body: Any, bearer: str) -> Answer:
    """``POST agent/describe`` with a node credential: the node says what it is now (as when it
    registered: its CPU, memory, labels, GPUs and their MIG instances), after a restart or a
    change of MIG layout. Its liveness goes on as it was."""
    identity = authenticate_node(bearer)
    description = parse_node_description(body)
    if description.name != identity.node_name:
        return _error(403, f"This credential speaks for node '{identity.node_name}' only.")
    node = upsert_node(Cluster.objects.get(pk=identity.cluster_id), description)
    return 200, {"node": node.name, "gpus": len(description.gpus)}


def inventory(body: Any, bearer: str) -> Answer:
    """``POST agent/nodes`` with a cluster credential: a collector declares its cluster's nodes."""
    identity = authenticate_cluster(bearer)
    if not isinstance(body, dict) or body.get("cluster") != identity.cluster_name:
        return _error(403, f"This credential reports for cluster '{identity.cluster_name}' only.")
    nodes = body.get("nodes")
    if not isinstance(nodes, list) or len(nodes) > MAX_NODES_PER_REPORT:
        raise ReportError("nodes", f"must be a list of at most {MAX_NODES_PER_REPORT} nodes")
    descriptions = [parse_node_description(n, f"nodes[{i}]") for i, n in enumerate(nodes)]
    cluster = Cluster.objects.get(pk=identity.cluster_id)
    for description in descriptions:
        upsert_node(cluster, description)
    _node_ids.forget(identity.cluster_id)
    return 200, {"cluster": cluster.name, "nodes": len(descriptions)}


def heartbeat(body: Any, bearer: str) -> Answer:
    """``POST agent/heartbeat`` with a node credential: one node's report. The reply says what
    the node should run (``desired``; an entry with ``stop`` is to be stopped with its signal
    and grace period, never started), what it runs and should stop (``stop``), how often to
    report, and — only while an operator wants a MIG layout that some GPU of the node does not
    have — ``mig_layouts`` (``clusters.services.mig``)."""
    identity = authenticate_node(bearer)
    name = node_name(body, "")
    if name != identity.node_name:
        REPORTS.labels("forbidden").inc()
        return _error(403, f"This credential speaks for node '{identity.node_name}' only.")
    record = parse_report(
        body, "", node_id=identity.node_id, cluster_id=identity.cluster_id, received_at=time.time()
    )
    accepted, stale = get_buffer().put([record])
    REPORTS.labels("accepted").inc(accepted)
    if stale:
        REPORTS.labels("stale").inc(stale)
    desired = _desired(identity)
    # An attempt being stopped (a preemption: ``stop`` in its entry) is listed to stop as well:
    # an agent that predates ``stop`` stops it the way it stops a cancelled one (its own grace).
    wanted = {d["attempt"] for d in desired if "stop" not in d}
    answer = {
        "accepted": bool(accepted),
        "interval": settings.ORRERY_HEARTBEAT_INTERVAL,
        # the node's agent stops its attempts before this much silence (its lease)
        "failover_after_s": settings.NODE_FAILOVER_AFTER,
        "desired": desired,
        "stop": [a for a in record["r"] if a not in wanted],
    }
    # Only a node with a wish pays for it (one cache read; the wish is known from its identity).
    native = identity.cluster_kind == ClusterKind.NATIVE
    if identity.mig_wanted and native and (layouts := mig_layouts_for_node(identity.node_id)):
        answer["mig_layouts"] = layouts
    return 200, answer


def _desired(identity: NodeIdentity) -> list[dict[str, Any]]:
    """What the node should run: only machines running the Orrery agent (the native kind) are
    told; collectors' clusters run work their own way."""
    if identity.cluster_kind != ClusterKind.NATIVE:
        return []
    return ports.agent_desired()(identity.node_id)


def attempts(body: Any, bearer: str) -> Answer:
    """``POST agent/attempts`` with a node credential: state changes of the node's attempts
    (``starting``, ``running``, ``succeeded``/``failed``/``timeout``/``cancelled``/``preempted``
    with the exit code) and new output. Each item stands alone: a malformed one, or one about an attempt that
    is not this node's, is refused with its path in ``errors`` and the others are applied, so
    one bad item never blocks a node's later reports."""
    identity = authenticate_node(bearer)
    if not isinstance(body, dict) or body.get("node") != identity.node_name:
        return _error(403, f"This credential speaks for node '{identity.node_name}' only.")
    reports, logs = body.get("reports") or [], body.get("logs") or []
    if not isinstance(reports, list) or not isinstance(logs, list) or len(reports) > 1000 or len(logs) > 1000:
        raise ReportError("reports", "reports and logs must be lists of at most 1000 items")
    errors: list[dict[str, str]] = []
    good_reports, report_at = _valid(reports, "reports", _report_problem, errors)
    good_logs, log_at = _valid(logs, "logs", _log_problem, errors)
    counts = ports.agent_reports()(identity.node_id, good_reports, good_logs)
    for k, message in counts.pop("refused_logs", []):
        errors.append({"path": f"logs[{log_at[k]}]", "message": message})
    for k, message in counts.pop("refused_reports", []):
        errors.append({"path": f"reports[{report_at[k]}]", "message": message})
    return 200, {**counts, "errors": sorted(errors, key=lambda e: e["path"])}


def _valid(
    items: list[Any],
    name: str,
    problem: Callable[[Any], tuple[str, str] | None],
    errors: list[dict[str, str]],
) -> tuple[list[dict[str, Any]], list[int]]:
    """The well-formed items and their positions; each malformed one becomes an error."""
    good, at = [], []
    for i, item in enumerate(items):
        found = problem(item)
        if found is None:
            good.append(item)
            at.append(i)
        else:
            errors.append({"path": f"{name}[{i}]{found[0]}", "message": found[1]})
    return good, at


def _attempt_id(value: Any) -> bool:
    try:
        return isinstance(value, str) and str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


def _report_problem(item: Any) -> tuple[str, str] | None:
    if (
        not isinstance(item, dict)
        or not _attempt_id(item.get("attempt"))
        or item.get("state") not in _ATTEMPT_STATES
    ):
        return "", f"needs an attempt id and a state in {sorted(_ATTEMPT_STATES)}"
    code = item.get("exit_code")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int) or not -255 <= code <= 255):
        return ".exit_code", "must be an integer between -255 and 255"
    reason = item.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > 500 or "\x00" in reason):
        return ".reason", "must be text of at most 500 characters without NUL"
    rank = item.get("node_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 100_000:
        return ".node_rank", "must be a non-negative integer"
    return None


def _log_problem(item: Any) -> tuple[str, str] | None:
    if not (
        isinstance(item, dict)
        and _attempt_id(item.get("attempt"))
        and isinstance(item.get("data"), str)
        and isinstance(item.get("offset"), int)
        and not isinstance(item.get("offset"), bool)
        and 0 <= item["offset"] <= MAX_LOG_OFFSET
        and len(item["data"]) <= 1 << 20
    ):
        return "", f"needs an attempt id, a byte offset up to {MAX_LOG_OFFSET} and at most 1 MiB of text"
    return None


_ATTEMPT_STATES = {"starting", "running", "succeeded", "failed", "timeout", "cancelled", "preempted"}


def report(body: Any, bearer: str) -> Answer:
    """``POST agent/report`` with a cluster credential: the latest state of many nodes at once."""
    identity = authenticate_cluster(bearer)
    if not isinstance(body, dict) or body.get("cluster") != identity.cluster_name:
        REPORTS.labels("forbidden").inc()
        return _error(403, f"This credential reports for cluster '{identity.cluster_name}' only.")
    nodes = body.get("nodes")
    if not isinstance(nodes, list) or len(nodes) > MAX_NODES_PER_REPORT:
        raise ReportError("nodes", f"must be a list of at most {MAX_NODES_PER_REPORT} nodes")
    ids = _node_ids.get(identity.cluster_id)
    received_at = time.time()
    records, unknown = [], []
    for i, item in enumerate(nodes):
        name = node_name(item, f"nodes[{i}]")
        node_id = ids.get(name)
        if node_id is None:
            ids = _node_ids.get(identity.cluster_id, refresh=True)
            node_id = ids.get(name)
        if node_id is None:
            unknown.append(name)
            continue
        records.append(
            parse_report(
                item, f"nodes[{i}]", node_id=node_id, cluster_id=identity.cluster_id, received_at=received_at
            )
        )
    accepted, stale = get_buffer().put(records) if records else (0, 0)
    REPORTS.labels("accepted").inc(accepted)
    if stale:
        REPORTS.labels("stale").inc(stale)
    if unknown:
        REPORTS.labels("unknown").inc(len(unknown))
    return (
        200,
        {
            "accepted": accepted,
            "stale": stale,
            "unknown": unknown[:100],
            "interval": settings.ORRERY_HEARTBEAT_INTERVAL,
        },
    )


def ended(body: Any, bearer: str) -> Answer:
    """``POST agent/ended`` with a cluster credential: a doorbell rung by the cluster's own
    scheduler when one of its jobs ends (Slurm's ``EpilogSlurmctld``: ``orrery-epilog``). Orrery
    reads that job back now instead of at the next poll; the cluster, not this call, says how it
    ended, so the body only names a job to look at among this cluster's active attempts (a job
    id that is none of theirs costs one indexed read). Rings of a burst are one read
    (``scheduling.wakeup.ring_sync``); a cluster whose kind is not polled (its agents report
    their ends themselves) is 409."""
    identity = authenticate_cluster(bearer)
    if not isinstance(body, dict):
        raise ReportError("", "must be an object: {cluster, job}")
    if body.get("cluster") != identity.cluster_name:
        return _error(403, f"This credential speaks for cluster '{identity.cluster_name}' only.")
    job = body.get("job")
    if not (isinstance(job, str) and re.fullmatch(r"[0-9]{1,32}", job)):
        raise ReportError("job", "must be the Slurm job id: at most 32 digits")
    kind = Cluster.objects.filter(pk=identity.cluster_id).values_list("kind", flat=True).first()
    if kind is None or adapter_for(kind).sync_every_s is None:
        return _error(409, f"Cluster '{identity.cluster_name}' is not polled: its own agents report ends.")
    ports.cluster_job_ended()(identity.cluster_id, job)
    JOB_END_RINGS.labels(identity.cluster_name).inc()
    return 202, {"cluster": identity.cluster_name}


class _NodeIdsByName:
    """Per cluster ``{node name: id}``, cached for 30 s (refreshed at once on a miss)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[float, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def get(self, cluster_id: int, *, refresh: bool = False) -> dict[str, int]:
        cached = self._maps.get(cluster_id)
        now = time.monotonic()
        if cached is None or (refresh and cached[0] + 1.0 < now) or cached[0] + _NAME_MAP_TTL_S < now:
            names = dict(Node.objects.filter(cluster_id=cluster_id).values_list("name", "pk"))
            with self._lock:
                self._maps[cluster_id] = (now, names)
            return names
        return cached[1]

    def forget(self, cluster_id: int) -> None:
        self._maps.pop(cluster_id, None)


_node_ids = _NodeIdsByName()


ENDPOINTS: dict[str, Callable[[Any, str], Answer]] = {
    "register": register,
    "describe": describe,
    "nodes": inventory,
    "heartbeat": heartbeat,
    "report": report,
    "attempts": attempts,
    "ended": ended,
}
