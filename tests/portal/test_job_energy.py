"""A job's energy where users look: the API (detail and list), the job page, ``orrery show``."""

from __future__ import annotations

import pytest

from clusters.models import Node
from portal.cli.render import energy as energy_text
from scheduling.choices import JobState
from scheduling.models import Job, JobAttempt, Queue
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.transitions import transition_job
from tests.factories import make_job
from tests.portal.cli_runs import alice_world, cli_env, run_cli

JOBS = "/api/v1/jobs"
# Two attempts: 1.5 kWh then 0.25 kWh, at 0.2 per kWh and 300 g of CO₂ per kWh.
READINGS = [(1500.0, 0.3, 450.0), (250.0, 0.05, 75.0)]
TOTAL = {"kwh": 1.75, "cost": 0.35, "co2Kg": 0.525}


def ran_twice(owner, queue, node) -> Job:
    """A job that ran, was requeued and runs again, with the meter's readings of each attempt."""
    job = make_job(owner, queue, gpus=2)
    bind_job(job, [NodePlacement(node, [0, 1])])
    transition_job(job.pk, JobState.PENDING)
    bind_job(Job.objects.get(pk=job.pk), [NodePlacement(node, [2, 3])])
    for number, (wh, cost, co2) in enumerate(READINGS, start=1):
        JobAttempt.objects.filter(job=job, number=number).update(energy_wh=wh, energy_cost=cost, co2_g=co2)
    return job


@pytest.mark.django_db
def test_the_api_shows_a_jobs_energy_over_its_attempts(api, alice, queue, node):
    job = ran_twice(alice, queue, node)
    waiting = make_job(alice, queue)
    client = api(alice)
    assert client.get(f"{JOBS}/{job.pk}").json()["energy"] == TOTAL
    listed = {row["id"]: row["energy"] for row in client.get(JOBS).json()["results"]}
    assert listed == {job.pk: TOTAL, waiting.pk: {"kwh": 0.0, "cost": 0.0, "co2Kg": 0.0}}


@pytest.mark.django_db
def test_the_job_page_shows_its_energy_and_each_attempts(client, alice, queue, node):
    job = ran_twice(alice, queue, node)
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "<dt>Used</dt><dd>1.750 kWh</dd>" in page
    assert "<dt>Cost</dt><dd>0.35</dd>" in page and "<dt>CO₂</dt><dd>0.525 kg</dd>" in page
    assert "<dt>Attempt 1</dt><dd>1.500 kWh</dd>" in page and "<dt>Attempt 2</dt><dd>0.250 kWh</dd>" in page


@pytest.mark.django_db
def test_a_job_never_placed_shows_no_energy(client, alice, queue):
    job = make_job(alice, queue)
    client.force_login(alice)
    assert 'id="job-energy"' not in client.get(f"/jobs/{job.pk}/").content.decode()


@pytest.mark.parametrize(
    ("job", "text"),
    [
        ({"attempts": 2, "energy": TOTAL}, "1.750 kWh, cost 0.35, 0.525 kg CO2"),
        ({"attempts": 0, "energy": {"kwh": 0.0, "cost": 0.0, "co2Kg": 0.0}}, None),
        ({"attempts": 1}, None),
    ],
    ids=["ran", "never-placed", "server-without-energy"],
)
def test_show_words_the_energy(job, text):
    assert energy_text(job) == text


@pytest.mark.django_db(transaction=True)
def test_orrery_show_prints_the_energy(live_server, tmp_path):
    alice, token = alice_world()
    job = ran_twice(alice, Queue.objects.get(project__name="vision"), Node.objects.get())
    env = cli_env(tmp_path)
    assert run_cli(env, "login", "--server", live_server.url, "--token", token).returncode == 0
    shown = run_cli(env, "show", str(job.pk))
    assert shown.returncode == 0, shown.stderr
    assert "Energy: 1.750 kWh, cost 0.35, 0.525 kg CO2" in shown.stdout
