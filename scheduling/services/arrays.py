"""Job arrays: the members of one spec's ``array`` share an id, their first member's job id
(Slurm's ``ArrayJobId``), and are each known as ``ID_INDEX`` (``74_3``).

``number`` is called by ``submit_jobs`` inside its transaction, once the jobs have their ids;
the members already carry their index and throttle (``JobRequest``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import models

from scheduling.models import Job


def number(jobs: Sequence[Job], requests: Sequence[Any]) -> None:
    """Give the members of each array among just-created ``jobs`` (in the order of their
    ``requests``) their array id: the job id of the array's first member. One UPDATE per array,
    which also puts ``ORRERY_ARRAY_ID`` in each member's environment; the jobs in memory are
    updated too, so what the caller shows back has the ids. Jobs outside arrays are untouched."""
    arrays: list[list[Job]] = []
    for job, request in zip(jobs, requests, strict=True):
        if request.array_index is None:
            continue
        if request.array_first or not arrays:
            arrays.append([])
        arrays[-1].append(job)
    for members in arrays:
        array_id = members[0].pk
        Job.objects.filter(pk__in=[job.pk for job in members]).update(
            array_id=array_id, spec=_WithEnv(models.F("spec"), "ORRERY_ARRAY_ID", str(array_id))
        )
        for job in members:
            job.array_id = array_id
            job.spec = job.spec | {"env": {**job.spec.get("env", {}), "ORRERY_ARRAY_ID": str(array_id)}}


class _WithEnv(models.Func):
    """``spec`` with one more environment variable, set in SQL (every member at once)."""

    output_field = models.JSONField()

    def __init__(self, spec: Any, name: str, value: str) -> None:
        super().__init__(spec)
        self.name, self.value = name, value

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:  # type: ignore[override]
        spec, params = compiler.compile(self.source_expressions[0])
        if connection.vendor == "postgresql":
            return f"jsonb_set({spec}, %s::text[], to_jsonb(%s::text))", [
                *params,
                f"{{env,{self.name}}}",
                self.value,
            ]
        return f"json_set({spec}, %s, %s)", [*params, f"$.env.{self.name}", self.value]
