"""The invariants every fault scenario must leave intact, checked in SQL against the database
the control plane wrote (any PostgreSQL, by URL, or Django's own connection) and against the
processes running on this machine.

``violations()`` returns one sentence per broken invariant (an empty list when all hold):

1. no GPU on two live attempts;
2. at most one live attempt per job, and every job in an active state has one;
3. no job lost: every job the clients were told was accepted exists;
4. no duplicate for one idempotency key (per owner);
5. no negative capacity: what active allocations hold on a node fits what it offers;
6. no job left running on a node that has been down longer than ``down_slack_s``;
7. the append-only history agrees with the state: a job's last transition leads to its
   state, and each transition starts where the previous one ended;
8. no process running on this machine for an attempt the database has ended (agents' attempt
   shells name their attempt's directory on their command line; attempts the database does
   not know belong to someone else).

A scenario calls ``assert_invariants(...)`` after its fault has healed; the process check
waits up to ``settle_s`` for agents to stop what they no longer should run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ACTIVE = ("SCHEDULED", "STARTING", "RUNNING", "COMPLETING")
_ATTEMPT_IN_ARGV = re.compile(r"/attempts/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/")

_CHECKS: list[tuple[str, str]] = [
    (
        "GPU {0} is held by {1} live attempts",
        """SELECT a.gpu_id, count(DISTINCT a.attempt_id) FROM scheduling_allocation a
           JOIN scheduling_jobattempt t ON t.id = a.attempt_id
           WHERE a.active AND a.gpu_id IS NOT NULL AND t.active
           GROUP BY a.gpu_id HAVING count(DISTINCT a.attempt_id) > 1""",
    ),
    (
        "job {0} has {1} live attempts",
        """SELECT job_id, count(*) FROM scheduling_jobattempt WHERE active
           GROUP BY job_id HAVING count(*) > 1""",
    ),
    (
        "job {0} is {1} with no live attempt",
        f"""SELECT j.id, j.state FROM scheduling_job j
           WHERE j.state IN {ACTIVE!r}
             AND NOT EXISTS (SELECT 1 FROM scheduling_jobattempt t WHERE t.job_id = j.id AND t.active)""",
    ),
    (
        "job {0} is {1} but still has a live attempt",
        f"""SELECT j.id, j.state FROM scheduling_job j
           WHERE j.state NOT IN {ACTIVE!r}
             AND EXISTS (SELECT 1 FROM scheduling_jobattempt t WHERE t.job_id = j.id AND t.active)""",
    ),
    (
        "idempotency key {0!r} of user {1} names {2} jobs",
        """SELECT idempotency_key, owner_id, count(*) FROM scheduling_job
           WHERE idempotency_key IS NOT NULL GROUP BY idempotency_key, owner_id HAVING count(*) > 1""",
    ),
    (
        "node {0} has {1} mCPU and {2} bytes allocated past what it offers",
        """SELECT n.id, sum(a.cpu_millicores) - n.cpu_millicores_allocatable,
                  sum(a.memory_bytes) - n.memory_bytes_allocatable
           FROM scheduling_allocation a JOIN clusters_node n ON n.id = a.node_id
           WHERE a.active
           GROUP BY n.id, n.cpu_millicores_allocatable, n.memory_bytes_allocatable
           HAVING sum(a.cpu_millicores) > n.cpu_millicores_allocatable
               OR sum(a.memory_bytes) > n.memory_bytes_allocatable""",
    ),
    (
        "allocation of attempt {0} is live but its attempt has ended",
        """SELECT DISTINCT a.attempt_id FROM scheduling_allocation a
           JOIN scheduling_jobattempt t ON t.id = a.attempt_id WHERE a.active AND NOT t.active""",
    ),
    (
        "job {0} has an event leading to {1} but is {2}",
        """SELECT j.id, e.to_state, j.state FROM scheduling_job j
           JOIN LATERAL (SELECT to_state FROM scheduling_jobevent
                         WHERE job_id = j.id AND kind = 'transition' ORDER BY id DESC LIMIT 1) e ON true
           WHERE e.to_state <> j.state""",
    ),
    (
        "job {0}: a transition from {1} follows one to {2}",
        """SELECT job_id, from_state, prev FROM (
             SELECT job_id, from_state,
                    lag(to_state) OVER (PARTITION BY job_id ORDER BY id) AS prev
             FROM scheduling_jobevent WHERE kind = 'transition') h
           WHERE prev IS NOT NULL AND from_state <> prev""",
    ),
]

_DOWN_TOO_LONG = f"""SELECT DISTINCT j.id, n.name FROM scheduling_job j
    JOIN scheduling_jobattempt t ON t.job_id = j.id AND t.active
    JOIN scheduling_allocation a ON a.attempt_id = t.id AND a.active
    JOIN clusters_node n ON n.id = a.node_id
    WHERE j.state IN {ACTIVE!r} AND n.state = 'down'
      AND n.state_changed_at < now() - make_interval(secs => %s)"""


def _rows(cursor: Any, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
    cursor.execute(sql, list(params))
    return list(cursor.fetchall())


def database_violations(
    cursor: Any,
    *,
    accepted_jobs: Iterable[int] = (),
    down_slack_s: float = 30.0,
) -> list[str]:
    """Invariants 1–7 through an open DB-API cursor on the control plane's database."""
    found: list[str] = []
    for sentence, sql in _CHECKS:
        found += [sentence.format(*row) for row in _rows(cursor, sql)]
    found += [
        f"job {job} still runs on node {node}, down for more than {down_slack_s:g} s"
        for job, node in _rows(cursor, _DOWN_TOO_LONG, [down_slack_s])
    ]
    wanted = sorted(set(accepted_jobs))
    if wanted:
        present = {
            row[0] for row in _rows(cursor, "SELECT id FROM scheduling_job WHERE id = ANY(%s)", [wanted])
        }
        found += [f"job {pk} was accepted but is gone" for pk in wanted if pk not in present]
    return found


def attempts_running_here() -> dict[str, int]:
    """``{attempt id: pid}`` of the agents' attempt shells running on this machine."""
    found: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        match = _ATTEMPT_IN_ARGV.search(argv)
        if match and "exit_code" in argv:
            found.setdefault(match.group(1), []).append(int(proc.name))
    # A shell's child between its fork and its exec still shows the shell's command line: the
    # shell is the one whose parent is not itself a match.
    return {attempt: _outermost(pids) for attempt, pids in found.items()}


def _outermost(pids: list[int]) -> int:
    for pid in pids:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent not in pids:
            return pid
    return min(pids)


def process_violations(cursor: Any) -> list[str]:
    """Invariant 8: attempt shells running here whose attempt the database has ended."""
    running = attempts_running_here()
    if not running:
        return []
    # Only attempts this database knows and has ended: another database's agents (a test beside
    # this one) may run on the same machine.
    ended = {
        str(row[0])
        for row in _rows(
            cursor,
            "SELECT id FROM scheduling_jobattempt WHERE NOT active AND id::text = ANY(%s)",
            [list(running)],
        )
    }
    return [
        f"attempt {a} has ended but process {pid} still runs it" for a, pid in running.items() if a in ended
    ]


def violations(cursor: Any, *, accepted_jobs: Iterable[int] = (), down_slack_s: float = 30.0) -> list[str]:
    return database_violations(
        cursor, accepted_jobs=accepted_jobs, down_slack_s=down_slack_s
    ) + process_violations(cursor)


def assert_invariants(
    cursor: Any,
    *,
    accepted_jobs: Iterable[int] = (),
    down_slack_s: float = 30.0,
    settle_s: float = 0.0,
) -> None:
    """Fail with every broken invariant. The process check is given ``settle_s`` to come true
    (an agent stops an unwanted attempt within a heartbeat and its grace); the database checks
    must hold at once."""
    accepted = list(accepted_jobs)
    found = database_violations(cursor, accepted_jobs=accepted, down_slack_s=down_slack_s)
    assert not found, "invariants broken:\n" + "\n".join(found)
    deadline = time.monotonic() + settle_s
    while True:
        found = process_violations(cursor)
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert not found, "invariants broken:\n" + "\n".join(found)
