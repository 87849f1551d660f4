"""Tables in the style of squeue/sinfo, and JSON/YAML output."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import yaml

from foundation.units import clock_text

TERMINAL_CODES = {"CD", "F", "TO", "CA", "PR"}

# Terminal control sequences, 7-bit (ESC …) and 8-bit (C1) forms: strings (OSC, DCS, SOS, PM, APC)
# up to their terminator (BEL or ST) or the end of the line, CSI with its parameters, and any
# other escape. What a job prints or an event says reaches the user's terminal through these
# commands, and a terminal acts on them: retitles the window, clears the screen, writes files in
# some emulators, answers queries into the input. They are removed whole, so no stray parameters
# remain as text.
_SEQUENCE = re.compile(
    r"(?:\x1b[PX\]^_]|[\x90\x98\x9d\x9e\x9f])[^\n]*?(?:\x07|\x1b\\|\x9c|(?=\n)|\Z)"  # strings
    r"|(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"  # CSI
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?",  # any other escape (or a lone ESC)
)
# Then every control character left but tab and newline (C0, DEL, C1: CR included, which would
# let a line overwrite what came before it). No ESC or C1 survives, so nothing can recombine.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """``text`` with every terminal control sequence and control character removed, tab and
    newline kept: safe to print to a terminal whatever the server (or a job) put in it."""
    return _CONTROL.sub("", _SEQUENCE.sub("", text))


def table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], out: TextIO | None = None, *, raw: bool = False
) -> None:
    """Aligned columns. Cells are made ``inert`` unless ``raw`` (then printed as they are)."""
    out = out or sys.stdout  # looked up now, not at import: the caller may have redirected it
    rows = [["" if v is None else str(v) if raw else inert(str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out.write(line.format(*headers).rstrip() + "\n")
    for row in rows:
        out.write(line.format(*row).rstrip() + "\n")


def dump(data: Any, fmt: str, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if fmt == "json":
        out.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    else:
        out.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def duration(seconds: float | None) -> str:
    """Slurm's ``[D-]HH:MM:SS`` (``M:SS`` under an hour); "" for none."""
    return "" if seconds is None else clock_text(seconds)


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def time_used(job: dict[str, Any]) -> str:
    started = _time(job.get("startedAt"))
    if started is None:
        return "0:00"
    end = _time(job.get("finishedAt")) or datetime.now(UTC)
    return duration((end - started).total_seconds())


def local_time(value: str | None, default: str = "N/A") -> str:
    """An API time in this machine's zone, as Slurm prints times (``2026-12-02T14:20:00``)."""
    when = _time(value)
    return when.astimezone().strftime("%Y-%m-%dT%H:%M:%S") if when else default


def gpus(job: dict[str, Any]) -> str:
    """``h100-80g:8`` per node (``2x…`` for a gang); an any-model job not yet placed shows the
    models it allows, best first (``h100-80g|a100-80g:2``), or ``any:2``."""
    g = job["resources"]["gpus"]
    if not g["count"]:
        return "-"
    model = g["model"] or "|".join(job.get("gpuModels") or []) or "any"
    per_node = f"{model}:{g['count']}"
    nodes = job["resources"]["nodes"]
    return per_node if nodes == 1 else f"{nodes}x{per_node}"


def reason(job: dict[str, Any]) -> str:
    """Why a job waits, as the API names it; "" when it has none to give (no reason, or
    ``None``: not yet considered by the scheduler, which is not worth a word)."""
    said = job.get("reason")
    return "" if said in (None, "", "None") else str(said)


def where(job: dict[str, Any]) -> str:
    """squeue's NODELIST(REASON): nodes and GPU indices once placed, else (reason)."""
    placement = job.get("placement")
    if job["stateCode"] == "PD" or not placement:
        return f"({reason(job)})" if reason(job) else ""
    nodes = ",".join(
        f"{n['node']}[{','.join(map(str, n['gpus']))}]" if n["gpus"] else n["node"]
        for n in placement["nodes"]
    )
    return f"{placement['cluster']}:{nodes}"


JOB_HEADERS = ["JOBID", "NAME", "USER", "PROJECT", "QUEUE", "ST", "TIME", "GPUS", "NODELIST(REASON)"]


def job_id(job: dict[str, Any]) -> str:
    """squeue's JOBID: ``74``, ``74_3`` for an array member, ``74_[4-99%10]`` for a row that
    stands for an array's waiting members."""
    tasks = job.get("arrayTasks")
    if tasks:
        return str(tasks["label"])
    return str(job.get("ref") or job["id"])


def job_name(job: dict[str, Any]) -> str:
    """The job's name; for a row standing for several members, the array's (no ``-INDEX``)."""
    if job.get("arrayTasks") and job.get("arrayIndex") is not None:
        return str(job["name"]).removesuffix(f"-{job['arrayIndex']}")
    return str(job["name"])


DONE = {"cancel": "cancelled", "hold": "held", "release": "released", "requeue": "requeued"}


def many_changed(result: dict[str, Any], done: str) -> str:
    """One line for an action on many jobs: ``74_[1-5]: 3 cancelled, 2 unchanged``."""
    unchanged = f", {result['unchanged']} unchanged" if result["unchanged"] else ""
    return f"{result['ref']}: {result['changed']} {done}{unchanged}"


def submitted(jobs: list[dict[str, Any]]) -> list[str]:
    """What a submission made: a line per job, a line per array (``74_[0-99%10]``, its count)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for job in jobs:
        key = ("array", job["arrayId"]) if job.get("arrayId") is not None else ("job", job["id"])
        groups.setdefault(key, []).append(job)
    lines = []
    for (kind, number), members in groups.items():
        first = members[0]
        if kind == "job":
            why = f": {reason(first)}" if reason(first) else ""
            lines.append(f"Submitted job {job_id(first)} ({first['name']}) — {first['state']}{why}")
            continue
        throttle = f"%{first['arrayThrottle']}" if first.get("arrayThrottle") else ""
        indices = _spans(m["arrayIndex"] for m in members)
        name = str(first["name"]).removesuffix(f"-{first['arrayIndex']}")
        lines.append(
            f"Submitted array {number} ({name}): {len(members)} tasks {number}_[{indices}{throttle}] — "
            f"{first['state']}"
        )
    return lines


def _spans(indices: Iterable[int]) -> str:
    """``0-4,7`` for 0, 1, 2, 3, 4, 7."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def job_rows(jobs: Iterable[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            job_id(j),
            job_name(j)[:24],
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


START_HEADERS = ["JOBID", "NAME", "ST", "START_TIME", "WHERE", "RESERVED", "REASON"]


def by_expected_start(jobs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Jobs by expected start, earliest first; those without an estimate last, by id."""

    def key(job: dict[str, Any]) -> tuple[int, datetime, int]:
        when = _time((job.get("estimatedStart") or {}).get("at"))
        return (0, when, job["id"]) if when else (1, datetime.min.replace(tzinfo=UTC), job["id"])

    return sorted(jobs, key=key)


def start_rows(jobs: Iterable[dict[str, Any]]) -> list[list[Any]]:
    """``squeue --start``'s rows: when and where the scheduler expects each job to start."""
    rows = []
    for j in jobs:
        estimate = j.get("estimatedStart") or {}
        rows.append(
            [
                job_id(j),
                j["name"][:24],
                j["stateCode"],
                local_time(estimate.get("at")),
                estimate.get("where") or "N/A",
                "yes" if estimate.get("reserved") else "no",
                f"({reason(j)})" if reason(j) else "",
            ]
        )
    return rows


def estimate(job: dict[str, Any]) -> str | None:
    """``≈ 2026-12-02T14:20:00 on sim-b: node-3 (reserved)``, or None without an estimate."""
    start = job.get("estimatedStart")
    if not start:
        return None
    where = f" on {start['where']}" if start.get("where") else ""
    return f"≈ {local_time(start['at'])}{where}" + (" (reserved)" if start.get("reserved") else "")


def energy(job: dict[str, Any]) -> str | None:
    """``1.234 kWh, cost 0.31, 0.494 kg CO2``: what the job's GPUs drew over its attempts; None
    for a job never placed (or a server that does not meter energy)."""
    used = job.get("energy")
    if not used or not job.get("attempts"):
        return None
    return f"{used['kwh']:.3f} kWh, cost {used['cost']:.2f}, {used['co2Kg']:.3f} kg CO2"


def _preference(models: list[str] | None) -> str | None:
    """An any-model request's models, best first ("any" when it allows every model)."""
    if models is None:
        return None  # the job named its model, or asked for no GPUs
    return ",".join(models) or "any"


def job_detail(job: dict[str, Any], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    fields = [
        ("JobId", job.get("ref") or job["id"]),
        ("ArrayJobId", job.get("arrayId")),
        ("ArrayTaskId", job.get("arrayIndex")),
        ("ArrayTaskThrottle", job.get("arrayThrottle")),
        ("Name", job["name"]),
        ("User", job["owner"]),
        ("Project", job["project"]),
        ("Queue", job["queue"]),
        ("State", f"{job['state']} ({job['stateCode']})"),
        ("Reason", reason(job)),
        ("Why", job.get("reasonMessage")),
        ("Priority", job["priority"]),
        ("Gpus", gpus(job)),
        ("GpuModels", _preference(job.get("gpuModels"))),
        ("StartTime", estimate(job)),
        ("Preemptible", "yes" if job.get("preemptible", True) else "no"),
        ("Checkpointed", local_time(job.get("checkpointedAt"), "")),
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
        ("Energy", energy(job)),
    ]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        if value not in (None, ""):
            out.write(f"{key:>{width}}: {inert(str(value))}\n")
