"""The facts the submission fast path keeps per process (``foundation.facts``): read once per
generation, and never used past a change — a POSIX account unmapped, a GPU alias removed, a
budget added or a cluster added takes effect on the very next submission."""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from clusters import facts as fleet_facts
from clusters.choices import ClusterKind, ClusterState
from clusters.models import GpuModelAlias, PosixAccount
from clusters.selectors import resolve_gpu_model
from clusters.services.identity import map_account, unmap_account
from foundation import facts
from scheduling.models import Job
from tests.factories import make_budget, make_cluster, make_node
from tests.portal.api.conftest import FastPathHandler, error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")
JOBS = "/api/v1/jobs"
KEPT_TABLES = ("clusters_gpumodel", "clusters_cluster", "clusters_posixaccount", "scheduling_budget")


@pytest.fixture(autouse=True)
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("the facts are kept on PostgreSQL only (elsewhere every request reads them)")


@pytest.fixture
def fast(api):
    def make(user):
        client = api(user)
        client.handler = FastPathHandler(client.handler)
        return client

    return make


def post(client, document):
    return client.post(JOBS, json.dumps(document), content_type="application/json")


def generation() -> int:
    with connection.cursor() as cursor:
        cursor.execute(facts.GENERATION_SQL)
        return cursor.fetchone()[0]


def test_a_second_submission_reads_none_of_the_kept_facts(fast, alice):
    client = fast(alice)
    assert post(client, job_spec(metadata__name="first")).status_code == 201
    with CaptureQueriesContext(connection) as second:
        assert post(client, job_spec(metadata__name="second")).status_code == 201
    assert client.handler.answered == 2
    read = [q["sql"] for q in second.captured_queries if any(t in q["sql"] for t in KEPT_TABLES)]
    assert read == []
    assert len(second.captured_queries) <= 9  # token, queue, lock, count, job, event, audit…


def test_an_unmapped_account_refuses_the_next_submission(fast, alice):
    lab = make_cluster("lab", kind=ClusterKind.NATIVE)
    make_node(lab, gpus=8, model="h100", name="lab-1")
    map_account(lab, alice, "alice")
    client = fast(alice)
    on_lab = job_spec(spec__placement={"clusters": ["lab"]})
    assert post(client, on_lab).status_code == 201
    unmap_account(lab, alice)
    refused = post(client, on_lab)
    assert refused.status_code == 400
    assert error_paths(refused) == ["spec.placement.clusters[0]"]
    map_account(lab, alice, "alice")
    assert post(client, on_lab).status_code == 201


def test_a_removed_alias_and_a_new_cluster_are_seen_at_once(fast, alice):
    GpuModelAlias.objects.create(gpu_model=resolve_gpu_model("h100"), name="hopper")
    client = fast(alice)
    assert post(client, job_spec(spec__resources__gpus="hopper:8")).status_code == 201
    GpuModelAlias.objects.filter(name="hopper").delete()
    refused = post(client, job_spec(spec__resources__gpus="hopper:8"))
    assert refused.status_code == 400 and error_paths(refused) == ["spec.resources.gpus"]

    assert post(client, job_spec(spec__placement={"clusters": ["sim-b"]})).status_code == 400
    make_cluster("sim-b")
    assert post(client, job_spec(spec__placement={"clusters": ["sim-b"]})).status_code == 201


def test_a_budget_added_applies_to_the_next_submission(fast, alice, vision):
    client = fast(alice)
    assert post(client, job_spec(spec__timeLimit="1h")).status_code == 201
    make_budget(vision, 10)
    refused = post(client, job_spec(spec__timeLimit="8h"))  # 64 GPU-hours of 10
    assert refused.status_code == 409, refused.content
    assert Job.objects.count() == 1


def test_a_reservation_keeps_the_generation_and_a_budget_change_moves_it(alice, vision):
    budget = make_budget(vision, 1000)
    before = generation()
    type(budget).objects.filter(pk=budget.pk).update(reserved_gpu_seconds=3600)
    assert generation() == before  # amounts are not facts: submissions do not read them again
    type(budget).objects.filter(pk=budget.pk).update(queue=None)
    assert generation() != before


def test_a_clusters_state_is_not_a_fact_and_its_kind_is(fleet):
    before = generation()
    clusters = type(fleet.cluster).objects.filter(pk=fleet.cluster.pk)
    clusters.update(state=ClusterState.DEGRADED, state_reason="r")
    assert generation() == before  # the lifecycle's updates every few seconds lock nothing more
    type(fleet.cluster).objects.filter(pk=fleet.cluster.pk).update(kind=ClusterKind.NATIVE)
    assert generation() != before


def test_a_request_on_the_older_generation_does_not_empty_the_newer_ones_memo():
    with facts.at_generation(1):
        older = facts.kept()
        older["x"] = 1
    with facts.at_generation(2):
        newer = facts.kept()
        newer["x"] = 2
    with facts.at_generation(1):
        assert facts.kept() is older
    with facts.at_generation(2):
        assert facts.kept() is newer
    with facts.at_generation(3):
        assert facts.kept() == {}
    with facts.at_generation(1):
        assert facts.kept() == {}  # two generations are kept: the first seen went


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_change_never_lends_its_generation_to_another(alice):
    before = generation()
    with pytest.raises(RuntimeError), transaction.atomic():
        make_cluster("gone")
        rolled_back = generation()
        raise RuntimeError
    assert generation() == before
    make_cluster("kept")
    assert generation() not in {before, rolled_back}


def test_names_that_resolve_to_nothing_are_not_kept(alice):
    with facts.at_generation(generation()):
        for i in range(50):
            assert fleet_facts.gpu_model(f"no-such-gpu-{i}") is None
        assert fleet_facts.gpu_model("H100 ") == resolve_gpu_model("h100")
        assert list(facts.kept()["gpu-models"]) == ["h100"]


def test_outside_a_generation_nothing_is_kept(alice, fleet):
    assert facts.kept() is None
    PosixAccount.objects.create(cluster=fleet.cluster, user=alice, username="alice")
    with CaptureQueriesContext(connection) as reads:
        found = [fleet_facts.accounts(alice, [fleet.cluster.pk]) for _ in range(2)]
    assert found == [{fleet.cluster.pk: "alice"}] * 2
    assert len(reads.captured_queries) == 2


@pytest.mark.django_db(transaction=True)
def test_before_the_facts_row_is_migrated_django_answers(fast, alice, caplog):
    """New code rolled out before its migration: the token query cannot read the generation, so
    the fast path leaves the submission to Django, which takes it, rather than answering 500."""
    client = fast(alice)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE clusters_fleet_facts RENAME TO clusters_fleet_facts_later")
    try:
        answer = post(client, job_spec())
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE clusters_fleet_facts_later RENAME TO clusters_fleet_facts")
    assert answer.status_code == 201, answer.content
    assert client.handler.answered == 0
    assert "fast path off" in caplog.text
    assert Job.objects.count() == 1
