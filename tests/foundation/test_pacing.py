"""``foundation.pacing.due``: work on its own interval under a faster beat, shared through the
cache (Redis under ``make test``)."""

from __future__ import annotations

import uuid

from foundation.pacing import SLACK_S, due


def test_a_pass_is_due_once_per_interval():
    key = f"test:pace:{uuid.uuid4()}"
    assert due(key, 10, now=100.0)  # never done: due, and recorded
    assert not due(key, 10, now=101.0)
    assert not due(key, 10, now=109.0 - SLACK_S - 0.01)
    assert due(key, 10, now=110.0 - SLACK_S)  # the slack lets a 2 s beat hit a 10 s pace on time
    assert not due(key, 10, now=111.0)


def test_keys_keep_their_own_pace():
    slurm, kube = f"test:pace:{uuid.uuid4()}", f"test:pace:{uuid.uuid4()}"
    assert due(slurm, 10, now=0.0) and due(kube, 2, now=0.0)
    assert [due(slurm, 10, now=t) for t in (2.0, 4.0)] == [False, False]
    assert [due(kube, 2, now=t) for t in (2.0, 4.0)] == [True, True]
