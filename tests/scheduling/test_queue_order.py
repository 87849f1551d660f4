"""The cycle's class order, projects first (``ClassOrder``), against the definition: at every
step the class whose fresh key — (tier, its project's share now, age, id) — is least."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from scheduling.engine.queue import ClassOrder, JobClass


def world(seed: int) -> tuple[dict[int, float], list[JobClass]]:
    rng = random.Random(seed)
    classes, job_id = [], 0
    for c in range(120):
        jobs = []
        for _ in range(rng.randint(1, 30)):
            job_id += 1
            job = SimpleNamespace(
                id=job_id,
                project_id=c % 4,
                priority=rng.choice([0, 0, 0, 100]),
                queue=c % 8,
                submitted_at=float(rng.randint(0, 50)),
            )
            jobs.append(((-job.priority, job.submitted_at, job.id), job))
        jobs.sort(key=lambda member: member[0])
        classes.append(JobClass(("shape", c), jobs))
    return dict.fromkeys(range(4), 0.0), classes


def tier(head) -> tuple:
    return (-(head.queue % 2) * 10, -head.priority)


def rest(head) -> tuple:
    return (head.submitted_at, head.id)


def walk(seed: int, first) -> list[int]:
    """Take classes in ``first``'s order; a fifth do not fit (dropped for the cycle), the rest
    place their head, which raises its project's share, and go back in line."""
    shares, classes = world(seed)
    rng = random.Random(seed)
    taken = []
    for cls in first(shares, classes):
        head = cls.jobs.pop(0)[1]
        taken.append(head.id)
        if rng.random() < 0.2:
            continue
        shares[head.project_id] += rng.choice([0.001, 0.002])
        if cls.jobs:
            yield_back.append(cls)
    return taken


yield_back: list[JobClass] = []


def by_order(shares, classes, calls):
    def share(project: int) -> float:
        calls.append(project)
        return shares[project]

    order = ClassOrder(tier, share, rest)
    for cls in classes:
        order.push(cls)
    while order:
        yield order.pop()
        while yield_back:
            order.push(yield_back.pop())


def by_definition(shares, classes):
    live = list(classes)
    while live:
        cls = min(live, key=lambda c: (*tier(c.head), shares[c.head.project_id], *rest(c.head)))
        live.remove(cls)
        yield cls
        live.extend(yield_back)
        yield_back.clear()


@pytest.mark.parametrize("seed", range(5))
def test_projects_first_takes_classes_in_the_order_of_their_fresh_keys(seed):
    calls: list[int] = []
    expected = walk(seed, by_definition)
    taken = walk(seed, lambda shares, classes: by_order(shares, classes, calls))
    assert len(taken) > 400
    assert taken == expected
    assert len(calls) <= 3 * len(taken), "about one re-key a placement, not one per stale class"
