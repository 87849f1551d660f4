"""A cluster's own scheduler rings Orrery when one of its jobs ends (``POST agent/ended``, rung
by Slurm's ``EpilogSlurmctld`` through ``clusters/adapters/slurm/orrery-epilog``): the cluster is
synced at once instead of at its next poll, a burst of rings is one queued sync, and nothing of
the body is believed but the cluster's name."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from django.core.cache import cache
from django.test import Client

from clusters.choices import ClusterKind
from clusters.services.credentials import create_join_token, issue_cluster_credential, revoke
from scheduling import wakeup
from scheduling.tasks import sync_cluster_task
from tests.factories import make_cluster
from tests.processes import wait

pytestmark = pytest.mark.django_db
EPILOG = Path(__file__).resolve().parents[2] / "clusters/adapters/slurm/orrery-epilog"


def ring(client: Client, body, bearer: str = ""):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {bearer}"} if bearer else {}
    return client.post("/api/v1/agent/ended", body, content_type="application/json", **headers)


def raw_ring(client: Client, body: bytes, bearer: str):
    return client.post(
        "/api/v1/agent/ended", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {bearer}"
    )


@pytest.fixture
def sent(settings, monkeypatch) -> list[tuple[str, tuple, dict]]:
    """The tasks the wake-ups send (a broker is not needed to see them)."""
    settings.REDIS_URL = "redis://wake-ups-only"  # wake-ups are a Celery feature
    cache.clear()
    tasks: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(
        wakeup, "_send", lambda task, **o: tasks.append((task, tuple(o.get("args", ())), o.get("kwargs", {})))
    )
    assert hasattr(cache, "set_take"), "rung jobs are noted in Redis: run with REDIS_URL, as make test does"
    return tasks


@pytest.fixture
def hpc():
    return make_cluster("hpc", kind=ClusterKind.SIMULATED)  # a polled kind, as Slurm is


def test_a_ring_syncs_the_cluster_now_and_a_burst_is_one_queued_sync(client, hpc, sent):
    _, credential = issue_cluster_credential(hpc, name="epilog")
    for job in ("101", "102", "103"):
        answer = ring(client, {"cluster": "hpc", "job": job}, credential)
        assert answer.status_code == 202, answer.content
        assert answer.json() == {"cluster": "hpc"}
    assert sent == [(wakeup.SYNC_TASK, (hpc.pk,), {"rung": True})]  # one sync for the burst
    sync_cluster_task(hpc.pk, rung=True)  # it starts: an end rung from now on is read by the next
    assert ring(client, {"cluster": "hpc", "job": "104"}, credential).status_code == 202
    assert len(sent) == 2 and sent[1] == sent[0]
    other = make_cluster("other", kind=ClusterKind.SIMULATED)
    _, theirs = issue_cluster_credential(other)
    assert ring(client, {"cluster": "other", "job": "1"}, theirs).status_code == 202
    assert sent[2] == (wakeup.SYNC_TASK, (other.pk,), {"rung": True})  # each cluster its own bell


def test_the_rung_jobs_are_taken_by_one_sync_each_once(client, hpc, sent):
    _, credential = issue_cluster_credential(hpc)
    for job in ("101", "102", "101"):
        ring(client, {"cluster": "hpc", "job": job}, credential)
    assert wakeup.rung_jobs(hpc.pk) == {"101", "102"}
    assert wakeup.rung_jobs(hpc.pk) == set()  # taken: each is read once


def test_a_rung_job_still_being_cleaned_up_is_read_again_a_bounded_number_of_times(
    hpc, sent, alice, queue, monkeypatch
):
    """The read-back itself is Slurm's (``test_slurm_live``); here the adapter's answer is
    given, to see what the sync does with a job ended, one still completing, and one that has
    been read back too often."""
    from clusters.adapters.base import Phase, RemoteState, Synced
    from clusters.adapters.simulated import SimulatedAdapter
    from scheduling.dispatch import sync
    from scheduling.models import JobAttempt
    from tests.factories import make_job, make_node

    make_node(hpc, gpus=8, name="h0")
    jobs = [make_job(alice, queue, gpus=1) for _ in range(3)]
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle

    assert run_cycle(SchedulerCache()).placed == 3
    attempts = [JobAttempt.objects.get(job=job) for job in jobs]
    for n, attempt in enumerate(attempts):
        JobAttempt.objects.filter(pk=attempt.pk).update(remote_id=f"70{n}")
    done, completing, tired = (str(a.pk) for a in attempts)

    def read_back(self, cluster, works):
        assert {w.remote_id for w in works} == {"700", "701", "702"}
        return Synced(
            states=[
                RemoteState(done, Phase.SUCCEEDED, "700", exit_code=0),
                RemoteState(completing, Phase.RUNNING, "701"),
                RemoteState(tired, Phase.RUNNING, "702"),
            ],
            again_in_s=0.1,
        )

    monkeypatch.setattr(SimulatedAdapter, "read_back", read_back, raising=False)
    sent.clear()
    counts = sync.sync_rung(hpc, {"700", "701/3", f"702/{sync.MAX_READ_BACKS - 1}", "999"})
    assert counts.moved >= 1
    assert JobAttempt.objects.get(pk=done).active is False
    assert wakeup.rung_jobs(hpc.pk) == {"701/4"}  # read again, counted; the tired one is left
    assert sent == [(wakeup.SYNC_TASK, (hpc.pk,), {"rung": True})]


def test_a_sync_woken_otherwise_leaves_the_bell_alone(client, hpc, sent):
    _, credential = issue_cluster_credential(hpc)
    ring(client, {"cluster": "hpc", "job": "1"}, credential)
    sync_cluster_task(hpc.pk)  # a wake-up after a delivery, not the rung one
    ring(client, {"cluster": "hpc", "job": "2"}, credential)
    assert len(sent) == 1


def test_the_embedded_default_has_no_bell_and_still_answers(client, hpc, settings, monkeypatch):
    settings.REDIS_URL = ""
    monkeypatch.setattr(wakeup, "_send", lambda *a, **k: pytest.fail("nothing is sent without a broker"))
    _, credential = issue_cluster_credential(hpc)
    assert ring(client, {"cluster": "hpc", "job": "1"}, credential).status_code == 202


def test_a_ringing_cluster_is_read_whole_at_the_slower_pace_and_a_silent_one_at_its_own(
    client, hpc, sent, settings, monkeypatch
):
    from scheduling.dispatch import sync

    settings.ORRERY_RUNG_SYNC_EVERY_S = 5.0
    synced: list[str] = []
    monkeypatch.setattr(sync, "sync_cluster", lambda cluster: synced.append(cluster.name))
    make_cluster("quiet", kind=ClusterKind.SIMULATED)
    _, credential = issue_cluster_credential(hpc)
    assert ring(client, {"cluster": "hpc", "job": "1"}, credential).status_code == 202
    assert wakeup.rings(hpc.pk)
    start = time.time()
    for second in range(11):
        sync.sync_due_clusters(now=start + second)
    assert synced.count("quiet") == 11  # its kind's pace: every second
    assert synced.count("hpc") == 3  # at 0, 5 and 10 s: its ends come by ring
    cache.delete(wakeup.ringing_key(hpc.pk))  # a minute without a ring (its epilog broke)
    sync.sync_due_clusters(now=start + 11)
    assert synced.count("hpc") == 4  # polled at its own pace again


def test_with_redis_away_a_ring_is_answered_and_the_cluster_keeps_its_polled_pace(hpc, sent, monkeypatch):
    from foundation.cache import ForgivingRedisCache
    from tests.processes import free_port

    nobody = f"redis://127.0.0.1:{free_port()}/0"
    away = ForgivingRedisCache(nobody, {"OPTIONS": {"socket_connect_timeout": 0.2}})
    monkeypatch.setattr(wakeup, "cache", away)
    wakeup.ring_sync(hpc.pk, "7")  # nothing raises: the note and the doorbell are dropped
    assert not wakeup.rings(hpc.pk)


@pytest.mark.parametrize("rang", [False, True])
def test_a_delivery_wakes_the_whole_sync_only_of_a_cluster_that_does_not_ring(
    client, hpc, sent, alice, queue, rang
):
    from scheduling.dispatch.outbox import drain_outbox
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle
    from tests.factories import make_job, make_node

    make_node(hpc, gpus=8, name="h0")
    make_job(alice, queue, gpus=1)
    if rang:
        _, credential = issue_cluster_credential(hpc)
        assert ring(client, {"cluster": "hpc", "job": "1"}, credential).status_code == 202
    assert run_cycle(SchedulerCache()).placed == 1
    sent.clear()
    assert drain_outbox() == 1
    assert sent.count((wakeup.SYNC_TASK, (hpc.pk,), {})) == (0 if rang else 1)


def test_a_ring_needs_a_live_credential_of_that_cluster(client, hpc, sent):
    _, credential = issue_cluster_credential(hpc)
    other = make_cluster("other", kind=ClusterKind.SIMULATED)
    _, theirs = issue_cluster_credential(other)
    _, join = create_join_token(hpc)
    assert ring(client, {"cluster": "hpc"}).status_code == 401
    assert ring(client, {"cluster": "hpc"}, join).status_code == 401  # a join token is not one
    assert ring(client, {"cluster": "hpc"}, theirs).status_code == 403
    assert ring(client, {"cluster": "other"}, credential).status_code == 403
    assert ring(client, ["hpc"], credential).status_code == 400
    credential_row, revoked = issue_cluster_credential(hpc)
    revoke(credential_row)
    assert ring(client, {"cluster": "hpc"}, revoked).status_code == 401
    assert client.get("/api/v1/agent/ended").status_code == 405
    assert sent == []
    assert not wakeup.rings(hpc.pk) and not wakeup.rings(other.pk)  # a refused ring slows no polling


@pytest.mark.parametrize(
    "job",
    ["", "12a", "1" * 33, "١٢٣", "12\n", "-1", 12, True, ["12"], {"id": "12"}],
    ids=[
        "empty",
        "letters",
        "too-long",
        "arabic-digits",
        "newline",
        "negative",
        "number",
        "bool",
        "list",
        "object",
    ],
)
def test_a_job_that_is_not_a_slurm_id_is_400_with_its_path(client, hpc, sent, job):
    _, credential = issue_cluster_credential(hpc)
    answer = ring(client, {"cluster": "hpc"} if job is None else {"cluster": "hpc", "job": job}, credential)
    assert answer.status_code == 400, answer.content
    assert answer.json()["errors"] == [
        {"path": "job", "message": "must be the Slurm job id: at most 32 digits"}
    ]
    assert sent == []


@pytest.mark.parametrize("body", [b"{", b"null", b"\xff", b"[]"], ids=["truncated", "null", "binary", "list"])
def test_garbage_is_refused_and_nothing_rings(client, hpc, sent, body):
    _, credential = issue_cluster_credential(hpc)
    answer = client.post(
        "/api/v1/agent/ended",
        body,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {credential}",
    )
    assert answer.status_code == 400 and answer.json()["detail"]
    assert sent == []
    assert not wakeup.rings(hpc.pk)


def test_the_fast_path_answers_a_ring_as_django_does(client, hpc, sent):
    from clusters.api.fastpath import AgentFastPath
    from tests.clusters.test_fastpath import call

    _, credential = issue_cluster_credential(hpc)
    fast = AgentFastPath(lambda environ, start_response: pytest.fail("the fast path fell through"))
    for body, expected in (
        (b'{"cluster": "hpc", "job": "7"}', 202),
        (b'{"cluster": "hpc", "job": "x"}', 400),
        (b'{"cluster": "else", "job": "7"}', 403),
        (b"[]", 400),
        (b"{", 400),
    ):
        cache.clear()
        answer = call(fast, "/api/v1/agent/ended", body, credential)
        cache.clear()
        django = client.post(
            "/api/v1/agent/ended",
            body,
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {credential}",
        )
        assert answer == (expected, django.json()) and django.status_code == expected
    assert len(sent) == 2  # each accepted ring, once on each path


def test_a_cluster_whose_agents_report_their_own_ends_is_409(client, sent):
    native = make_cluster("rack", kind=ClusterKind.NATIVE)
    _, credential = issue_cluster_credential(native)
    answer = ring(client, {"cluster": "rack", "job": "1"}, credential)
    assert answer.status_code == 409 and "not polled" in answer.json()["detail"]
    assert sent == []


# --- the epilog script, as slurmctld runs it ---------------------------------------------------


def run_epilog(tmp_path: Path, env: dict[str, str], conf: str | None) -> subprocess.CompletedProcess:
    script = tmp_path / "orrery-epilog"
    script.write_bytes(EPILOG.read_bytes())
    script.chmod(0o755)
    if conf is not None:
        (tmp_path / "orrery-epilog.conf").write_text(conf)
    # slurmctld gives its epilogs no search path and the job's variables only
    return subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=10)


def test_the_epilog_rings_for_orrerys_jobs_with_the_credential_off_the_command_line(tmp_path, catcher):
    server, caught = catcher
    (tmp_path / "credential").write_text("orc_Abc-123_xyz\n")
    # the last line without its newline, as an editor may leave it
    conf = f"url=http://127.0.0.1:{server.server_port}\ncluster=hpc\ncredential_file={tmp_path}/credential"
    done = run_epilog(tmp_path, {"SLURM_JOB_ID": "4242", "SLURM_JOB_COMMENT": "orrery:abc123"}, conf)
    assert done.returncode == 0 and not done.stdout and not done.stderr
    path, headers, body = wait(lambda: caught, "the ring", timeout=5)[0]
    assert path == "/api/v1/agent/ended"
    assert headers["Authorization"] == "Bearer orc_Abc-123_xyz"
    assert body == b'{"cluster":"hpc","job":"4242"}'


@pytest.mark.parametrize(
    "env, conf",
    [
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_COMMENT": "someone else's"}, "ok"),
        ({"SLURM_JOB_ID": "1"}, "ok"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_COMMENT": "orrery:t"}, None),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_COMMENT": "orrery:t"}, "no-credential"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_COMMENT": "orrery:t"}, 'cluster=hpc","x":"y'),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_COMMENT": "orrery:t"}, "bad-credential"),
    ],
    ids=[
        "not-orrerys",
        "no-comment",
        "no-conf",
        "credential-unreadable",
        "cluster-injection",
        "credential-injection",
    ],
)
def test_the_epilog_stays_silent_and_succeeds_when_it_should_not_ring(tmp_path, catcher, env, conf):
    server, caught = catcher
    credential = tmp_path / "credential"
    credential.write_text('orc_x"\nheader = "X-Evil: 1' if conf == "bad-credential" else "orc_good")
    lines = {
        "url": f"http://127.0.0.1:{server.server_port}",
        "cluster": "hpc",
        "credential_file": str(tmp_path / ("missing" if conf == "no-credential" else "credential")),
    }
    if conf and conf.startswith("cluster="):
        lines["cluster"] = conf.removeprefix("cluster=")
    text = None if conf is None else "".join(f"{k}={v}\n" for k, v in lines.items())
    done = run_epilog(tmp_path, env, text)
    assert done.returncode == 0 and not done.stderr
    time.sleep(0.5)  # a ring, had one gone, would have arrived by now
    assert caught == []


def test_the_epilog_returns_at_once_when_orrery_does_not_answer(tmp_path):
    """A control plane that accepts and never answers must not hold slurmctld's epilog."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    (tmp_path / "credential").write_text("orc_good")
    conf = f"url=http://127.0.0.1:{silent.getsockname()[1]}\ncluster=hpc\ncredential_file={tmp_path}/credential\n"
    started = time.monotonic()
    done = run_epilog(tmp_path, {"SLURM_JOB_ID": "1", "SLURM_JOB_COMMENT": "orrery:t"}, conf)
    took = time.monotonic() - started
    silent.close()
    assert done.returncode == 0
    assert took < 1.5, f"the epilog waited {took:.1f} s for the ring"  # curl's own limit is 2 s


def test_the_epilog_is_executable_and_posix_sh(tmp_path):
    assert os.access(EPILOG, os.X_OK)
    assert EPILOG.read_text().startswith("#!/bin/sh\n")
    assert subprocess.run(["sh", "-n", str(EPILOG)], capture_output=True).returncode == 0
