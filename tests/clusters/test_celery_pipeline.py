"""Real Celery: a worker with its beat drives aggregation and the lifecycle on schedule."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from django.db import connection

from clusters.ingest.buffer import get_buffer
from clusters.models import NodeLastSeen
from tests.factories import make_cluster, make_node
from tests.processes import celery_worker_argv, control_plane_env

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[2]


def test_worker_and_beat_flush_the_buffer(tmp_path):
    cluster = make_cluster("celery-a")
    nodes = [make_node(cluster, gpus=2, name=f"c{i}") for i in range(5)]
    now = time.time()
    get_buffer().put(
        [
            {
                "n": n.pk,
                "c": cluster.pk,
                "b": "boot",
                "q": 7,
                "t": now,
                "s": "",
                "cpu": 0.1,
                "mem": 1,
                "pw": 1.0,
                "av": "x",
                "g": [[0, "", "", 0, 1, 10.0, 100.0, 30.0, "healthy", None]],
                "r": [],
            }
            for n in nodes
        ]
    )
    env = control_plane_env(tmp_path)
    assert connection.vendor == "postgresql", "make test runs on PostgreSQL"
    worker = subprocess.Popen(
        celery_worker_argv(env, tmp_path),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and NodeLastSeen.objects.filter(seq=7).count() < len(nodes):
            time.sleep(0.5)
        assert NodeLastSeen.objects.filter(seq=7).count() == len(nodes)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            output, _ = worker.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            output, _ = worker.communicate()
    assert "Traceback" not in output, output[-3000:]
