"""Tables in the style of squeue/sinfo, and JSON/YAML output."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import yaml

TERMINAL_CODES = {"CD", "F", "TO", "CA", "PR"}


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], out: TextIO = sys.stdout) -> None:
    rows = [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out.write(line.format(*headers).rstrip() + "\n")
    for row in rows:
        out.write(line.format(*row).rstrip() + "\n")


def dump(data: Any, fmt: str, out: TextIO = sys.stdout) -> None:
    if fmt == "json":
        out.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    else:
        out.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def duration(seconds: float | None) -> str:
    """Slurm's ``[D-]HH:MM:SS`` (``M:SS`` under an hour)."""
    if seconds is None:
        return ""
    seconds = int(max(seconds, 0))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def time_used(job: dict[str, Any]) -> str:
    started = _time(job.get("startedAt"))
    if started is None:
        return "0:00"
    end = _time(job.get("finishedAt")) or datetime.now(UTC)
    return duration((end - started).total_seconds())


def gpus(job: dict[str, Any]) -> str:
    g = job["resources"]["gpus"]
    if not g["count"]:
        return "-"
    per_node = f"{g['model']}:{g['count']}"
    nodes = job["resources"]["nodes"]
    return per_node if nodes == 1 else f"{nodes}x{per_node}"


def where(job: dict[str, Any]) -> str:
    """squeue's NODELIST(REASON): nodes and GPU indices once placed, else (reason)."""
    placement = job.get("placement")
    if job["stateCode"] == "PD" or not placement:
        return f"({job['reason']})" if job.get("reason") else ""
    nodes = ",".join(
        f"{n['node']}[{','.join(map(str, n['gpus']))}]" if n["gpus"] else n["node"]
        for n in placement["nodes"]
    )
    return f"{placement['cluster']}:{nodes}"


JOB_HEADERS = ["JOBID", "NAME", "USER", "PROJECT", "QUEUE", "ST", "TIME", "GPUS", "NODELIST(REASON)"]


def job_rows(jobs: Iterable[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            j["id"],
            j["name"][:24],
            j["owner"],
            j["project"],
            j["queue"],
            j["stateCode"],
            time_used(j),
            gpus(j),
            where(j),
        ]
        for j in jobs
    ]


def job_detail(job: dict[str, Any], out: TextIO = sys.stdout) -> None:
    fields = [
        ("JobId", job["id"]),
        ("Name", job["name"]),
        ("User", job["owner"]),
        ("Project", job["project"]),
        ("Queue", job["queue"]),
        ("State", f"{job['state']} ({job['stateCode']})"),
        ("Reason", job.get("reason")),
        ("Why", job.get("reasonMessage")),
        ("Priority", job["priority"]),
        ("Gpus", gpus(job)),
        ("Nodes", job["resources"]["nodes"]),
        ("CpusPerNode", job["resources"]["cpuMillicores"] / 1000),
        ("MemoryPerNode", f"{job['resources']['memoryBytes'] / 2**30:g}Gi"),
        ("TimeLimit", duration(job.get("timeLimitSeconds")) or "none"),
        ("Submitted", job["submittedAt"]),
        ("Started", job.get("startedAt")),
        ("Finished", job.get("finishedAt")),
        ("ExitCode", job.get("exitCode")),
        ("Attempts", job["attempts"]),
        ("Placement", where(job) if job.get("placement") else None),
    ]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        if value not in (None, ""):
            out.write(f"{key:>{width}}: {value}\n")
