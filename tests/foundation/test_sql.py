"""``new_instances`` makes what keyword arguments make: the same field values, the same related
objects cached, a new row's state, and each callable default called afresh per row."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.db import connection

from clusters.models import GpuModel
from clusters.selectors import resolve_gpu_model
from foundation.sql import COPY_FROM_ROWS, _plain_types, copy_create, new_instances
from portal.models import Project
from scheduling.models import Job, JobEvent, Queue
from tests.factories import make_project, make_queue, make_user


def made_alike(made, expected) -> None:
    assert type(made) is type(expected)
    fields = {k: v for k, v in made.__dict__.items() if k != "_state"}
    assert fields == {k: v for k, v in expected.__dict__.items() if k != "_state"}
    assert list(fields) == [k for k in expected.__dict__ if k != "_state"]
    assert made._state.fields_cache == expected._state.fields_cache
    assert (made._state.adding, made._state.db) == (expected._state.adding, expected._state.db)
    assert made._state.adding


def test_jobs_and_events_are_made_as_keywords_make_them():
    owner = get_user_model()(pk=7, username="alice")
    project = Project(pk=3, name="vision")
    queue = Queue(pk=5, name="default", project=project)
    h100 = GpuModel(pk=2, slug="h100")
    rows = [
        {"owner": owner, "project": project, "queue": queue, "gpu_model": h100, "name": "a", "priority": 3},
        {
            "owner": owner,
            "project": project,
            "queue": queue,
            "gpu_model": None,
            "name": "b",
            "labels": {"x": "1"},
        },
        {"owner_id": 7, "project_id": 3, "queue_id": 5, "name": "c", "state": "HELD", "time_limit_s": None},
    ]
    jobs = new_instances(Job, rows)
    for made, row in zip(jobs, rows, strict=True):
        made_alike(made, Job(**row))
    assert jobs[0].labels == {} and jobs[0].labels is not jobs[2].labels  # a callable default per row
    assert jobs[0].queue is queue and jobs[1].gpu_model is None
    event = {"job": jobs[0], "kind": "SUBMITTED", "to_state": "PENDING", "actor": owner, "message": "m"}
    made_alike(new_instances(JobEvent, [event])[0], JobEvent(**event))


def test_an_unknown_field_is_refused_as_keywords_would():
    with pytest.raises(TypeError, match="nodez"):
        new_instances(Job, [{"name": "a", "nodez": 2}])


SAMPLES = {str: "x\\t\\N", int: 7, bool: True, float: 1.5, type(None): None}


@pytest.mark.django_db
def test_what_copy_streams_as_it_is_django_would_pass_on_unchanged():
    """For every column of every model, each type ``copy_create`` streams unprepared is one whose
    value Django's own preparation keeps: equal, and written by the driver as the same text
    (PostgreSQL's integer columns get the driver's ``Int4``-like wrappers, which write the same
    digits; a float in an integer column would not)."""
    written = _driver_text()
    checked = 0
    for model in apps.get_models():
        for field in model._meta.concrete_fields:
            for kind in _plain_types(field):
                sample = SAMPLES[kind]
                prepared = field.get_db_prep_save(sample, connection)
                where = (model.__name__, field.name, kind)
                assert prepared == sample and written(prepared) == written(sample), where
                checked += 1
    assert checked > 300


def _driver_text():
    """How the driver writes a value to ``COPY``'s text stream (the value itself off PostgreSQL)."""
    connection.ensure_connection()
    if connection.vendor != "postgresql":
        return lambda value: value
    from psycopg.adapt import PyFormat, Transformer

    transformer = Transformer(connection.connection)
    return lambda value: (
        None if value is None else bytes(transformer.get_dumper(value, PyFormat.TEXT).dump(value))
    )


@pytest.mark.django_db
def test_few_rows_are_inserted_as_bulk_create_inserts_them():
    """Under ``COPY_FROM_ROWS`` rows, ``copy_create`` writes one ``INSERT … RETURNING`` of its
    own: the stored rows must not tell it from Django's ``bulk_create``, nor the instances."""
    owner = make_user("alice")
    queue = make_queue(make_project("vision", members=(owner,)))
    h100 = GpuModel.objects.get(slug=resolve_gpu_model("h100").slug)
    labels = {"tab": "a\tb", "quote": 'say "hi"\\', "nested": {"list": [1, None, True]}}
    rows = [
        {
            "owner": owner,
            "project": queue.project,
            "queue": queue,
            "gpu_model": h100,
            "name": "a",
            "labels": labels,
        },
        {
            "owner": owner,
            "project": queue.project,
            "queue": queue,
            "gpu_model": None,
            "name": "b",
            "priority": 2.0,
        },
        {
            "owner_id": owner.pk,
            "project_id": queue.project_id,
            "queue_id": queue.pk,
            "name": "c",
            "state": "HELD",
        },
    ]
    ours = copy_create(Job, new_instances(Job, rows))
    djangos = Job.objects.bulk_create(new_instances(Job, rows))
    assert len(ours) < COPY_FROM_ROWS
    assert [j.pk for j in ours] == sorted(j.pk for j in ours) and ours[-1].pk < djangos[0].pk
    assert all(not j._state.adding and j._state.db == "default" for j in ours)
    skip = {"id", "submitted_at"}
    columns = [f.attname for f in Job._meta.concrete_fields if f.attname not in skip]
    stored = {j.pk: j for j in Job.objects.all()}
    for mine, theirs in zip(ours, djangos, strict=True):
        assert {c: getattr(stored[mine.pk], c) for c in columns} == {
            c: getattr(stored[theirs.pk], c) for c in columns
        }
        assert mine.submitted_at == stored[mine.pk].submitted_at
    assert stored[ours[0].pk].labels == labels and stored[ours[1].pk].priority == 2
