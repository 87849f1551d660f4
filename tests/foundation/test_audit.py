"""The audit log: every change an operator or a user asks for leaves exactly one entry naming
who, what and from which address, in the same transaction as the change; the database refuses
to rewrite or delete an entry, on PostgreSQL and on SQLite alike."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, connections, transaction
from django.db.models import Max
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from clusters.adapters.slurm.api import SlurmError
from clusters.models import JoinToken, PosixAccount
from clusters.services import onboarding
from clusters.services.onboarding import onboard_slurm
from foundation import audit
from foundation.choices import AuditAction
from foundation.models import AuditEntry
from portal.models import ApiToken
from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.jobs import JobRequest, cancel_job, submit_jobs
from tests.factories import gpu_model, make_job
from tests.portal.api.conftest import job_spec

pytestmark = pytest.mark.django_db
ADDR = "203.0.113.7"
ROOT = Path(__file__).resolve().parent.parent.parent
RECORDINGS = ROOT / "tests" / "clusters" / "recordings"


@pytest.fixture
def w(api, client, alice, operator, queue, node) -> SimpleNamespace:
    """Alice with a bearer-token client, an operator signed in to the console, a queue, a node."""
    console = client
    console.force_login(operator)
    return SimpleNamespace(
        api=api(alice),
        ops_api=api(operator),
        console=console,
        alice=alice,
        operator=operator,
        queue=queue,
        node=node,
    )


@pytest.fixture
def alice_session(alice):
    """Alice signed in with a session (the portal), as opposed to her bearer token."""
    session = APIClient()
    session.force_login(alice)
    return session


def entries_after(mark: int) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(pk__gt=mark).order_by("id"))


def last_id() -> int:
    return AuditEntry.objects.aggregate(m=Max("id"))["m"] or 0


# Each scenario prepares what its action needs and returns the action: a callable that asks
# for the change over HTTP from ADDR and returns the entry it expects (action, actor, target).
Scenario = Callable[[SimpleNamespace], Callable[[], tuple[str, Any, str]]]


def _submit(w):
    def act():
        answer = w.api.post("/api/v1/jobs", job_spec(), format="json", REMOTE_ADDR=ADDR)
        assert answer.status_code == 201, answer.content
        return AuditAction.JOB_SUBMIT, w.alice, f"job:{answer.json()['id']}"

    return act


def _job_action(verb: str, state: str, action: str) -> Scenario:
    def scenario(w):
        job = make_job(w.alice, w.queue, state=JobState.HELD if state == JobState.HELD else JobState.PENDING)
        if state == JobState.SCHEDULED:
            bind_job(job, [NodePlacement(w.node, [0])])

        def act():
            answer = w.api.post(f"/api/v1/jobs/{job.pk}/{verb}", REMOTE_ADDR=ADDR)
            assert answer.status_code == 200, answer.content
            return action, w.alice, f"job:{job.pk}"

        return act

    return scenario


def _node_action(verb: str, action: str, state: str = "ready") -> Scenario:
    def scenario(w):
        w.node.state = state
        w.node.save(update_fields=["state"])

        def act():
            url = reverse("admin:clusters_node_changelist")
            w.console.post(url, {"action": verb, "_selected_action": [w.node.pk]}, REMOTE_ADDR=ADDR)
            return action, w.operator, "node:sim-a/a-n001"

        return act

    return scenario


def _cluster_action(verb: str, action: str, kind: str) -> Scenario:
    def scenario(w):
        def act():
            url = reverse("admin:clusters_cluster_changelist")
            w.console.post(url, {"action": verb, "_selected_action": [w.node.cluster_id]}, REMOTE_ADDR=ADDR)
            prefix = AuditEntry.objects.latest("id").target.split(":")[1]
            assert prefix.startswith({"join_token": "orj_", "cluster_credential": "orc_"}[kind])
            return action, w.operator, f"{kind}:{prefix}"

        return act

    return scenario


def _revoke_join_token(w):
    token = JoinToken.objects.create(
        cluster=w.node.cluster,
        prefix="orj_abcd",
        digest="d" * 64,
        expires_at=timezone.now() + timedelta(hours=1),
    )

    def act():
        url = reverse("admin:clusters_jointoken_changelist")
        w.console.post(url, {"action": "revoke", "_selected_action": [token.pk]}, REMOTE_ADDR=ADDR)
        return AuditAction.CREDENTIAL_REVOKE, w.operator, "join_token:orj_abcd"

    return act


def _token_create(w):
    def act():
        answer = w.api.post("/api/v1/tokens", {"name": "laptop"}, format="json", REMOTE_ADDR=ADDR)
        assert answer.status_code == 201, answer.content
        return AuditAction.TOKEN_CREATE, w.alice, f"token:{answer.json()['token'][:10]}"

    return act


def _token_revoke(w):
    token = ApiToken.objects.filter(user=w.alice).get()

    def act():
        assert w.api.delete(f"/api/v1/tokens/{token.pk}", REMOTE_ADDR=ADDR).status_code == 204
        return AuditAction.TOKEN_REVOKE, w.alice, f"token:{token.prefix}"

    return act


def _token_in_console(w):
    def act():
        url = reverse("admin:portal_apitoken_add")
        w.console.post(
            url,
            {"user": w.alice.pk, "name": "ci", "scopes": ["read"], "expires_in_days": ""},
            REMOTE_ADDR=ADDR,
        )
        return AuditAction.TOKEN_CREATE, w.operator, f"token:{ApiToken.objects.get(name='ci').prefix}"

    return act


def _account(verb: str, action: str) -> Scenario:
    def scenario(w):
        url = "/api/v1/clusters/sim-a/accounts/alice"
        if verb == "delete":
            assert w.ops_api.put(url, {"username": "alice"}, format="json").status_code == 201

        def act():
            answer = getattr(w.ops_api, verb)(url, {"username": "alice"}, format="json", REMOTE_ADDR=ADDR)
            assert answer.status_code in (201, 204), answer.content
            return action, w.operator, "account:sim-a/alice"

        return act

    return scenario


def _account_in_console(verb: str, action: str) -> Scenario:
    def scenario(w):
        if verb == "delete":
            account = PosixAccount.objects.create(cluster=w.node.cluster, user=w.alice, username="alice")

        def act():
            if verb == "add":
                body = {"cluster": w.node.cluster_id, "user": w.alice.pk, "username": "alice"}
                w.console.post(reverse("admin:clusters_posixaccount_add"), body, REMOTE_ADDR=ADDR)
                assert PosixAccount.objects.filter(user=w.alice, username="alice").exists()
            else:
                url = reverse("admin:clusters_posixaccount_delete", args=[account.pk])
                w.console.post(url, {"post": "yes"}, REMOTE_ADDR=ADDR)
                assert not PosixAccount.objects.exists()
            return action, w.operator, "account:sim-a/alice"

        return act

    return scenario


SCENARIOS: dict[str, Scenario] = {
    "submit": _submit,
    "cancel": _job_action("cancel", JobState.PENDING, AuditAction.JOB_CANCEL),
    "hold": _job_action("hold", JobState.PENDING, AuditAction.JOB_HOLD),
    "release": _job_action("release", JobState.HELD, AuditAction.JOB_RELEASE),
    "requeue": _job_action("requeue", JobState.SCHEDULED, AuditAction.JOB_REQUEUE),
    "drain": _node_action("drain", AuditAction.NODE_DRAIN),
    "cordon": _node_action("cordon", AuditAction.NODE_CORDON),
    "resume": _node_action("resume", AuditAction.NODE_RESUME, state="cordoned"),
    "join-token": _cluster_action("new_join_token", AuditAction.JOIN_TOKEN_CREATE, "join_token"),
    "collector": _cluster_action(
        "new_collector_credential", AuditAction.CLUSTER_CREDENTIAL_CREATE, "cluster_credential"
    ),
    "revoke-join-token": _revoke_join_token,
    "token-create": _token_create,
    "token-revoke": _token_revoke,
    "token-in-console": _token_in_console,
    "map-account": _account("put", AuditAction.ACCOUNT_MAP),
    "unmap-account": _account("delete", AuditAction.ACCOUNT_UNMAP),
    "map-in-console": _account_in_console("add", AuditAction.ACCOUNT_MAP),
    "unmap-in-console": _account_in_console("delete", AuditAction.ACCOUNT_UNMAP),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_action_leaves_one_entry_with_actor_address_and_target(w, name):
    act = SCENARIOS[name](w)
    mark = last_id()
    action, actor, target = act()
    [entry] = entries_after(mark)
    assert (entry.action, entry.target, entry.source) == (action, target, ADDR)
    assert (entry.actor_id, entry.actor_name) == (actor.pk, actor.get_username())


def test_a_batch_is_one_entry_with_the_count_and_the_ids(w):
    mark = last_id()
    documents = [job_spec(metadata__name=f"b{i}") for i in range(3)]
    answer = w.api.post("/api/v1/jobs/batch", {"jobs": documents}, format="json", REMOTE_ADDR=ADDR)
    assert answer.status_code == 201, answer.content
    ids = [job["id"] for job in answer.json()["jobs"]]
    [entry] = entries_after(mark)
    assert entry.action == AuditAction.JOB_SUBMIT and entry.target == f"jobs:{ids[0]}-{ids[-1]}"
    token = ApiToken.objects.filter(user=w.alice).latest("created_at")
    assert entry.details == {
        "count": 3,
        "ids": ids,
        "queues": ["vision/default"],
        "via": f"token:{token.prefix}",
    }


def test_an_entry_names_the_token_that_acted_and_only_for_its_request(w, alice_session):
    job = make_job(w.alice, w.queue)
    mark = last_id()
    assert w.api.post(f"/api/v1/jobs/{job.pk}/hold", REMOTE_ADDR=ADDR).status_code == 200
    assert alice_session.post(f"/api/v1/jobs/{job.pk}/release", REMOTE_ADDR=ADDR).status_code == 200
    held, released = entries_after(mark)
    assert held.details["via"].startswith("token:orr_") and "via" not in released.details


def test_an_idempotent_retry_changes_nothing_and_records_nothing(w):
    headers = {"HTTP_IDEMPOTENCY_KEY": "once", "REMOTE_ADDR": ADDR}
    assert w.api.post("/api/v1/jobs", job_spec(), format="json", **headers).status_code == 201
    mark = last_id()
    assert w.api.post("/api/v1/jobs", job_spec(), format="json", **headers).status_code == 200
    assert entries_after(mark) == []


def test_submission_writes_one_audit_row_however_many_jobs(alice, queue, node, settings):
    """The audit insert is one statement per submission: a 200-job array costs what one job does."""
    settings.ORRERY_MAX_WAITING_JOBS_PER_PROJECT = 1000
    h100 = gpu_model("h100")
    counts = []
    for size in (1, 200):
        requests = [
            JobRequest(name=f"n{i}", queue=queue, gpu_model=h100, gpus_per_node=1) for i in range(size)
        ]
        with CaptureQueriesContext(connection) as queries:
            jobs, _ = submit_jobs(requests, actor=alice, batch=True)
        inserts = [
            q for q in queries.captured_queries if q["sql"].startswith('INSERT INTO "foundation_auditentry"')
        ]
        assert len(inserts) == 1
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1]
    entry = AuditEntry.objects.latest("id")
    assert entry.details["count"] == 200 and entry.details["ids"] == [j.pk for j in jobs]


def test_ids_in_an_entry_are_capped():
    assert audit.capped(list(range(5000))) == {"count": 5000, "ids": list(range(1000))}


def test_bulk_cancel_from_the_jobs_page_records_each_job(client, alice, queue):
    jobs = [make_job(alice, queue) for _ in range(2)]
    client.force_login(alice)
    mark = last_id()
    client.post("/jobs/cancel/", {"job": [j.pk for j in jobs], "next": "/jobs/"}, REMOTE_ADDR=ADDR)
    found = sorted((e.target, e.action, e.actor_name, e.source) for e in entries_after(mark))
    assert found == [(f"job:{j.pk}", AuditAction.JOB_CANCEL, "alice", ADDR) for j in jobs]


# --- where a request comes from ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("behind_proxy", "forwarded", "source"),
    [
        (False, "198.51.100.9", ADDR),  # no proxy: the header is the client's word, ignored
        (True, "198.51.100.9", "198.51.100.9"),
        (True, "10.6.6.6, 198.51.100.9", "198.51.100.9"),  # the left part is the client's, spoofable
        (True, "", ADDR),
    ],
    ids=["ignored-without-proxy", "proxy", "rightmost-wins", "absent"],
)
def test_forwarded_for_counts_only_behind_a_proxy(w, settings, behind_proxy, forwarded, source):
    settings.ORRERY_BEHIND_PROXY = behind_proxy
    mark = last_id()
    answer = w.api.post(
        "/api/v1/jobs", job_spec(), format="json", REMOTE_ADDR=ADDR, HTTP_X_FORWARDED_FOR=forwarded
    )
    assert answer.status_code == 201
    assert [e.source for e in entries_after(mark)] == [source]


def test_outside_a_request_the_source_is_system(node):
    with transaction.atomic():
        entry = audit.record(AuditAction.NODE_DRAIN, actor=None, target="node:x")
    assert (entry.source, entry.actor_id, entry.actor_name) == ("system", None, "")


def test_a_command_records_no_actor_and_never_the_secret(capsys):
    call_command("create_join_token", "lab", "--name", "shell")
    plaintext = capsys.readouterr().out.strip()
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.actor_id, entry.target) == (
        AuditAction.JOIN_TOKEN_CREATE,
        None,
        f"join_token:{plaintext[:10]}",
    )
    assert plaintext.startswith("orj_") and plaintext not in json.dumps(entry.details)


def test_manage_py_names_its_commands_cli():
    code = "from foundation import audit; print(audit.current_source())"
    run = subprocess.run(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"DJANGO_SETTINGS_MODULE": "tests.settings"},
    )
    assert run.stdout.strip() == "cli", run.stderr


# --- the entry and the change land together ---------------------------------------------------


class Boom(Exception):
    pass


def test_a_rolled_back_action_leaves_no_entry(alice, queue):
    job = make_job(alice, queue)
    mark = last_id()
    with pytest.raises(Boom), transaction.atomic():
        cancel_job(job, actor=alice)
        raise Boom
    assert entries_after(mark) == [] and Job.objects.get(pk=job.pk).state == JobState.PENDING


def test_a_change_whose_entry_cannot_be_written_does_not_happen(alice, queue):
    if connection.vendor != "postgresql":
        pytest.skip("refuses new entries with a PostgreSQL constraint")
    job = make_job(alice, queue)
    with connection.cursor() as cursor:  # undone with the test's transaction
        cursor.execute("ALTER TABLE foundation_auditentry ADD CONSTRAINT refuse_all CHECK (false) NOT VALID")
    with pytest.raises(IntegrityError):
        cancel_job(job, actor=alice)
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING


@pytest.mark.django_db(transaction=True)
def test_recording_outside_a_transaction_is_refused():
    with pytest.raises(RuntimeError, match="inside the change's transaction"):
        audit.record(AuditAction.NODE_DRAIN, actor=None, target="node:x")
    assert not AuditEntry.objects.exists()


# --- append-only, on both engines -------------------------------------------------------------


@pytest.mark.django_db(databases=["default", "sqlite"])
@pytest.mark.parametrize("using", ["default", "sqlite"])
@pytest.mark.parametrize(
    "attack",
    [
        lambda rows: rows.update(target="job:0"),
        lambda rows: rows.update(actor_name=""),
        lambda rows: rows.delete(),
        lambda rows: rows.get().delete(),
    ],
    ids=["rewrite-target", "erase-actor", "delete-queryset", "delete-row"],
)
def test_the_database_refuses_to_change_or_delete_an_entry(using, attack):
    vendor = connections[using].vendor
    assert vendor == ("sqlite" if using == "sqlite" else connections["default"].vendor)
    entry = AuditEntry.objects.using(using).create(
        action=AuditAction.JOB_CANCEL, actor_name="ops", source=ADDR, target="job:1"
    )
    rows = AuditEntry.objects.using(using).filter(pk=entry.pk)
    with pytest.raises(IntegrityError, match="append-only"), transaction.atomic(using=using):
        attack(rows)
    assert rows.get().target == "job:1" and rows.get().actor_name == "ops"


def test_deleting_a_user_keeps_their_entries_as_they_were(alice, queue):
    job = make_job(alice, queue)
    cancel_job(job, actor=alice)
    entry = AuditEntry.objects.get(action=AuditAction.JOB_CANCEL)
    alice_id = alice.pk
    Job.objects.filter(owner=alice).delete()
    alice.delete()
    entry.refresh_from_db()
    assert (entry.actor_id, entry.actor_name) == (alice_id, "alice")


# --- onboarding a Slurm cluster ---------------------------------------------------------------


@pytest.fixture
def slurmrestd() -> Iterator[str]:
    """A stand-in for slurmrestd that replays recorded answers (tests/clusters/recordings) over
    real HTTP: onboarding needs an answering slurmrestd, and the real one runs only under the
    ``slurm`` fixture."""
    nodes = (RECORDINGS / "slurm-22.05-nodes.json").read_bytes()

    class Replay(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = nodes if self.path.endswith("/nodes") else b'{"errors": []}'
            found = self.path.startswith("/slurm/v0.0.38/")
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if found else b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_onboarding_records_the_cluster_never_the_token(operator, slurmrestd):
    with audit.source(ADDR):
        onboard_slurm("hpc", slurmrestd, "jwt-secret-value", actor=operator)
    entry = AuditEntry.objects.get(action=AuditAction.CLUSTER_ONBOARD)
    assert (entry.target, entry.actor_name, entry.source) == ("cluster:hpc", "ops", ADDR)
    assert entry.details == {"kind": "slurm", "url": slurmrestd, "user": "root", "created": True}
    assert "jwt-secret-value" not in json.dumps(entry.details)


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("http://head:6820", "http://head:6820"),
        ("https://user:secret@head:6820/api?token=abc#x", "https://head:6820/api"),
    ],
    ids=["plain", "credentials-and-query"],
)
def test_an_onboarding_url_is_kept_without_credentials(url, kept):
    assert onboarding._shown(url) == kept


def test_a_failed_onboarding_records_nothing(operator):
    with pytest.raises(SlurmError):
        onboard_slurm("hpc", "http://127.0.0.1:9", "jwt", actor=operator)
    assert not AuditEntry.objects.exists()


# --- exporting from the shell -----------------------------------------------------------------


def test_audit_export_writes_a_time_range_as_json_lines(tmp_path):
    for day in (1, 2, 3):
        AuditEntry.objects.create(
            at=f"2030-01-0{day}T12:00:00Z", action=AuditAction.JOB_CANCEL, source="cli", target=f"job:{day}"
        )
    out = tmp_path / "audit.jsonl"
    call_command(
        "audit_export", "--format", "jsonl", "--since", "2030-01-02", "--until", "2030-01-03", "-o", out
    )
    assert [json.loads(line)["target"] for line in out.read_text().splitlines()] == ["job:2"]


def test_audit_export_refuses_a_date_it_cannot_read():
    with pytest.raises(CommandError, match="--since"):
        call_command("audit_export", "--since", "yesterday-ish")


def test_mappings_edited_on_the_cluster_page_go_through_the_services(w, bob):
    """The inline on the cluster page: a new row maps, a row moved to another user unmaps the old
    user first, a deleted row unmaps."""
    from django.forms.models import model_to_dict

    cluster = w.node.cluster
    moved = PosixAccount.objects.create(cluster=cluster, user=w.alice, username="alice")
    form = {k: v for k, v in model_to_dict(cluster).items() if k != "config" and v is not None}
    rows = {
        "accounts-TOTAL_FORMS": 2,
        "accounts-INITIAL_FORMS": 1,
        "accounts-0-id": moved.pk,
        "accounts-0-cluster": cluster.pk,
        "accounts-0-user": bob.pk,
        "accounts-0-username": "bob",
        "accounts-1-cluster": cluster.pk,
        "accounts-1-user": w.operator.pk,
        "accounts-1-username": "ops",
    }
    mark = last_id()
    url = reverse("admin:clusters_cluster_change", args=[cluster.pk])
    answer = w.console.post(url, form | rows, REMOTE_ADDR=ADDR)
    assert answer.status_code == 302, answer.content.decode()[:3000]
    found = sorted((e.action, e.target) for e in entries_after(mark))
    assert found == [
        (AuditAction.ACCOUNT_MAP, "account:sim-a/bob"),
        (AuditAction.ACCOUNT_MAP, "account:sim-a/ops"),
        (AuditAction.ACCOUNT_UNMAP, "account:sim-a/alice"),
    ]
    assert dict(PosixAccount.objects.values_list("user__username", "username")) == {
        "bob": "bob",
        "ops": "ops",
    }

    mark = last_id()
    rows = {"accounts-TOTAL_FORMS": 2, "accounts-INITIAL_FORMS": 2}
    for i, account in enumerate(PosixAccount.objects.order_by("pk")):
        rows |= {f"accounts-{i}-id": account.pk, f"accounts-{i}-cluster": cluster.pk}
        rows |= {f"accounts-{i}-user": account.user_id, f"accounts-{i}-username": account.username}
    rows["accounts-0-DELETE"] = "on"
    assert w.console.post(url, form | rows, REMOTE_ADDR=ADDR).status_code == 302
    assert [(e.action, e.source) for e in entries_after(mark)] == [(AuditAction.ACCOUNT_UNMAP, ADDR)]
