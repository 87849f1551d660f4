"""The scheduler engine: everything that decides where pending jobs run.

``framework`` (extension points, statuses, per-cycle state), ``registry`` (plugin name → class),
``policies`` (profiles), ``plugins/`` (one module per plugin), ``queue`` (pending jobs in
equivalence classes), ``snapshot`` (the fleet as numpy columns), ``cache`` (snapshot and queue
kept current from the event logs) and ``cycle/`` (one scheduling cycle, one module per phase).
Plugins see only the framework and the snapshot; of the engine, only the cache and the cycle's
phases touch the database.
"""
