"""Scheduler metrics, in django-prometheus' registry (served at /metrics). Queue state under
Kueue's names is read from the database at each scrape instead (``scheduling.queue_metrics``)."""

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
CYCLES_ABORTED = Counter(
    "orrery_scheduler_cycles_aborted_total",
    "Cycles rolled back by the database, by reason: conflict (another scheduler's writes won), "
    "timeout (a statement, lock wait or pause past ORRERY_SCHEDULER_STALL_S), connection (lost).",
    ["reason"],
)
CYCLES_SKIPPED = Counter(
    "orrery_scheduler_cycles_skipped_total",
    "Cycles that did nothing because another scheduler held the lock.",
)
TAKEOVERS = Counter(
    "orrery_scheduler_takeovers_total", "Stalled holders of the scheduling lock terminated and replaced."
)
LAST_CYCLE_AGE = Gauge(
    "orrery_scheduler_last_cycle_age_seconds",
    "Seconds since the last committed cycle of any scheduler (SchedulerState.last_cycle_at), "
    "as of this process's last cycle attempt.",
)
PREEMPTIONS = Counter(
    "orrery_scheduler_preemptions_total",
    "Jobs preempted, by reason: within_queue (for a higher-priority job of the same queue), "
    "reclaim (for a queue taking back GPU quota it lent its cohort).",
    ["reason"],
)
BACKFILLED = Counter(
    "orrery_scheduler_backfilled_total",
    "Jobs started on nodes that hold a reservation for a job ahead of them (they end before it).",
)
RESERVATIONS = Gauge(
    "orrery_scheduler_reservations", "Blocked jobs holding a reservation after the last cycle."
)
