"""The ``orrery`` commands. Each prints what the server said and exits non-zero on any error."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

from portal.cli import accounting, config, render
from portal.cli.client import ApiError, Client

POLL_S = 2.0
FINAL_STATES = {"SUCCEEDED", "FAILED", "TIMEOUT", "CANCELLED"}
# What `orrery jobs` lists unless told otherwise: jobs not ended yet, as squeue does.
UNFINISHED_STATES = "PENDING,HELD,SCHEDULED,STARTING,RUNNING,COMPLETING,PREEMPTED"
MAX_START_JOBS = 10_000  # pending jobs `jobs --start` reads to sort by expected start


def _release() -> str:
    try:
        return version("orrery")
    except PackageNotFoundError:
        return "unknown"


def client_for(args: argparse.Namespace) -> Client:
    ctx = config.resolve(args.server, args.token, args.context)
    return Client(ctx.server, ctx.token)


# --- commands ---------------------------------------------------------------------------------


def cmd_login(args: argparse.Namespace) -> int:
    me = Client(args.server, args.token).get("me")
    name = args.context or "default"
    path = config.save_context(name, args.server, args.token)
    print(f"Logged in to {args.server} as {me['username']} (context '{name}', saved in {path}).")
    return 0


def spec_documents(text: str, source: str) -> list[dict[str, Any]]:
    """The job specs in a file: one YAML or JSON document, several (``---``), or lists of specs
    in any of them, flattened in order. Anything that is not a spec (a mapping) is an error
    naming its place."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ApiError(0, f"{source} is not valid YAML: {exc}") from None
    specs: list[dict[str, Any]] = []
    for i, document in enumerate(documents):
        items = document if isinstance(document, list) else [document]
        for j, item in enumerate(items):
            if not isinstance(item, dict):
                where = f"document {i + 1}" + (f", item {j + 1}" if isinstance(document, list) else "")
                raise ApiError(0, f"{source}: {where} is not a job spec (a mapping with apiVersion, spec…)")
            specs.append(item)
    if not specs:
        raise ApiError(0, f"{source} holds no job spec")
    return specs


def cmd_submit(args: argparse.Namespace) -> int:
    """One plain spec goes to ``POST jobs``; several, or an array (``spec.array``), to
    ``POST jobs/batch`` as ``{jobs: [...]}``: all are accepted or none."""
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    specs = spec_documents(text, args.file)
    for spec in specs if args.dependency else ():  # sbatch's --dependency: every job waits
        if isinstance(spec.get("spec"), dict):
            spec["spec"]["dependency"] = args.dependency
    api = client_for(args)
    # A key per invocation: a retried request after a network error cannot submit twice.
    headers = {"Idempotency-Key": args.idempotency_key or str(uuid.uuid4())}
    spec = specs[0].get("spec")
    batch = len(specs) > 1 or (isinstance(spec, dict) and spec.get("array") is not None)
    if args.dry_run:
        if batch:
            raise ApiError(0, "--dry-run takes one job spec without spec.array")
        body = yaml.safe_dump(specs[0]).encode()
        result = api.post("jobs", body, content_type="application/yaml", dryRun="true")
        print(f"Valid: would submit {result['jobs']} job(s).")
        render.dump(result["spec"], "yaml")
        return 0
    if batch:
        body = yaml.safe_dump({"jobs": specs}).encode()
        jobs = api.post("jobs/batch", body, content_type="application/yaml", headers=headers)["jobs"]
    else:
        body = yaml.safe_dump(specs[0]).encode()
        jobs = [api.post("jobs", body, content_type="application/yaml", headers=headers)]
    for line in render.submitted(jobs):
        print(render.inert(line))
    if not args.wait:
        return 0
    return _wait(jobs, api)


def _wait(jobs: list[dict[str, Any]], api: Client) -> int:
    refs = {job["id"]: job.get("ref") or str(job["id"]) for job in jobs}
    remaining, failed = set(refs), 0
    last: dict[int, str] = {}
    while remaining:
        for job_id in sorted(remaining):
            job = api.get(f"jobs/{job_id}")
            if last.get(job_id) != job["state"]:
                last[job_id] = job["state"]
                why = f" ({render.reason(job)})" if render.reason(job) else ""
                print(render.inert(f"job {refs[job_id]}: {job['state']}{why}"))
            if job["state"] in FINAL_STATES:
                remaining.discard(job_id)
                failed += job["state"] != "SUCCEEDED"
        if remaining:
            time.sleep(POLL_S)
    return 1 if failed else 0


def cmd_jobs(args: argparse.Namespace) -> int:
    api = client_for(args)
    if args.start:
        return _pending_starts(args, api)
    every_state = args.all or (args.state or "").strip().lower() == "all"
    params: dict[str, Any] = {
        "state": None if every_state else args.state or UNFINISHED_STATES,
        "project": args.project,
        "queue": args.queue,
        "cluster": args.cluster,
        "limit": min(args.limit, 1000),
        "arrays": "expand" if args.array else "summary",
    }
    if not args.all_projects:
        params["user"] = api.get("me")["username"]
    return _list(
        args, lambda: api.get("jobs", **params)["results"][: args.limit], render.JOB_HEADERS, render.job_rows
    )


def _list(
    args: argparse.Namespace,
    fetch: Callable[[], list[dict[str, Any]]],
    headers: Sequence[str],
    rows: Callable[[list[dict[str, Any]]], Any],
) -> int:
    """Print what ``fetch`` returns as a table (or ``--output``), again every few seconds with
    ``--watch``."""
    while True:
        jobs = fetch()
        if args.output == "table":
            if args.watch:
                sys.stdout.write("\033[H\033[2J")
            render.table(headers, rows(jobs))
        else:
            render.dump(jobs, args.output)
        if not args.watch:
            return 0
        time.sleep(POLL_S)


def _pending_starts(args: argparse.Namespace, api: Client) -> int:
    """``jobs --start``, as Slurm's ``squeue --start``: pending jobs by expected start (those
    without an estimate last), when and where the scheduler expects each to start, and whether
    that is a reservation. Every pending page is read (up to ``MAX_START_JOBS``), so the order
    holds across pages."""
    params: dict[str, Any] = {
        "state": "PENDING",
        "project": args.project,
        "queue": args.queue,
        "limit": 1000,
    }
    if not args.all_projects:
        params["user"] = api.get("me")["username"]

    def fetch() -> list[dict[str, Any]]:
        page = api.get("jobs", **params)
        jobs = page["results"]
        while page.get("next") and len(jobs) < MAX_START_JOBS:
            page = api.follow(page["next"])
            jobs += page["results"]
        return render.by_expected_start(jobs)[: args.limit]

    return _list(args, fetch, render.START_HEADERS, render.start_rows)


def job_path(ref: str, *rest: str) -> str:
    """``jobs/REF[/…]`` with the reference quoted (``74_[1-5]`` has brackets)."""
    return "/".join(["jobs", urllib.parse.quote(ref, safe=""), *rest])


def cmd_show(args: argparse.Namespace) -> int:
    job = client_for(args).get(job_path(args.job_id))
    if args.output == "text":
        render.job_detail(job)
    else:
        render.dump(job, args.output)
    return 0


def cmd_action(args: argparse.Namespace) -> int:
    """An action on each reference: a job (``74``), a member (``74_3``), a whole array (its id)
    or a range of members (``74_[1-5]``)."""
    api = client_for(args)

    def act(ref: str) -> str:
        result = api.post(job_path(ref, args.verb))
        if "matched" in result:
            return render.many_changed(result, render.DONE.get(args.verb, args.verb))
        if args.verb == "checkpoint":
            when = render.local_time(result["checkpointedAt"])
            return f"job {result['ref']}: checkpoint recorded at {when}"
        return f"job {result['ref']}: {result['state']}"

    return _each_ref(args.job_ids, act)


def _each_ref(refs: Sequence[str], act: Callable[[str], str]) -> int:
    """Do ``act`` for each reference and print what it says; a refusal is printed for its
    reference and the others go on. Exit status 1 if any was refused."""
    failures = 0
    for ref in refs:
        try:
            print(render.inert(act(ref)))
        except ApiError as exc:
            print(render.inert(f"job {ref}: {exc}"), file=sys.stderr)
            failures += 1
    return 1 if failures else 0


def cmd_update(args: argparse.Namespace) -> int:
    """``scontrol update``: change waiting jobs (``PATCH jobs/REF``)."""
    changes: dict[str, Any] = {
        "timeLimit": args.time_limit,
        "priority": int(args.priority)
        if re.fullmatch(r"[+-]?[0-9]{1,6}", args.priority or "")
        else args.priority,
        "name": args.name,
        "throttle": args.throttle,
    }
    if args.hold is not None:
        changes["hold"] = args.hold
    changes = {key: value for key, value in changes.items() if value is not None}
    if not changes:
        raise ApiError(
            0, "nothing to change: give --time-limit, --priority, --name, --hold/--release or --throttle"
        )
    api = client_for(args)

    def update(ref: str) -> str:
        result = api.patch(job_path(ref), json.dumps(changes).encode())
        if "matched" in result:
            return render.many_changed(result, "updated")
        return f"job {result['ref']}: updated ({result['state']})"

    return _each_ref(args.job_ids, update)


def cmd_logs(args: argparse.Namespace) -> int:
    api, seen = client_for(args), 0
    while True:
        lines = api.get(job_path(args.job_id, "logs"), tail=args.tail)["lines"]
        for line in lines[seen:] if args.follow else lines:
            print(line if args.raw else render.inert(line))
        seen = len(lines)
        if not args.follow or api.get(job_path(args.job_id))["state"] in FINAL_STATES:
            return 0
        time.sleep(POLL_S)


def cmd_events(args: argparse.Namespace) -> int:
    events = client_for(args).get(job_path(args.job_id, "events"))
    if args.output != "table":
        render.dump(events, args.output)
        return 0
    render.table(
        ["TIME", "EVENT", "FROM", "TO", "REASON", "BY", "MESSAGE"],
        [
            [
                e["at"][:19].replace("T", " "),
                e["kind"],
                e["fromState"],
                e["toState"],
                render.reason(e),
                e["actor"] or "",
                e["message"],
            ]
            for e in events
        ],
        raw=args.raw,
    )
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    clusters = client_for(args).get("clusters")
    if args.output != "table":
        render.dump(clusters, args.output)
        return 0
    rows = []
    for c in clusters:
        gpus = ", ".join(f"{g['model']} {g['free']}/{g['total']} free" for g in c["gpus"]) or "-"
        rows.append([c["name"], c["kind"], c["state"], f"{c['nodes']['ready']}/{c['nodes']['total']}", gpus])
    render.table(["CLUSTER", "KIND", "STATE", "NODES(READY/TOTAL)", "GPUS"], rows)
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    page = client_for(args).get(
        "nodes", cluster=args.cluster, state=args.state, gpuModel=args.gpu_model, limit=min(args.limit, 1000)
    )
    nodes = page["results"]
    if args.output != "table":
        render.dump(nodes, args.output)
        return 0
    render.table(
        ["NODE", "CLUSTER", "STATE", "GPU", "GPUS(ALLOC/TOTAL)", "CPUS", "MEMORY", "LAST HEARTBEAT"],
        [
            [
                n["name"],
                n["cluster"],
                n["state"],
                n["gpuModel"] or "-",
                f"{n['gpus']['allocated']}/{n['gpus']['total']}",
                n["cpuMillicores"] // 1000,
                f"{n['memoryBytes'] // 2**30}Gi",
                (n["lastHeartbeatAt"] or "never")[:19].replace("T", " "),
            ]
            for n in nodes
        ],
    )
    return 0


def cmd_queues(args: argparse.Namespace) -> int:
    queues = client_for(args).get("queues")["results"]
    if args.output != "table":
        render.dump(queues, args.output)
        return 0
    rows = []
    for q in queues:
        quota = ", ".join(f"{g['model']} {g['used']}/{g['quota']}" for g in q["gpus"]) or "-"
        waiting = q["jobs"].get("PENDING", 0) + q["jobs"].get("HELD", 0)
        rows.append(
            [
                f"{q['project']}/{q['name']}",
                q["priority"],
                q["cohort"] or "-",
                quota,
                waiting,
                q["jobs"].get("RUNNING", 0),
            ]
        )
    render.table(["QUEUE", "PRIORITY", "COHORT", "GPUS(USED/QUOTA)", "PENDING", "RUNNING"], rows)
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    tokens = client_for(args).get("tokens")["results"]
    if args.output != "table":
        render.dump(tokens, args.output)
        return 0

    def when(stamp: str | None, default: str) -> str:
        return stamp[:16].replace("T", " ") if stamp else default

    render.table(
        ["ID", "NAME", "PREFIX", "SCOPES", "EXPIRES", "LAST USED", "REVOKED"],
        [
            [
                t["id"],
                t["name"],
                t["prefix"],
                ",".join(t["scopes"]),
                when(t["expiresAt"], "-"),
                when(t["lastUsedAt"], "never"),
                when(t["revokedAt"], "-"),
            ]
            for t in tokens
        ],
    )
    return 0


# --- parser -----------------------------------------------------------------------------------

_REF = re.compile(r"[0-9]{1,19}(?:_(?:[0-9]{1,7}|\[[0-9,\-]{1,250}\]))?", re.ASCII)


def job_ref(text: str) -> str:
    """A job reference as the server reads it (``74``, ``74_3``, ``74_[1-5,9]``), checked here
    so that a typo is a usage error, not a 404."""
    if not _REF.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"'{text[:40]}' is not a job: use e.g. 74, 74_3 or 74_[1-5,9]")
    return text.strip()


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", help="API server URL (or ORRERY_SERVER)")
    common.add_argument("--token", help="API token (or ORRERY_TOKEN)")
    common.add_argument("--context", help="a context saved by 'orrery login'")

    parser = argparse.ArgumentParser(
        prog="orrery", description="Orrery: one control plane for many GPU clusters."
    )
    parser.add_argument("--version", action="version", version=f"orrery {_release()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_text: str, aliases: tuple[str, ...] = ()
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text, aliases=aliases)
        p.set_defaults(func=func)
        return p

    def output(p: argparse.ArgumentParser, choices: tuple[str, ...] = ("table", "json", "yaml")) -> None:
        p.add_argument("-o", "--output", choices=choices, default=choices[0])

    p = sub.add_parser("login", help="Save a server and token as a context, after checking them.")
    p.add_argument("--server", required=True, help="API server URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--token", required=True, help="from 'manage.py issue_token' or POST /api/v1/tokens")
    p.add_argument("--context", help="name of the context to save (default: default)")
    p.set_defaults(func=cmd_login)

    p = add("submit", cmd_submit, "Submit the job spec(s) in a YAML or JSON file.")
    p.add_argument("-f", "--file", required=True, help="spec file, or - for standard input")
    p.add_argument("--wait", action="store_true", help="wait until the job(s) end; exit 1 unless all succeed")
    p.add_argument("--dry-run", action="store_true", help="validate only, create nothing")
    p.add_argument("--idempotency-key", help="reuse to make a retried submission safe")
    p.add_argument("-d", "--dependency", help="wait for other jobs: afterok:74:75_3,afterany:80, singleton")

    p = add(
        "jobs",
        cmd_jobs,
        "List jobs not ended yet (yours; --all-projects for your projects'; --all for ended ones too).",
    )
    p.add_argument("-w", "--watch", action="store_true", help="refresh every 2 s")
    p.add_argument(
        "--start",
        action="store_true",
        help="pending jobs by expected start: when and where each would start, reserved or not",
    )
    p.add_argument("--all-projects", action="store_true")
    p.add_argument("--all", action="store_true", help="ended jobs too (the same as --state all)")
    p.add_argument(
        "-t", "--state", help="e.g. PENDING,RUNNING or PD,R; all: every state (default: jobs not ended yet)"
    )
    p.add_argument("--project")
    p.add_argument("--queue")
    p.add_argument("--cluster")
    p.add_argument("-n", "--limit", type=int, default=100)
    p.add_argument(
        "-r",
        "--array",
        action="store_true",
        help="one row per array member (default: waiting members as one row)",
    )
    output(p)

    refs = "a job (74), an array member (74_3), an array (its id) or a range of members (74_[1-5,9])"
    p = add("show", cmd_show, "Show one job.", aliases=("job",))
    p.add_argument("job_id", type=job_ref, metavar="JOB", help="74 or 74_3")
    output(p, ("text", "json", "yaml"))

    for verb, text in (
        ("cancel", "Cancel jobs."),
        ("hold", "Hold pending jobs."),
        ("release", "Release held jobs."),
        ("requeue", "Requeue running jobs."),
    ):
        p = add(verb, cmd_action, text)
        p.add_argument("job_ids", type=job_ref, nargs="+", metavar="JOB", help=refs)
        p.set_defaults(verb=verb)

    p = add("update", cmd_update, "Change waiting jobs, as scontrol update does.")
    p.add_argument("job_ids", type=job_ref, nargs="+", metavar="JOB", help=refs)
    p.add_argument("--time-limit", help="e.g. 1h, 90m, 1-00:00:00 (members may only lower it)")
    p.add_argument("--priority", help="an integer, or low, normal, high (within the queue's limit)")
    p.add_argument("--name")
    p.add_argument("--throttle", type=int, help="an array's: at most N members run at once (0: no limit)")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--hold", dest="hold", action="store_const", const=True, help="hold the job(s)")
    held.add_argument("--release", dest="hold", action="store_const", const=False, help="release the job(s)")

    p = add(
        "checkpoint",
        cmd_action,
        "Record that a running job has just saved its work (a preemption then loses less of it).",
    )
    p.add_argument(
        "job_ids",
        type=job_ref,
        nargs="*",
        metavar="JOB",
        help="default: $ORRERY_JOB_ID, the job this runs in",
    )
    p.set_defaults(verb="checkpoint")

    raw = "print terminal control sequences as the job wrote them (colours, but also anything else)"
    p = add("logs", cmd_logs, "Print a job's output (terminal control sequences removed).")
    p.add_argument("job_id", type=job_ref, metavar="JOB", help="74 or 74_3")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--tail", type=int, default=100)
    p.add_argument("--raw", action="store_true", help=raw)

    p = add("events", cmd_events, "Print a job's history (terminal control sequences removed).")
    p.add_argument("job_id", type=job_ref, metavar="JOB", help="74 or 74_3")
    p.add_argument("--raw", action="store_true", help=raw.replace("the job wrote", "recorded"))
    output(p)

    output(add("clusters", cmd_clusters, "List clusters with free GPUs by model."))

    p = add("nodes", cmd_nodes, "List nodes.")
    p.add_argument("--cluster")
    p.add_argument("--state")
    p.add_argument("--gpu-model")
    p.add_argument("-n", "--limit", type=int, default=100)
    output(p)

    output(add("queues", cmd_queues, "List queues with quota and use."))
    output(add("tokens", cmd_tokens, "List your API tokens with their scopes, expiry and last use."))

    # accounting
    accounting.add_history_arguments(add("history", accounting.cmd_history, "Finished jobs (like sacct)."))
    accounting.add_usage_arguments(
        add("usage", accounting.cmd_usage, "GPU-hours over a period (like sreport).")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "verb", None) == "checkpoint" and not args.job_ids:
        own = os.environ.get("ORRERY_JOB_ID", "")
        if not (own.isascii() and own.isdigit()):
            parser.error("checkpoint: give JOB_ID (or run it inside a job, where ORRERY_JOB_ID is set)")
        args.job_ids = [own]
    try:
        return args.func(args)
    except (ApiError, config.ConfigError, OSError) as exc:
        print(render.inert(str(exc) if isinstance(exc, ApiError) else f"error: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
