#!/usr/bin/env python
"""Accounting benchmark: the history and usage queries over a million finished jobs.

    python benchmarks/accounting.py --jobs 1000000 --requests 200 --json

A throwaway PostgreSQL database gets 1,000 users in 50 projects (two queues each; one user in
ten is also in a second project), four clusters with one GPU model each, and ``--jobs``
finished jobs spread over the last ``--days`` days (default 90, a quarter), written by one
``INSERT … SELECT FROM generate_series`` each user running mostly on a home cluster, nine jobs
in ten succeeding. Their roll-ups (``UsageDay``, ``UsageMonth``, ``UsageProjectDay``) are
written by the upsert the service uses (``scheduling.services.accounting.add_usage``), from one
grouped read of the jobs. Then
``record_ends`` itself charges ``--end-batch`` jobs ending at once (with an attempt each), and
is timed.

Every query shape is timed through the real stack (``APIClient``: URL routing, bearer-token
authentication, permissions, throttles, parsing, the selector, JSON or CSV rendering), with
``--requests`` requests each, as a real user:

* history — a member's own jobs over the last month; a member's whole projects
  (``user=all``); an operator's first page of everything; the same at a deep cursor (half-way
  into the table); one project for an operator; a 1,000-row CSV page;
* usage — over the last three whole months (a quarter: ``UsageMonth``): by project, by project
  and user, by GPU model and month (operator), by user for a project's manager, a member's
  project totals; and over days (no user involved: ``UsageProjectDay``): the default last 30
  days by project and by day and project (the portal's chart), and a rolling 90 days by project.

Reported per shape: p50 and p99 in ms, and the yardstick of the same run: the SQL the selector
sends, executed bare through a cursor (``sql_p50_ms``), and the ratio of the request's p50 to
it; and once, a ``SELECT 1`` round trip. Nothing is asserted here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("ORRERY_THROTTLE_READ", "10000000/min")  # a benchmark, not a tenant
os.environ.setdefault("ORRERY_ALLOWED_HOSTS", "testserver")

USERS, PROJECTS, CLUSTERS = 1000, 50, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--end-batch", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    from benchmarks.throwaway import throwaway_database

    with throwaway_database("orrery_bench_accounting"):
        world = build_world()
        began = time.perf_counter()
        seed_jobs(world, args.jobs, args.days)
        seed_s = time.perf_counter() - began
        say(f"{args.jobs} jobs in {seed_s:.1f} s")
        began = time.perf_counter()
        usage_rows = roll_up()
        roll_up_s = time.perf_counter() - began
        say(f"{usage_rows} usage rows in {roll_up_s:.1f} s")
        end_ms = time_record_ends(world, args.end_batch)
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE")
        result: dict[str, Any] = {
            "jobs": args.jobs,
            "days": args.days,
            "users": USERS,
            "projects": PROJECTS,
            "usage_rows": usage_rows,
            "usage_project_day_rows": project_day_rows(),
            "seed_s": round(seed_s, 1),
            "roll_up_s": round(roll_up_s, 1),
            f"record_ends_{args.end_batch}_ms": end_ms,
            "select_1_p50_ms": select_one(args.requests),
            "history": {},
            "usage": {},
        }
        for name, (user, path, sql) in history_shapes(world).items():
            say(f"history {name}")
            result["history"][name] = timed(user, path, sql, args.requests)
        for name, (user, path, sql) in usage_shapes(world, args.days).items():
            say(f"usage {name}")
            result["usage"][name] = timed(user, path, sql, args.requests)
        worst = max(s["p99_ms"] for group in ("history", "usage") for s in result[group].values())
        result["worst_p99_ms"] = worst
    print(json.dumps(result, indent=None if args.json else 2))


def build_world() -> dict[str, Any]:
    """Users, projects with two queues each, memberships (one manager per project), four
    clusters; the operator is a staff user."""
    from django.contrib.auth import get_user_model

    from clusters.models import Cluster, GpuModel
    from portal.choices import Role
    from portal.models import Membership, Project
    from scheduling.models import Queue

    User = get_user_model()
    users = User.objects.bulk_create(User(username=f"u{i:04d}") for i in range(USERS))
    operator = User.objects.create(username="ops", is_staff=True)
    projects = Project.objects.bulk_create(Project(name=f"p{i:02d}") for i in range(PROJECTS))
    queues = Queue.objects.bulk_create(
        Queue(project=p, name=n) for p in projects for n in ("default", "long")
    )
    members = [
        Membership(user=u, project=projects[i % PROJECTS], role=Role.MEMBER) for i, u in enumerate(users)
    ]
    members[0].role = Role.MANAGER  # u0000 manages p00
    members += [
        Membership(user=u, project=projects[(i + 7) % PROJECTS]) for i, u in enumerate(users) if i % 10 == 3
    ]
    Membership.objects.bulk_create(members)
    models = list(GpuModel.objects.order_by("slug").values_list("pk", "slug"))[:CLUSTERS]
    clusters = Cluster.objects.bulk_create(
        Cluster(name=f"sim-{i}", kind="simulated") for i in range(CLUSTERS)
    )
    return {
        "users": users,
        "operator": operator,
        "projects": projects,
        "queues": queues,
        "models": models,
        "clusters": clusters,
    }


SEED_SQL = """
INSERT INTO scheduling_job (
    owner_id, project_id, queue_id, name, labels, state, reason, reason_message, version, priority,
    nodes, gpu_model_id, gpus_per_node, cpu_millicores_per_node, memory_bytes_per_node, time_limit_s,
    preemptible, estimated_where, reserved, command, spec, placement, retries, failover_policy,
    secret_env, dependency_pending, gpu_seconds, ran_on, request_digest, submitted_at, started_at,
    finished_at, exit_code, attempt_count)
SELECT u.owner_id, u.project_id, u.queue_id, 'train-' || (g %% 97), '{}', s.state, '', '', 3, 0,
    j.nodes, c.model_id, j.gpus, 8000, 68719476736, 86400,
    true, '', false, 'python train.py', '{}', '{}', 0, 'hold',
    '', false, j.nodes * j.gpus * j.run_s, c.name, '', j.ended - make_interval(secs => j.run_s + j.wait_s),
    j.ended - make_interval(secs => j.run_s), j.ended, s.exit_code, 1
FROM generate_series(1, %(jobs)s) AS g
CROSS JOIN LATERAL (SELECT (hashint4(g) & 2147483647) AS h) AS r
CROSS JOIN LATERAL (
    SELECT (%(owners)s::int[])[1 + r.h %% %(users)s] AS owner_id,
           (%(projects)s::int[])[1 + r.h %% %(users)s] AS project_id,
           (%(queues)s::int[])[1 + r.h %% %(users)s] AS queue_id,
           (r.h %% %(users)s) AS home
) AS u
CROSS JOIN LATERAL (
    SELECT CASE WHEN r.h %% 20 = 0 THEN 2 + r.h %% 3 ELSE 1 END AS nodes,
           (ARRAY[1, 2, 4, 8])[1 + (r.h / 7) %% 4] AS gpus,
           60 + (r.h / 31) %% 86400 AS run_s,
           (r.h / 13) %% 7200 AS wait_s,
           now() - make_interval(secs => (g::float8 / %(jobs)s) * %(days)s * 86400) AS ended
) AS j
CROSS JOIN LATERAL (
    SELECT CASE WHEN (r.h / 101) %% 10 = 0 THEN (u.home + 1) %% %(clusters)s ELSE u.home %% %(clusters)s END AS i
) AS pick
JOIN (SELECT * FROM unnest(%(cluster_names)s::text[], %(model_ids)s::int[]) WITH ORDINALITY
      AS t(name, model_id, i)) AS c ON c.i = pick.i + 1
CROSS JOIN LATERAL (
    SELECT CASE WHEN (r.h / 17) %% 100 < 90 THEN 'SUCCEEDED'
                WHEN (r.h / 17) %% 100 < 96 THEN 'FAILED'
                WHEN (r.h / 17) %% 100 < 98 THEN 'CANCELLED' ELSE 'TIMEOUT' END AS state,
           CASE WHEN (r.h / 17) %% 100 < 90 THEN 0 ELSE 1 END AS exit_code
) AS s
"""


def seed_jobs(world: dict[str, Any], jobs: int, days: int) -> None:
    """``jobs`` finished jobs in one statement: user ``i`` of ``USERS`` runs in its first project,
    queue ``default`` or ``long`` by parity, mostly on home cluster ``i % 4``."""
    from django.db import connection

    users, queues = world["users"], world["queues"]
    by_project = {q.project_id: [] for q in queues}
    for q in queues:
        by_project[q.project_id].append(q.pk)
    projects = [world["projects"][i % PROJECTS].pk for i in range(USERS)]
    with connection.cursor() as cursor:
        cursor.execute(
            SEED_SQL,
            {
                "jobs": jobs,
                "days": days,
                "users": USERS,
                "clusters": CLUSTERS,
                "owners": [u.pk for u in users],
                "projects": projects,
                "queues": [by_project[p][i % 2] for i, p in enumerate(projects)],
                "cluster_names": [c.name for c in world["clusters"]],
                "model_ids": [m[0] for m in world["models"]],
            },
        )


def roll_up() -> int:
    """The jobs' roll-up rows, through the service's own upsert; the number of ``UsageDay``
    rows."""
    from django.db import connection

    from scheduling.services.accounting import add_usage

    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT (j.finished_at AT TIME ZONE 'UTC')::date, j.project_id, j.queue_id, j.owner_id,
                      m.slug, j.ran_on, j.state, count(*), sum(j.gpu_seconds),
                      sum(extract(epoch FROM j.finished_at - j.started_at))::bigint,
                      0::float8, 0::float8, 0::float8  -- energy, cost, CO2: no attempts were metered
               FROM scheduling_job j JOIN clusters_gpumodel m ON m.id = j.gpu_model_id
               GROUP BY 1, 2, 3, 4, 5, 6, 7 ORDER BY 1, 2, 3, 4, 5, 6, 7"""
        )
        rows = cursor.fetchall()
    add_usage(rows)
    return len(rows)


def project_day_rows() -> int:
    from scheduling.models import UsageProjectDay

    return UsageProjectDay.objects.count()


def time_record_ends(world: dict[str, Any], batch: int) -> float:
    """``batch`` running jobs with an attempt each, ended in one ``record_ends`` call (the
    state machine's set-based path calls it so); its time in ms."""
    from django.db import transaction
    from django.utils import timezone

    from scheduling.models import Job, JobAttempt
    from scheduling.services.accounting import record_ends

    now = timezone.now()
    queue, cluster = world["queues"][0], world["clusters"][0]
    jobs = Job.objects.bulk_create(
        Job(
            owner=world["users"][0], project_id=queue.project_id, queue=queue, name=f"end{i}",
            state="SUCCEEDED", gpus_per_node=1, gpu_model_id=world["models"][0][0],
            started_at=now - timedelta(hours=1), finished_at=now,
        )
        for i in range(batch)
    )  # fmt: skip
    JobAttempt.objects.bulk_create(
        JobAttempt(job=j, number=1, cluster=cluster, active=False, started_at=j.started_at, finished_at=now)
        for j in jobs
    )
    began = time.perf_counter()
    with transaction.atomic():
        record_ends([j.pk for j in jobs], now)
    return round((time.perf_counter() - began) * 1000, 1)


def history_shapes(world: dict[str, Any]) -> dict[str, tuple[Any, str, Any]]:
    """name → (user, request path, the selector's queryset for the yardstick)."""
    from django.db import connection
    from django.http import QueryDict

    from portal.access import accounting_jobs
    from portal.api.accounting import encode_cursor, parse_history
    from scheduling.accounting_selectors import history_queryset
    from scheduling.models import Job

    member, ops = world["users"][5], world["operator"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT finished_at, id FROM scheduling_job ORDER BY finished_at DESC, id DESC OFFSET %s LIMIT 1",
                       [Job.objects.count() // 2])  # fmt: skip
        middle = encode_cursor(*cursor.fetchone())
    shapes = {
        "member_own_month": (member, "/api/v1/accounting/jobs?since=" + _ago(30)),
        "member_projects_all_users": (member, "/api/v1/accounting/jobs?user=all"),
        "operator_first_page": (ops, "/api/v1/accounting/jobs?user=all&since=2000-01-01"),
        "operator_deep_cursor": (ops, f"/api/v1/accounting/jobs?user=all&since=2000-01-01&cursor={middle}"),
        "operator_one_project": (ops, "/api/v1/accounting/jobs?user=all&project=p07&since=2000-01-01"),
        "operator_csv_1000_rows": (ops, "/api/v1/accounting/jobs?user=all&project=p07&limit=1000&format=csv"),
    }
    out = {}
    for name, (user, path) in shapes.items():
        query = parse_history(QueryDict(path.split("?", 1)[1]), user.username)
        out[name] = (user, path, history_queryset(accounting_jobs(user), query))
    return out


def usage_shapes(world: dict[str, Any], days: int) -> dict[str, tuple[Any, str, Any]]:
    from django.http import QueryDict

    from portal.access import usage_scope
    from portal.api.accounting import parse_usage
    from scheduling.accounting_selectors import usage_querysets

    member, manager, ops = world["users"][5], world["users"][0], world["operator"]
    quarter = f"since={_months_ago(3)}&until={_months_ago(0)}"  # the last three whole months
    shapes = {
        "operator_by_project_quarter": (ops, f"by=project&{quarter}"),
        "operator_by_project_user_quarter": (ops, f"by=project,user&{quarter}"),
        "operator_by_gpu_model_month_quarter": (ops, f"by=gpuModel,month&{quarter}"),
        "manager_by_user_quarter": (manager, f"by=user&project=p00&{quarter}"),
        "member_project_totals_quarter": (member, f"by=project&{quarter}"),
        "operator_by_project_last_30_days": (ops, "by=project"),
        "operator_by_day_project_last_30_days": (ops, "by=day,project"),
        "operator_by_project_rolling_90_days": (ops, f"by=project&since={_ago(days)}"),
    }
    out = {}
    for name, (user, params) in shapes.items():
        query = parse_usage(QueryDict(params))
        scope = usage_scope(user, per_user="user" in query.by or any(k == "user" for k, _ in query.filters))
        out[name] = (user, f"/api/v1/accounting/usage?{params}", usage_querysets(scope, query))
    return out


def _months_ago(months: int) -> str:
    from django.utils import timezone

    first = timezone.now().date().replace(day=1)
    for _ in range(months):
        first = (first - timedelta(days=1)).replace(day=1)
    return first.isoformat()


def _ago(days: int) -> str:
    from django.utils import timezone

    return (timezone.now() - timedelta(days=days)).date().isoformat()


def timed(user: Any, path: str, querysets: Any, requests: int) -> dict[str, Any]:
    """p50/p99 of ``requests`` GETs of ``path`` as ``user`` (after two warm-up requests), and the
    bare SQL of ``querysets`` (one, or a usage report's parts) through a cursor, as many times."""
    from django.db import connection
    from rest_framework.test import APIClient

    from portal.services.tokens import issue_token

    client = APIClient()
    _, token = issue_token(user, name=f"bench-{time.monotonic_ns()}")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    answers = [client.get(path) for _ in range(2)]
    assert all(a.status_code == 200 for a in answers), answers[0].content[:500]
    rows = (
        len(answers[0].json()["results"]) if not path.endswith("csv") else answers[0].content.count(b"\n") - 1
    )
    times = []
    for _ in range(requests):
        began = time.perf_counter()
        client.get(path)
        times.append((time.perf_counter() - began) * 1000)
    statements = [
        qs.query.sql_with_params() for qs in (querysets if isinstance(querysets, list) else [querysets])
    ]
    bare = []
    with connection.cursor() as cursor:
        for _ in range(requests):
            began = time.perf_counter()
            for sql, params in statements:
                cursor.execute(sql, params)
                cursor.fetchall()
            bare.append((time.perf_counter() - began) * 1000)
    p50, sql_p50 = statistics.median(times), statistics.median(bare)
    return {
        "rows": rows,
        "p50_ms": round(p50, 1),
        "p99_ms": round(_p99(times), 1),
        "sql_p50_ms": round(sql_p50, 1),
        "sql_p99_ms": round(_p99(bare), 1),
        "vs_sql": round(p50 / sql_p50, 2) if sql_p50 else None,
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def select_one(requests: int) -> float:
    from django.db import connection

    times = []
    with connection.cursor() as cursor:
        for _ in range(requests):
            began = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchall()
            times.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(times), 3)


if __name__ == "__main__":
    main()
