"""The REST API under ``/api/v1/``: parse → access → one service call → render."""

from __future__ import annotations

from functools import cache
from typing import Any, NoReturn

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Exists, OuterRef, QuerySet
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import status
from rest_framework.exceptions import NotFound, ParseError, PermissionDenied
from rest_framework.generics import GenericAPIView, ListAPIView, RetrieveAPIView
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from clusters.adapters.kubernetes.client import KubeError
from clusters.adapters.slurm.api import SlurmError
from clusters.choices import NodeState
from clusters.models import Cluster, GpuModel, Node, NodeEvent, PosixAccount
from clusters.selectors import all_clusters, cluster_by_name, gpu_catalog, node_events, resolve_gpu_model
from clusters.services.identity import map_account, unmap_account
from clusters.services.onboarding import onboard_kubernetes, onboard_slurm
from foundation.sql import columns_of, from_row, is_postgresql
from portal.access import (
    access_ref,
    access_ref_jobs,
    access_token,
    can_act_on_jobs,
    is_privileged_in,
    submission_queue,
    visible_jobs,
    visible_projects,
    visible_queues,
)
from portal.api.errors import InputError
from portal.api.filters import JOB_FILTERS, filter_jobs
from portal.api.schema import ERROR_SCHEMA, JOB_BATCH_SCHEMA, JOB_SPEC_SCHEMA, JOB_UPDATE_SCHEMA
from portal.api.serializers import (
    ArrayActionSerializer,
    ArraySerializer,
    ClusterOnboardSerializer,
    ClusterSerializer,
    GpuModelSerializer,
    IssuedTokenSerializer,
    JobDetailSerializer,
    JobEventSerializer,
    JobSerializer,
    NodeEventSerializer,
    NodeSerializer,
    PosixAccountSerializer,
    TokenRequestSerializer,
    TokenSerializer,
    job_rows,
)
from portal.api.throttles import ReadThrottle, SubmitThrottle
from portal.choices import Role, Scope
from portal.models import ApiToken, Membership, Project
from portal.selectors import api_tokens, memberships
from portal.services.tokens import TokenRefused, issue_token, revoke_token
from scheduling.choices import JobState
from scheduling.models import Job, Queue
from scheduling.refs import JobRef
from scheduling.selectors import (
    array_rows,
    array_summary,
    collapse_waiting_members,
    fleet_capacity,
    job_events,
    jobs_by_id,
    jobs_with_placement,
    log_tail,
    node_rows,
    queue_gpu_rows,
)
from scheduling.services.jobs import (
    JobRequest,
    act_on_jobs,
    cancel_job,
    checkpoint_job,
    hold_job,
    release_job,
    requeue_job,
    submit_jobs,
)
from scheduling.services.submission import build_requests
from scheduling.services.transitions import InvalidTransition
from scheduling.services.updates import UpdateRefused, parse_changes, update_jobs
from scheduling.spec import SpecError, parse_job_spec

MAX_BATCH = 1000
MAX_BATCH_JOBS = 10_000
ERRORS = {code: OpenApiResponse(ERROR_SCHEMA) for code in (400, 401, 403, 404, 409, 422, 429)}
# One job's detail, or counts for many (an array, a range of members).
JOB_OR_MANY = PolymorphicProxySerializer(
    component_name="JobOrMany",
    serializers=[JobDetailSerializer, ArrayActionSerializer],
    resource_type_field_name=None,
)


class IdCursor(CursorPagination):
    ordering = "-id"
    page_size = 100
    page_size_query_param = "limit"
    max_page_size = 1000
    position_type: type = int

    def decode_cursor(self, request: Request) -> Any:
        """DRF trusts the position inside a cursor; a forged one must be a 404, not a 500."""
        cursor = super().decode_cursor(request)
        if cursor is not None and cursor.position is not None:
            try:
                self.position_type(cursor.position)
            except (TypeError, ValueError):
                raise NotFound(self.invalid_cursor_message) from None
        return cursor


class NameCursor(IdCursor):
    ordering = "name"
    position_type = str


# --- jobs -------------------------------------------------------------------------------------


class JobListView(GenericAPIView):
    """``GET`` lists the jobs you can see; ``POST`` submits one job spec (JSON or YAML)."""

    serializer_class = JobSerializer
    pagination_class = IdCursor
    write_scope = Scope.SUBMIT

    def get_throttles(self) -> list[Any]:
        return [SubmitThrottle()] if self.request.method == "POST" else [ReadThrottle()]

    def get_queryset(self) -> QuerySet[Job]:
        return jobs_with_placement(self._filtered())

    def _filtered(self) -> QuerySet[Job]:
        params = self.request.query_params
        jobs = filter_jobs(visible_jobs(self.request.user), params)
        if (raw := params.get("array")) is not None:
            if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 18):
                raise InputError([("query.array", "must be an array id, e.g. 74")])
            jobs = jobs.filter(array_id=int(raw))
        return jobs

    @extend_schema(
        parameters=[
            *(OpenApiParameter(name, str, description=f"filter by {name}") for name in JOB_FILTERS),
            OpenApiParameter("array", int, description="only the members of this array"),
            OpenApiParameter(
                "arrays",
                str,
                enum=["expand", "summary"],
                description="summary: the waiting members of an array in one state as one row (squeue)",
            ),
        ],
        responses={200: JobSerializer(many=True), **ERRORS},
    )
    def get(self, request: Request) -> Response:
        mode = request.query_params.get("arrays", "expand")
        if mode not in ("expand", "summary"):
            raise InputError([("query.arrays", "must be expand or summary")])
        if mode == "expand":
            page = self.paginate_queryset(self.get_queryset())
            return self.get_paginated_response(job_rows(page))
        filtered = self._filtered()
        page = self.paginate_queryset(jobs_with_placement(collapse_waiting_members(filtered)))
        context = {"array_rows": array_rows(filtered, page)}
        return self.get_paginated_response(job_rows(page, context))

    @extend_schema(
        request={"application/json": JOB_SPEC_SCHEMA, "application/yaml": JOB_SPEC_SCHEMA},
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                description="A retry with the same key returns the same job (200).",
            ),
            OpenApiParameter("dryRun", bool, description="Validate only; create nothing."),
        ],
        responses={201: JobDetailSerializer, 200: JobDetailSerializer, **ERRORS},
    )
    def post(self, request: Request) -> Response:
        requests = one_job_requests(request.user, request.data)
        if _flag(request, "dryRun"):
            return Response({"valid": True, "jobs": len(requests), "spec": requests[0].spec})
        jobs, created = submit_jobs(requests, actor=request.user, idempotency_key=_idempotency_key(request))
        return Response(submitted_job(jobs[0], created, requests[0]), status=201 if created else 200)


def one_job_requests(user: Any, data: Any, *, text_checked: bool = False) -> list[JobRequest]:
    """``POST jobs``: the one job a document asks for, checked (``SpecError``, ``InputError``,
    ``ParseError``). The view and the WSGI fast path (``portal.api.fastpath``) both use it;
    ``text_checked`` as for ``parse_job_spec``."""
    spec = parse_job_spec(_document(data), text_checked=text_checked)
    queue, privileged = _queue_of(user, spec.project, spec.queue)
    requests = build_requests(spec, queue, owner=user, privileged=privileged)
    if len(requests) != 1:
        raise InputError([("spec.array", "submit arrays to jobs/batch")], "Invalid job spec.")
    return requests


def submitted_job(job: Job, created: bool, request: JobRequest) -> dict[str, Any]:
    """The answer's body: the job made, or the one an earlier request with the key made."""
    if created:  # a new job has no attempts yet, and carries its owner, project and queue
        job._prefetched_objects_cache = {"attempts": []}
        if not request.dependency:  # nothing to read back: the detail's rows written out
            return job_rows([job])[0] | {"spec": job.spec, "dependency": []}
    else:
        job = jobs_by_id([job.pk]).get()
    return JobDetailSerializer(job).data


def _queue_of(user: Any, project: str | None, queue: str, *, path: str = "") -> tuple[Queue, bool]:
    """``submission_queue`` and ``is_privileged_in`` (the queue a spec names, if the user may
    submit to it; whether they may pass its limits for members): one query for a member who
    names the project, those functions for anyone else and for every refusal."""
    if project is not None and not user.is_staff:
        found = _member_queue(user, project, queue)
        if found is not None:
            return found
    chosen = submission_queue(user, project, queue, path=path)
    return chosen, is_privileged_in(user, chosen)


def _member_queue(user: Any, project: str, queue: str) -> tuple[Queue, bool] | None:
    """The queue ``project/queue`` with its project if ``user`` is a member, and whether they
    manage the project; on PostgreSQL in one query written out (the ORM's took three times as
    long to build as to run)."""
    if not is_postgresql():
        managers = Membership.objects.filter(user=user, project_id=OuterRef("project_id"), role=Role.MANAGER)
        found = (
            Queue.objects.select_related("project")
            .filter(project__name=project, name=queue, project__memberships__user=user)
            .annotate(submitter_manages=Exists(managers))
            .first()
        )
        return None if found is None else (found, found.submitter_manages)
    with connection.cursor() as cursor:
        cursor.execute(_member_queue_sql(), [Role.MANAGER, project, queue, user.pk])
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(Queue._meta.concrete_fields)
    found = from_row(Queue, row[:split])
    Queue.project.field.set_cached_value(found, from_row(Project, row[split:-1]))
    return found, row[-1]


@cache
def _member_queue_sql() -> str:
    q, p, m = Queue._meta.db_table, Project._meta.db_table, Membership._meta.db_table
    return (
        f"SELECT {columns_of(Queue, 'q')}, {columns_of(Project, 'p')}, EXISTS (SELECT 1 FROM {m} mm "
        "WHERE mm.user_id = m.user_id AND mm.project_id = q.project_id AND mm.role = %s) "
        f"FROM {q} q JOIN {p} p ON p.id = q.project_id JOIN {m} m ON m.project_id = p.id "
        "WHERE p.name = %s AND q.name = %s AND m.user_id = %s LIMIT 1"
    )


class JobBatchView(APIView):
    """``POST`` many specs (``{"jobs": [...]}``, a YAML list, or several YAML documents) in one
    transaction: all are accepted or none. ``spec.array`` expands server-side."""

    throttle_classes = [SubmitThrottle]
    write_scope = Scope.SUBMIT

    @extend_schema(
        request={"application/json": JOB_BATCH_SCHEMA, "application/yaml": JOB_BATCH_SCHEMA},
        parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)],
        responses={201: JobSerializer(many=True), 200: JobSerializer(many=True), **ERRORS},
    )
    def post(self, request: Request) -> Response:
        requests = batch_requests(request.user, request.data)
        jobs, created = submit_jobs(
            requests, actor=request.user, idempotency_key=_idempotency_key(request), batch=True
        )
        return Response(submitted_batch(jobs, created, requests), status=201 if created else 200)


def batch_requests(user: Any, data: Any, *, text_checked: bool = False) -> list[JobRequest]:
    """``POST jobs/batch``: the jobs of every spec of a batch, checked; one error lists every
    spec's faults. The lookups are made once per batch (specs of a batch mostly share them).
    ``text_checked`` as for ``parse_job_spec``."""
    documents = data.get("jobs") if isinstance(data, dict) and set(data) == {"jobs"} else data
    if not isinstance(documents, list) or not documents:
        raise InputError([("jobs", "must be a non-empty list of job specs")])
    if len(documents) > MAX_BATCH:
        raise InputError([("jobs", f"at most {MAX_BATCH} specs per batch; use spec.array for sweeps")])
    errors: list[tuple[str, str]] = []
    requests: list[JobRequest] = []
    queues: dict[tuple[str | None, str], tuple[Queue, bool]] = {}  # and may the user pass its limits
    models: dict[Any, Any] = {}
    for i, document in enumerate(documents):
        try:
            spec = parse_job_spec(document, path=f"jobs[{i}]", text_checked=text_checked)
            named = (spec.project, spec.queue)
            if named not in queues:
                queues[named] = _queue_of(user, spec.project, spec.queue, path=f"jobs[{i}]")
            queue, privileged = queues[named]
            requests += build_requests(
                spec,
                queue,
                owner=user,
                path=f"jobs[{i}]",
                models=models,
                privileged=privileged,
            )
        except SpecError as exc:
            errors += exc.errors
        if len(requests) > MAX_BATCH_JOBS:
            raise InputError([("jobs", f"a batch makes at most {MAX_BATCH_JOBS} jobs (arrays included)")])
    if errors:
        raise SpecError(errors)
    return requests


def submitted_batch(jobs: list[Job], created: bool, requests: list[JobRequest]) -> dict[str, Any]:
    """The answer's body: the jobs made (as they are in memory, when nothing changed them on the
    way in: no dependency, no budget holding them), or those an earlier request with the key
    made."""
    pending = all(job.state == JobState.PENDING for job in jobs)
    if created and pending and not any(r.dependency for r in requests):
        for job in jobs:
            job._prefetched_objects_cache = {"attempts": []}
    else:
        jobs = list(jobs_by_id(j.pk for j in jobs))
    rows = job_rows(jobs)
    return {"count": len(rows), "jobs": rows}


class JobDetailView(APIView):
    """``GET jobs/{ref}``: one job (``74``, or ``74_3`` for a member of array 74). ``PATCH``
    changes a waiting job (``scontrol update``): ``timeLimit`` (members may only lower it),
    ``priority`` (within the queue's limits), ``name``, ``hold`` (true: hold, false: release),
    ``throttle`` (an array's: on every member); ``version`` makes it a compare-and-set. On an
    array's id or a range of members, every waiting member matched changes."""

    write_scope = Scope.SUBMIT

    def get_throttles(self) -> list[Any]:
        return [SubmitThrottle()] if self.request.method == "PATCH" else [ReadThrottle()]

    @extend_schema(responses={200: JobDetailSerializer, **ERRORS})
    def get(self, request: Request, ref: JobRef) -> Response:
        job = access_ref(request.user, _single(ref), jobs_with_placement(visible_jobs(request.user)))
        return Response(JobDetailSerializer(job).data)

    @extend_schema(
        request={"application/json": JOB_UPDATE_SCHEMA, "application/yaml": JOB_UPDATE_SCHEMA},
        responses={200: JOB_OR_MANY, **ERRORS},
    )
    def patch(self, request: Request, ref: JobRef) -> Response:
        try:
            changes = parse_changes(request.data)
        except UpdateRefused as exc:
            raise InputError(exc.errors, "Invalid update.") from None
        jobs, many = _actionable(request.user, ref)
        members = list(jobs.values_list("pk", "array_id", "array_index", "queue_id"))
        queue = Queue.objects.get(pk=members[0][3])
        try:
            outcome = update_jobs(
                [pk for pk, *_ in members],
                changes,
                actor=request.user,
                privileged=is_privileged_in(request.user, queue),
                target=f"job:{ref}",
            )
        except UpdateRefused as exc:
            raise InputError(exc.errors, "Invalid update.") from None
        if not many:
            return Response(JobDetailSerializer(_fresh(request.user, members[0][0])).data)
        return Response(_many_answer(ref, members, outcome.changed))


@extend_schema_view(get=extend_schema(responses={200: JobEventSerializer(many=True), **ERRORS}))
class JobEventsView(ListAPIView):
    serializer_class = JobEventSerializer
    throttle_classes = [ReadThrottle]
    pagination_class = None

    def get_queryset(self) -> QuerySet:
        job = access_ref(self.request.user, _single(self.kwargs["ref"]))
        return job_events(job)


class JobLogsView(APIView):
    """The tail of a job's output. Empty until the job has run on a cluster that ships logs."""

    throttle_classes = [ReadThrottle]

    @extend_schema(
        parameters=[OpenApiParameter("tail", int, description="last N lines (1–10000, default 100)")],
        responses={200: OpenApiTypes.OBJECT, **ERRORS},
    )
    def get(self, request: Request, ref: JobRef) -> Response:
        job = access_ref(request.user, _single(ref))
        raw = request.query_params.get("tail", "100")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 5) or not 1 <= int(raw) <= 10_000:
            raise InputError([("query.tail", "must be an integer between 1 and 10000")])
        lines, truncated = log_tail(job.pk, int(raw))
        return Response({"jobId": job.pk, "ref": job.ref, "lines": lines, "truncated": truncated})


class JobActionView(APIView):
    """``POST jobs/{ref}/cancel|hold|release|requeue|checkpoint``: owners, project managers and
    operators. ``checkpoint`` stamps an active job as having just saved its work (409 for a job
    that waits or has ended). On an array's id (``74``: ``scancel 74``) or a range of members
    (``74_[1-5]``), cancel, hold, release and requeue act on every member matched, and answer
    with counts (409 when none could change)."""

    throttle_classes = [SubmitThrottle]
    write_scope = Scope.SUBMIT
    services = {
        "cancel": cancel_job,
        "hold": hold_job,
        "release": release_job,
        "requeue": requeue_job,
        "checkpoint": checkpoint_job,
    }
    verb = ""  # set per URL by as_view(verb=…)

    @extend_schema(request=None, responses={200: JOB_OR_MANY, **ERRORS})
    def post(self, request: Request, ref: JobRef) -> Response:
        jobs, many = _actionable(request.user, ref)
        if not many:
            job = jobs.get()
            try:
                self.services[self.verb](job, actor=request.user)
            except InvalidTransition as exc:  # it names the job id; users know a member as 74_3
                raise InvalidTransition(job.ref, exc.current, exc.to) from None
            return Response(JobDetailSerializer(_fresh(request.user, job.pk)).data)
        if self.verb == "checkpoint":
            raise InputError([("ref", "a checkpoint is recorded for one job; name one member, e.g. 74_3")])
        members = list(jobs.values_list("pk", "array_id", "array_index"))
        outcome = act_on_jobs(self.verb, [pk for pk, *_ in members], actor=request.user, target=f"jobs:{ref}")
        if not outcome.moved:
            states = ", ".join(sorted(set(jobs.values_list("state", flat=True))))
            detail = f"None of the {len(members)} jobs of {ref} could be changed: they are {states}."
            return Response({"detail": detail, "errors": []}, status=status.HTTP_409_CONFLICT)
        return Response(_many_answer(ref, members, outcome.moved))


class ArrayDetailView(APIView):
    """``GET arrays/{id}``: an array as a whole — its members in each state, aggregated in SQL."""

    throttle_classes = [ReadThrottle]

    @extend_schema(responses={200: ArraySerializer, **ERRORS})
    def get(self, request: Request, pk: int) -> Response:
        summary = array_summary(visible_jobs(request.user), pk) or _missing()
        first = summary["first"]
        name = first.name.removesuffix(f"-{first.array_index}")
        low, high = summary["low"], summary["high"]
        return Response(
            {
                "arrayId": pk,
                "name": name,
                "owner": first.owner.username,
                "project": first.project.name,
                "queue": first.queue.name,
                "throttle": first.array_throttle,
                "tasks": summary["tasks"],
                "indices": str(low) if low == high else f"{low}-{high}",
                "states": summary["states"],
            }
        )


def _single(ref: JobRef) -> JobRef:
    """``ref`` if it names one job; a range is refused (400) where one job is meant."""
    if not ref.single:
        raise InputError(
            [("ref", f"{ref} names several jobs; name one, e.g. {ref.job_id}_{ref.spans[0][0]}")]
        )
    return ref


def _actionable(user: Any, ref: JobRef) -> tuple[QuerySet[Job], bool]:
    """The jobs ``ref`` acts on, if the user may act on every one of them (403 otherwise)."""
    jobs, many = access_ref_jobs(user, ref)
    if not can_act_on_jobs(user, jobs):
        raise PermissionDenied("Only the job's owner, a manager of its project or an operator may do that.")
    return jobs, many


def _fresh(user: Any, pk: int) -> Job:
    return jobs_with_placement(visible_jobs(user)).get(pk=pk)


def _many_answer(ref: JobRef, members: list[tuple[Any, ...]], changed: list[int]) -> dict[str, Any]:
    refs = {pk: f"{array}_{index}" if array is not None else str(pk) for pk, array, index, *_ in members}
    arrays = {array for _, array, *_ in members}
    return {
        "ref": str(ref),
        "arrayId": arrays.pop() if len(arrays) == 1 else None,
        "matched": len(members),
        "changed": len(changed),
        "unchanged": len(members) - len(changed),
        "changedRefs": [refs[pk] for pk in changed[:1000]],
    }


# --- fleet, projects, me ----------------------------------------------------------------------


class ProjectListView(APIView):
    throttle_classes = [ReadThrottle]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        roles = {m.project_id: m.role for m in memberships(request.user)}
        projects = visible_projects(request.user).prefetch_related("queues").order_by("name")
        return Response(
            {
                "results": [
                    {
                        "name": p.name,
                        "displayName": p.display_name,
                        "role": roles.get(p.pk),
                        "queues": sorted(q.name for q in p.queues.all()),
                    }
                    for p in projects
                ]
            }
        )


class QueueListView(APIView):
    """Queues you can see, with quota per GPU model against what the queue holds now."""

    throttle_classes = [ReadThrottle]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        queues = list(visible_queues(request.user).order_by("project__name", "name"))
        gpus, jobs = queue_gpu_rows(q.pk for q in queues)
        results = [
            {
                "project": q.project.name,
                "name": q.name,
                "priority": q.priority,
                "fairShareWeight": q.fair_share_weight,
                "cohort": q.cohort or None,
                "maxPendingJobs": q.max_pending_jobs,
                "maxPendingJobsPerUser": q.max_pending_jobs_per_user,
                "maxMemberPriority": q.max_member_priority,
                "maxTimeLimitSeconds": q.max_time_limit_s,
                "preemptWithinQueue": q.preempt_within_queue,
                "reclaimWithinCohort": q.reclaim_within_cohort,
                "preemptionGraceSeconds": q.preemption_grace_s,
                "gpuModelPreference": q.gpu_model_preference,
                "gpus": [row | {"quota": row["quota"] or 0} for row in gpus[q.pk]],
                "jobs": jobs.get(q.pk, {}),
            }
            for q in queues
        ]
        return Response({"results": results})


class ClusterListView(ListAPIView):
    """Every cluster; ``POST`` (operators) onboards a Slurm or Kubernetes cluster after a
    connection test."""

    serializer_class = ClusterSerializer
    throttle_classes = [ReadThrottle]
    pagination_class = None
    write_scope = Scope.OPERATE

    def get_queryset(self) -> QuerySet[Cluster]:
        return all_clusters()

    def get_serializer_context(self) -> dict[str, Any]:
        return super().get_serializer_context() | {"capacity": fleet_capacity()}

    @extend_schema(
        request=ClusterOnboardSerializer,
        responses={201: ClusterSerializer, 403: OpenApiResponse(ERROR_SCHEMA), **ERRORS},
    )
    def post(self, request: Request) -> Response:
        if not request.user.has_perm("clusters.onboard_cluster"):
            raise PermissionDenied("Adding clusters needs the 'onboard clusters' permission.")
        form = ClusterOnboardSerializer(data=request.data if isinstance(request.data, dict) else {})
        form.is_valid(raise_exception=True)
        data = form.validated_data
        if data["kind"] == "kubernetes":
            cluster = _onboard_kubernetes(data, request.user)
            context = {"capacity": fleet_capacity([cluster.pk])}
            return Response(ClusterSerializer(cluster, context=context).data, status=status.HTTP_201_CREATED)
        try:
            cluster, _ = onboard_slurm(
                data["name"],
                data["url"],
                data["token"],
                user=data["user"],
                slurm_conf=data["slurmConf"],
                identity=data.get("identity"),
                output_dir=data["outputDir"],
                actor=request.user,
            )
        except SlurmError as exc:
            raise InputError([(exc.field or "url", f"connection test failed: {exc}")]) from None
        context = {"capacity": fleet_capacity([cluster.pk])}
        return Response(ClusterSerializer(cluster, context=context).data, status=status.HTTP_201_CREATED)


def _onboard_kubernetes(data: dict[str, Any], actor: Any) -> Cluster:
    try:
        cluster, _ = onboard_kubernetes(
            data["name"],
            kubeconfig=data.get("kubeconfig", ""),
            url=data.get("url", ""),
            ca=data["caCert"],
            token=data.get("token", ""),
            namespace=data["namespace"],
            identity=data.get("identity"),
            run_as_uid=data.get("runAsUser"),
            run_as_gid=data.get("runAsGroup"),
            uids=data.get("uids"),
            actor=actor,
        )
    except KubeError as exc:
        tested = exc.apiserver or exc.field == "url"
        raise InputError(
            [(exc.field or "url", f"connection test failed: {exc}" if tested else str(exc))]
        ) from None
    return cluster


@extend_schema_view(get=extend_schema(responses={200: ClusterSerializer, 404: OpenApiResponse(ERROR_SCHEMA)}))
class ClusterDetailView(RetrieveAPIView):
    serializer_class = ClusterSerializer
    throttle_classes = [ReadThrottle]

    def get_object(self) -> Cluster:
        self.cluster = cluster_by_name(self.kwargs["name"]) or _missing()
        return self.cluster

    def get_serializer_context(self) -> dict[str, Any]:
        return super().get_serializer_context() | {"capacity": fleet_capacity([self.cluster.pk])}


class ClusterAccountListView(ListAPIView):
    """The POSIX accounts users' work runs under on a cluster: operators see every mapping, a
    user only their own."""

    serializer_class = PosixAccountSerializer
    throttle_classes = [ReadThrottle]
    pagination_class = None

    def get_queryset(self) -> QuerySet[PosixAccount]:
        cluster = cluster_by_name(self.kwargs["name"]) or _missing()
        rows = PosixAccount.objects.filter(cluster=cluster).select_related("user").order_by("user__username")
        return rows if self.request.user.is_staff else rows.filter(user=self.request.user)


class ClusterAccountView(APIView):
    """``PUT`` maps a user to a POSIX account on a cluster (``{"username": "alice"}``), ``DELETE``
    removes the mapping: operators only."""

    throttle_classes = [ReadThrottle]
    write_scope = Scope.OPERATE

    def _target(self, request: Request, name: str, username: str) -> tuple[Cluster, Any]:
        if not request.user.has_perm("clusters.change_posixaccount"):
            raise PermissionDenied("Mapping accounts needs the 'change POSIX account' permission.")
        cluster = cluster_by_name(name) or _missing()
        user = get_user_model().objects.filter(username=username).first() or _missing()
        return cluster, user

    @extend_schema(
        request={"application/json": {"type": "object", "properties": {"username": {"type": "string"}}}},
        responses={200: PosixAccountSerializer, 201: PosixAccountSerializer, **ERRORS},
    )
    def put(self, request: Request, name: str, username: str) -> Response:
        cluster, user = self._target(request, name, username)
        body = request.data if isinstance(request.data, dict) else {}
        posix = body.get("username")
        if not isinstance(posix, str) or not posix:
            raise InputError([("username", "the POSIX account name is required")])
        try:
            account, created = map_account(cluster, user, posix, actor=request.user)
        except ValueError as exc:
            raise InputError([("username", str(exc))]) from None
        return Response(
            PosixAccountSerializer(account).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

    @extend_schema(responses={204: None, **ERRORS})
    def delete(self, request: Request, name: str, username: str) -> Response:
        cluster, user = self._target(request, name, username)
        if not unmap_account(cluster, user, actor=request.user):
            _missing()
        return Response(status=status.HTTP_204_NO_CONTENT)


class NodeListView(ListAPIView):
    """Nodes, filtered by ``cluster``, ``state`` and ``gpuModel`` (a slug or an alias)."""

    serializer_class = NodeSerializer
    throttle_classes = [ReadThrottle]
    pagination_class = NameCursor

    @extend_schema(parameters=[OpenApiParameter(n, str) for n in ("cluster", "state", "gpuModel")])
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self) -> QuerySet[Node]:
        params = self.request.query_params
        states = model = None
        if state := params.get("state"):
            states = state.lower().split(",")
            if unknown := [s for s in states if s not in NodeState.values]:
                raise InputError(
                    [
                        (
                            "query.state",
                            f"unknown node state '{unknown[0][:40]}'; use {', '.join(NodeState.values)}",
                        )
                    ]
                )
        if name := params.get("gpuModel"):
            model = resolve_gpu_model(name)
            if model is None:
                raise InputError([("query.gpuModel", f"unknown GPU model '{name[:40]}'")])
        return node_rows(params.get("cluster"), states, model)


class NodeEventsView(ListAPIView):
    """A node's state history, newest first: lifecycle moves and operators' actions."""

    serializer_class = NodeEventSerializer
    throttle_classes = [ReadThrottle]
    pagination_class = IdCursor

    def get_queryset(self) -> QuerySet[NodeEvent]:
        events = node_events(self.kwargs["pk"])
        return _missing() if events is None else events


class GpuModelListView(ListAPIView):
    serializer_class = GpuModelSerializer
    throttle_classes = [ReadThrottle]
    pagination_class = None

    def get_queryset(self) -> QuerySet[GpuModel]:
        return gpu_catalog()


class MeView(APIView):
    throttle_classes = [ReadThrottle]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        return Response(
            {
                "username": request.user.get_username(),
                "operator": request.user.is_staff,
                "projects": [{"name": m.project.name, "role": m.role} for m in memberships(request.user)],
                "authenticatedWith": "token" if isinstance(request.auth, ApiToken) else "session",
                "token": {"scopes": request.auth.scopes, "expiresAt": request.auth.expires_at}
                if isinstance(request.auth, ApiToken)
                else None,
            }
        )


class TokenListView(APIView):
    """Your API tokens with their scopes, expiry and last use. ``POST`` issues one and shows it
    once; made with a token, it can neither outlive that token nor hold a scope it lacks."""

    throttle_classes = [SubmitThrottle]
    write_scope = Scope.SUBMIT

    @extend_schema(responses={200: inline_serializer("TokenList", {"results": TokenSerializer(many=True)})})
    def get(self, request: Request) -> Response:
        return Response({"results": TokenSerializer(api_tokens(request.user), many=True).data})

    @extend_schema(request=TokenRequestSerializer, responses={201: IssuedTokenSerializer, **ERRORS})
    def post(self, request: Request) -> Response:
        form = TokenRequestSerializer(data=request.data if isinstance(request.data, dict) else {})
        form.is_valid(raise_exception=True)
        data = form.validated_data
        issuer = request.auth if isinstance(request.auth, ApiToken) else None
        try:
            token, plaintext = issue_token(
                request.user,
                name=data["name"],
                scopes=data.get("scopes"),
                expires_in_days=data.get("expiresInDays"),
                issuer=issuer,
                actor=request.user,
            )
        except TokenRefused as exc:
            raise InputError([(exc.field, str(exc))]) from None
        return Response(TokenSerializer(token).data | {"token": plaintext}, status=status.HTTP_201_CREATED)


class TokenDetailView(APIView):
    throttle_classes = [SubmitThrottle]
    write_scope = Scope.SUBMIT

    @extend_schema(responses={204: None, **ERRORS})
    def delete(self, request: Request, pk: int) -> Response:
        token = access_token(request.user, pk)
        revoke_token(token, actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- helpers ----------------------------------------------------------------------------------


def _document(data: Any) -> Any:
    if isinstance(data, list):
        raise ParseError("Expected one job spec; send several to jobs/batch.")
    return data


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in {"1", "true", "yes"}


def _idempotency_key(request: Request) -> str | None:
    return idempotency_key(request.headers.get("Idempotency-Key"))


def idempotency_key(key: str | None) -> str | None:
    """The header's key, stripped; ``InputError`` for one no key can be."""
    if key is None:
        return None
    key = key.strip()
    if not 1 <= len(key) <= 100 or not key.isprintable():
        raise InputError([("header.Idempotency-Key", "must be 1 to 100 printable characters")])
    return key


def _missing() -> NoReturn:
    raise Http404
