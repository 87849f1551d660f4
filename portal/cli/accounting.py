"""``orrery history`` (like ``sacct``) and ``orrery usage`` (like ``sreport``): finished jobs,
GPU-hours and energy, as a table, CSV or JSON. Both read ``/api/v1/accounting/…``; the CSV is
written here from the JSON rows, so what the table shows and what the CSV holds are the same
rows."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any, TextIO

from portal.cli import config, render
from portal.cli.client import ApiError, Client

COLUMNS = (
    "id", "name", "user", "project", "queue", "state", "submitted", "started", "ended", "elapsed",
    "nodes", "gpus", "gpuModel", "gpuHours", "exitCode", "cluster", "attempts",
)  # fmt: skip
DEFAULT_COLUMNS = "id,name,user,project,state,ended,elapsed,gpus,gpuHours,exitCode,cluster"
# sacct's field names, for hands that type them out of habit.
SACCT_NAMES = {
    "jobid": "id", "jobname": "name", "account": "project", "partition": "queue",
    "submit": "submitted", "start": "started", "end": "ended", "nnodes": "nodes",
    "exitcode": "exitCode", "gpumodel": "gpuModel", "gpuhours": "gpuHours",
}  # fmt: skip
PAGE = 1000


def _client(args: argparse.Namespace) -> Client:
    ctx = config.resolve(args.server, args.token, args.context)
    return Client(ctx.server, ctx.token)


def columns(spec: str) -> list[str]:
    """Column names from ``--format`` (ours or sacct's, any case); unknown ones are an error."""
    known = {c.lower(): c for c in COLUMNS} | SACCT_NAMES
    chosen = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word.lower() not in known:
            raise ApiError(0, f"unknown column '{word}'; columns: {', '.join(COLUMNS)}")
        chosen.append(known[word.lower()])
    return chosen or list(COLUMNS)


def cmd_history(args: argparse.Namespace) -> int:
    chosen = columns(args.format)
    if args.limit < 1:
        raise ApiError(0, "--limit must be at least 1")
    params = {
        "user": args.user,
        "project": args.project,
        "queue": args.queue,
        "state": args.state,
        "since": args.since,
        "until": args.until,
        "cluster": args.cluster,
        "gpuModel": args.gpu_model,
        "name": args.name,
        "limit": min(args.limit, PAGE),
    }
    api = _client(args)
    page = api.get("accounting/jobs", **params)
    rows = page["results"]
    while page["next"] and len(rows) < args.limit:  # keyset pages: each costs what the first did
        page = api.follow(page["next"])
        rows += page["results"]
    rows = rows[: args.limit]
    if args.output == "json":
        render.dump([{c: r[c] for c in chosen} for r in rows], "json")
    elif args.output == "csv":
        write_csv(chosen, rows, sys.stdout)
    else:
        render.table([c.upper() for c in chosen], [[_cell(c, r[c]) for c in chosen] for r in rows])
    return 0


def _cell(column: str, value: Any) -> Any:
    if column == "elapsed":
        return render.duration(value)
    if column in ("submitted", "started", "ended"):
        return render.local_time(value, "Unknown")
    return value


def cmd_usage(args: argparse.Namespace) -> int:
    params = {
        "by": args.by,
        "since": args.since,
        "until": args.until,
        "project": args.project,
        "user": args.user,
        "queue": args.queue,
        "cluster": args.cluster,
        "gpuModel": args.gpu_model,
        "state": args.state,
    }
    report = _client(args).get("accounting/usage", **params)
    if args.output == "json":
        render.dump(report, "json")
    elif args.output == "csv":
        write_csv([*report["by"], *USAGE_MEASURES], report["results"], sys.stdout)
    else:
        print(f"Usage {report['since']} – {report['until']} (UTC days; until excluded)")
        keys = report["by"]
        rows = [[r[k] for k in keys] + _usage_cells(r) for r in report["results"]]
        rows.append(["TOTAL", *[""] * (len(keys) - 1), *_usage_cells(report["total"])])
        render.table([*(k.upper() for k in keys), "JOBS", "GPU-HOURS", "KWH", "COST", "CO2-KG"], rows)
    return 0


USAGE_MEASURES = ("jobs", "gpuHours", "gpuSeconds", "elapsedSeconds", "energyKwh", "energyCost", "co2Kg")


def _usage_cells(row: dict[str, Any]) -> list[Any]:
    """Jobs, GPU-hours, energy, its cost and CO₂ of a usage row (a server that does not meter
    energy yet sends none: blank)."""
    energy = [row.get(m) for m in ("energyKwh", "energyCost", "co2Kg")]
    return [row["jobs"], f"{row['gpuHours']:.2f}", *("" if v is None else f"{v:.2f}" for v in energy)]


def write_csv(chosen: list[str], rows: list[dict[str, Any]], out: TextIO) -> None:
    """``rows`` as CSV with a header; control characters removed, formulas quoted."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(chosen)
    for row in rows:
        writer.writerow([_csv_value(row.get(c)) for c in chosen])


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str):
        value = render.inert(value)
        return "'" + value if value[:1] in ("=", "+", "-", "@") else value
    return value if not isinstance(value, dict | list) else json.dumps(value)


def add_history_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-u", "--user", help="comma list of users (default: you; 'all': everyone you can see)")
    p.add_argument("-p", "--project", help="comma list of projects")
    p.add_argument("-q", "--queue", help="comma list of queues")
    p.add_argument("-s", "--state", help="end states, e.g. FAILED,TIMEOUT or F,TO")
    p.add_argument("-S", "--since", help="ended at or after (date or ISO 8601 time; default: 30 days ago)")
    p.add_argument("-E", "--until", help="ended before (date or ISO 8601 time)")
    p.add_argument("--cluster", help="comma list of clusters")
    p.add_argument("--gpu-model", help="comma list of GPU models")
    p.add_argument("--name", help="job names starting with this")
    p.add_argument("--format", default=DEFAULT_COLUMNS, help=f"columns (default {DEFAULT_COLUMNS})")
    p.add_argument("-n", "--limit", type=int, default=100, help="at most this many jobs (default 100)")
    p.add_argument("-o", "--output", choices=("table", "csv", "json"), default="table")


def add_usage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--by",
        default="project",
        help="comma list of project, user, queue, gpu-model, cluster, state, day, week, month",
    )
    p.add_argument("-S", "--since", help="first day (default: 30 days ago)")
    p.add_argument("-E", "--until", help="end, excluded (default: now)")
    for name in ("project", "user", "queue", "cluster", "gpu-model", "state"):
        p.add_argument(f"--{name}", help="comma list")
    p.add_argument("-o", "--output", choices=("table", "csv", "json"), default="table")
