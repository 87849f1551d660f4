"""Prometheus metrics of the reporting pipeline (served at /metrics with the others)."""

from prometheus_client import Counter, Histogram

REPORTS = Counter("orrery_heartbeat_reports_total", "Node reports received, by result.", ["result"])
FLUSH_SECONDS = Histogram(
    "orrery_heartbeat_flush_seconds",
    "Duration of one aggregation pass.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
FLUSHED_NODES = Counter("orrery_heartbeat_flushed_nodes_total", "Node records written by aggregation passes.")
NODE_TRANSITIONS = Counter("orrery_node_transitions_total", "Node state changes by lifecycle.", ["to_state"])
FAILOVER_PAUSED = Counter(
    "orrery_failover_paused_total",
    "Lifecycle passes that held back failover because most of a cluster was silent.",
    ["cluster"],
)
LIFECYCLE_DEAF = Counter(
    "orrery_lifecycle_deaf_passes_total",
    "Lifecycle passes that judged no silence because the control plane itself could not hear "
    "(heartbeat flush behind, or back for less than the grace time).",
)
RECOVERIES_DAMPED = Counter(
    "orrery_node_recoveries_damped_total",
    "Lifecycle passes that kept a node not ready because it flapped: its run of heartbeats was "
    "long enough for NODE_RECOVERY but not for the longer run its recent flaps require.",
)
INGEST_REFUSED = Counter(
    "orrery_ingest_refused_total",
    "Agent requests answered 429 or 503 with Retry-After, by reason.",
    ["reason"],
)
POWER_ACTIONS = Counter(
    "orrery_power_actions_total",
    "Nodes power saving asked to power down or up (operators' actions and the periodic pass), by "
    "action (down, up) and result (done; refused: not recommended any more, a placement won, or "
    "the cluster said no).",
    ["action", "result"],
)
JOB_END_RINGS = Counter(
    "orrery_cluster_job_end_rings_total",
    "Rings from a cluster's own scheduler that one of its jobs ended (agent/ended), by cluster.",
    ["cluster"],
)
