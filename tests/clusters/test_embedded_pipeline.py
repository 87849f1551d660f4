"""The reporting pipeline on the embedded default — SQLite and the in-process buffer — run in a
fresh interpreter configured like ``make demo`` (no DATABASE_URL, no REDIS_URL)."""

from __future__ import annotations

from tests.processes import run_embedded

SCRIPT = r"""
import json, time
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from datetime import timedelta
from django.utils import timezone
from clusters.ingest.buffer import get_buffer, MemoryBuffer
from clusters.models import Cluster, GpuDevice, GpuModel, MetricPoint, Node, NodeLastSeen
from clusters.services.aggregation import flush_heartbeats, sync_telemetry
from clusters.services.lifecycle import run_node_lifecycle

assert isinstance(get_buffer(), MemoryBuffer)
cluster = Cluster.objects.create(name="emb", kind="simulated", state="ready")
model = GpuModel.objects.get(slug="h100-80g")
nodes = [Node.objects.create(cluster=cluster, name=f"n{i}", state="ready", gpu_capacity=2) for i in range(5)]
for n in nodes:
    for g in range(2):
        GpuDevice.objects.create(node=n, index=g, model=model, memory_mb=1)

def record(n, seq, t, health="healthy", boot="b1"):
    gpus = [[g, "", "", 0, 10, 50.0, 200.0, 40.0, health if g == 1 else "healthy", 79 if health != "healthy" else None]
            for g in range(2)]
    return {"n": n.pk, "c": cluster.pk, "b": boot, "q": seq, "t": t, "s": "", "cpu": 0.5, "mem": 1, "pw": 1.0,
            "av": "x", "g": gpus, "r": []}

now = time.time()
get_buffer().put([record(n, 1, now - 100) for n in nodes])
first = flush_heartbeats()
get_buffer().put([record(n, 2, now) for n in nodes[:4]] + [record(nodes[4], 2, now, health="unhealthy", boot="b2")])
second = flush_heartbeats()
sync_telemetry()
lifecycle = run_node_lifecycle(timezone.now() + timedelta(seconds=5))
print(json.dumps({
    "first": [first.nodes, first.changed], "second": [second.nodes, second.changed],
    "seqs": sorted(NodeLastSeen.objects.values_list("seq", flat=True)),
    "good_since_reset": NodeLastSeen.objects.filter(good_since__gt=timezone.now() - timedelta(seconds=50)).count(),
    "unhealthy": list(GpuDevice.objects.filter(health="unhealthy").values_list("node__name", "index", "last_xid")),
    "boot": Node.objects.get(name="n4").boot_id,
    "points": sorted(MetricPoint.objects.values_list("resolution", "samples")),
    "util": GpuDevice.objects.filter(utilization=50.0).count(),
    "not_ready": len(lifecycle.not_ready),
}))
"""


def test_pipeline_on_sqlite_and_the_memory_buffer(tmp_path):
    seen = run_embedded(SCRIPT, tmp_path, timeout=120)
    assert seen["first"] == [5, 5] and seen["second"] == [5, 1]
    assert seen["seqs"] == [2, 2, 2, 2, 2]
    assert seen["good_since_reset"] == 5  # 100 s of silence ended the earlier run of heartbeats
    assert seen["unhealthy"] == [["n4", 1, 79]] and seen["boot"] == "b2"
    assert seen["points"] == [["1h", 20], ["1m", 20]]
    assert seen["util"] == 10 and seen["not_ready"] == 0
