"""POSIX identities: work runs only where its owner has an account, mappings are the operators'
to make, and the account travels with the attempt to the cluster."""

from __future__ import annotations

import json

import pytest

from clusters.choices import ClusterKind, Identity
from clusters.models import PosixAccount
from scheduling.dispatch.works import load_works
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Job, JobAttempt
from tests.factories import make_cluster, make_job, make_node
from tests.portal.api.conftest import DELETE, error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")
JOBS = "/api/v1/jobs"


def post(client, document):
    return client.post(JOBS, json.dumps(document), content_type="application/json")


@pytest.fixture
def lab(db):
    """A cluster of agents (real code runs there: an account is needed), beside the simulated one."""
    lab = make_cluster("lab", kind=ClusterKind.NATIVE)
    make_node(lab, gpus=8, model="h100", name="lab-1")
    return lab


def test_naming_a_cluster_where_the_user_has_no_account_is_refused_naming_it(api, alice, lab):
    answer = post(api(alice), job_spec(spec__placement={"clusters": ["sim-a", "lab"]}))
    assert answer.status_code == 400
    assert error_paths(answer) == ["spec.placement.clusters[1]"]
    assert "no POSIX account on cluster 'lab'" in answer.content.decode()
    assert not Job.objects.exists()


def test_without_a_named_cluster_the_job_goes_only_where_its_owner_has_an_account(api, alice, lab):
    answer = post(api(alice), job_spec())
    assert answer.status_code == 201, answer.content
    assert Job.objects.get().placement["clusters"] == ["sim-a"]  # the simulated cluster needs none

    PosixAccount.objects.create(cluster=lab, user=alice, username="alice")
    answer = post(api(alice), job_spec(spec__placement={"clusters": ["lab"]}))
    assert answer.status_code == 201, answer.content
    again = post(api(alice), job_spec())
    assert Job.objects.get(pk=again.json()["id"]).placement["clusters"] == []  # anywhere


def test_a_user_with_no_account_anywhere_is_told_so(api, alice, lab, fleet):
    fleet.cluster.kind = ClusterKind.NATIVE
    fleet.cluster.save()
    answer = post(api(alice), job_spec())
    assert answer.status_code == 400
    assert error_paths(answer) == ["spec.placement.clusters"]
    assert "lab, sim-a" in answer.content.decode()


@pytest.mark.parametrize(
    "identity, username, accepted",
    [
        (Identity.SHARED, "carol", True),
        (Identity.SAME_NAME, "carol", True),
        (Identity.SAME_NAME, "Carol@x", False),
    ],
)
def test_shared_and_same_name_clusters_need_no_mapping(api, lab, identity, username, accepted):
    from tests.factories import make_project, make_queue, make_user

    user = make_user(username)
    make_queue(make_project("p2", members=(user,)))
    lab.identity = identity
    lab.save()
    answer = post(api(user), job_spec(metadata__project="p2", spec__placement={"clusters": ["lab"]}))
    assert (answer.status_code == 201) is accepted, answer.content
    if not accepted:
        assert "is not a POSIX user name" in answer.content.decode()


def test_operators_map_accounts_and_users_see_their_own(api, alice, bob, operator, lab):
    url = "/api/v1/clusters/lab/accounts"
    assert api(alice).put(f"{url}/alice", {"username": "alice"}, format="json").status_code == 403
    made = api(operator).put(f"{url}/alice", {"username": "alice"}, format="json")
    assert made.status_code == 201 and made.json()["username"] == "alice"
    assert api(operator).put(f"{url}/alice", {"username": "al"}, format="json").status_code == 200
    assert api(operator).put(f"{url}/bob", {"username": "bob"}, format="json").status_code == 201
    for bad in ("root", "-rf", "a b", "x" * 40, "", None):
        refused = api(operator).put(f"{url}/bob", {"username": bad}, format="json")
        assert refused.status_code == 400 and error_paths(refused) == ["username"], bad
    assert api(operator).put(f"{url}/nobody-here", {"username": "x"}, format="json").status_code == 404
    assert [a["user"] for a in api(operator).get(url).json()] == ["alice", "bob"]
    assert api(alice).get(url).json() == [
        {"user": "alice", "username": "al", "createdAt": made.json()["createdAt"]}
    ]
    assert api(alice).delete(f"{url}/bob").status_code == 403
    assert api(operator).delete(f"{url}/bob").status_code == 204
    assert api(operator).delete(f"{url}/bob").status_code == 404
    assert api(alice).get("/api/v1/clusters/lab").json()["identity"] == "accounts"


def test_the_account_travels_with_the_attempt(alice, queue, lab):
    PosixAccount.objects.create(cluster=lab, user=alice, username="alice-hpc")
    job = make_job(alice, queue, gpus=1, placement={"clusters": ["lab"], "nodeSelector": {}})
    run_cycle(SchedulerCache())
    attempt = JobAttempt.objects.get(job=job)
    assert attempt.cluster == lab
    [work] = load_works([attempt.pk])
    assert work.run_as == "alice-hpc"
    PosixAccount.objects.all().delete()
    [work] = load_works([attempt.pk])
    assert work.run_as is None  # the agent refuses it, saying why
    lab.identity = Identity.SHARED
    lab.save()
    assert load_works([attempt.pk])[0].run_as == ""  # the node's shared account


def test_an_image_job_goes_to_agents_that_run_podman(api, alice, lab):
    PosixAccount.objects.create(cluster=lab, user=alice, username="alice")
    image_only = job_spec(
        spec__image="localhost/train:1", spec__run=DELETE, spec__placement={"clusters": ["lab"]}
    )
    assert post(api(alice), image_only).status_code == 400  # no node of lab runs podman yet
    node = lab.nodes.get()
    node.labels = {"orrery.io/containers": "podman"}
    node.save()
    answer = post(api(alice), image_only)
    assert answer.status_code == 201, answer.content
    assert Job.objects.get().placement == {
        "clusters": ["lab"],
        "nodeSelector": {"orrery.io/containers": "podman"},
    }


def test_the_console_maps_accounts_on_the_cluster_page(client, operator, lab):
    client.force_login(operator)
    page = client.get(f"/admin/clusters/cluster/{lab.pk}/change/")
    assert page.status_code == 200
    assert b"POSIX account" in page.content and b"Mapped accounts" in page.content
