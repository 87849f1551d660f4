"""Getting decided work onto clusters and reading back what happened, for every kind alike.

* ``works`` — the one place attempts become ``Work`` values for adapters;
* ``outbox`` — one drain loop over the dispatch outbox for every kind;
* ``remote`` — the one place a cluster's ``RemoteState`` becomes a job transition;
* ``sync`` — the periodic (and woken) sync of clusters that are polled;
* ``agent`` — the native agents' side of the protocol: desired attempts, applying reports;
* ``desired`` — the per-node cache of desired attempts.

Nothing here knows a kind by name: kinds differ only inside their adapters
(``clusters/adapters/``).
"""
