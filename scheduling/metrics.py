"""Scheduler metrics, in django-prometheus' registry (served at /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

CYCLE_SECONDS = Histogram(
    "orrery_scheduler_cycle_seconds",
    "Duration of one scheduling cycle.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ATTEMPTS = Counter("orrery_scheduler_attempts_total", "Scheduling attempts by result.", ["result"])
PENDING_JOBS = Gauge("orrery_scheduler_pending_jobs", "Pending jobs by queue.", ["queue"])
GPUS = Gauge(
    "orrery_gpus", "GPUs by model, cluster and kind (total, allocated).", ["model", "cluster", "kind"]
)
