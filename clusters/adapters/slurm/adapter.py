"""Running attempts on a Slurm cluster: dispatch on the nodes and GPUs the scheduler chose,
state sync, output, cancel, the signal of a preemption, and powering idle nodes down and up.

Dispatch uses ``sbatch`` (slurmrestd 22.05 cannot pin a node list) with the cluster's
``slurm_conf``, as the attempt's own POSIX account (``sbatch --uid``, see ``accounts``), and
sync reads the job list with ``squeue`` on the same submit host: slurmrestd renders every job
it knows, ended ones included, at about 3.6 KB each (0.7–1.6 s of its time for 2,000 jobs), where
``squeue`` prints the eight fields sync reads in about a tenth of that, so the list can be read
every second and a job's end is seen within one. Everything else goes through slurmrestd.

The Slurm job is named after the attempt id and carries the cluster's tag (``tags``), so a
retried dispatch finds the job it already submitted instead of submitting it twice, and a sync
finds every job this cluster ever submitted there, and none of another's.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shlex
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from clusters.adapters.base import Inventory, LogChunk, Phase, RemoteState, Sent, Synced, Work
from clusters.adapters.launch import LAUNCH_NAMES, launch_env, local_world_size
from clusters.adapters.slurm.accounts import (
    Account,
    NoAccount,
    account_for,
    make_output_dir,
    output_path,
    read_tail,
)
from clusters.adapters.slurm.api import SlurmError, decode_exit, job_state, raw_job_state
from clusters.adapters.slurm.gres import GresRefused, gres_request, parse_node_gres
from clusters.adapters.slurm.inventory import GRES_LABEL, GRES_TYPE_LABEL, client_for, collect
from clusters.adapters.slurm.tags import claim, comment, submitted_job
from clusters.adapters.tags import cluster_tag
from clusters.choices import ClusterKind
from clusters.models import Cluster, Node

log = logging.getLogger(__name__)
# sbatch processes at once in one delivery, one per lane of works that share no node: each
# mostly waits on a process start and its RPC to slurmctld, which serves several at a time.
SUBMITTERS = 4
OUTPUT_TAIL = 1 << 20  # the last MiB of a job's output is copied in at each sync
COMPLETING_AGAIN_S = 0.1  # a job read back while Slurm still completes it is read again then

# Slurm's job states (as ``job_state`` maps them) → the neutral phases. COMPLETING is still
# running as far as the job's owner is concerned; Slurm's PENDING is a queue wait.
PHASES = {
    "PENDING": Phase.QUEUED,
    "HELD": Phase.HELD,
    "STARTING": Phase.STARTING,
    "RUNNING": Phase.RUNNING,
    "COMPLETING": Phase.RUNNING,
    "SUCCEEDED": Phase.SUCCEEDED,
    "FAILED": Phase.FAILED,
    "TIMEOUT": Phase.TIMEOUT,
    "CANCELLED": Phase.CANCELLED,
    "PREEMPTED": Phase.PREEMPTED,
}

# Why Slurm keeps a job pending, in words for the job page (the rest are shown as Slurm says).
SLURM_PENDING = {
    "JobHeldAdmin": "held by a Slurm administrator (scontrol release)",
    "JobHeldUser": "held in Slurm by its user (scontrol release)",
    "Resources": "waiting for resources in Slurm",
    "Priority": "waiting behind higher-priority Slurm jobs",
    "ReqNodeNotAvail": "a chosen node is not available in Slurm",
    "PartitionDown": "the Slurm partition is down",
}


class SlurmAdapter:
    """A real Slurm cluster through slurmrestd (JWT) and ``sbatch`` (to pin node lists)."""

    kind: ClassVar[str] = ClusterKind.SLURM
    runs_images: ClassVar[bool] = False
    image_label: ClassVar[str | None] = None
    needs_image: ClassVar[bool] = False
    shares_node_network: ClassVar[bool] = True
    runs_user_code: ClassVar[bool] = True
    pulls_inventory: ClassVar[bool] = True
    inventory_every_s: ClassVar[float] = 10.0
    dispatch_batch: ClassVar[int] = 200
    # A job's end frees its GPUs in Orrery when a sync sees it: every second keeps a short job's
    # GPUs from idling for most of a longer interval (the list is cheap: ``squeue_jobs``).
    sync_every_s: ClassVar[float | None] = 1.0

    def inventory(self, cluster: Cluster) -> Inventory:
        return collect(cluster)

    def dispatch(self, cluster: Cluster, works: Sequence[Work]) -> Iterator[Sent]:
        """``sbatch`` the works, yielding each ``Sent`` as soon as it is known; one already in
        Slurm (a retried delivery) is found, not submitted again. Works that share a node are
        submitted in turn, in the order the scheduler placed them: Slurm then gives each job on a
        node the GPUs Orrery chose. Works on disjoint nodes go ``SUBMITTERS`` at a time (lanes,
        ``lanes``). A work with no account it may run as (``NoAccount``), or asking for what the
        cluster cannot give as set up (``GresRefused``: a shared GPU where no shards are
        configured), fails at once: trying again would not help. Any other failure of one work
        (a refused ``sbatch``, an undecodable answer) is that work's error, tried again later;
        the others go on."""
        labels = _node_labels(cluster, works)
        tag = cluster_tag(cluster)
        known = submitted_jobs(cluster, [w.attempt_id for w in works], tag)  # one squeue for all
        ready = []
        for work in works:
            if work.attempt_id in known:
                yield Sent(work.attempt_id, remote_id=known[work.attempt_id])
                continue
            try:
                account = account_for(work.run_as, cluster.name)
                gres = work_gres(work, labels.get(work.nodes[0], {}) if work.shares else {}, cluster.config)
            except (NoAccount, GresRefused) as exc:
                log.warning("attempt %s cannot run on %s: %s", work.attempt_id, cluster.name, exc)
                yield Sent(work.attempt_id, phase=Phase.FAILED, message=str(exc)[:1000])
                continue
            ready.append((work, account, gres))
        made: set[tuple[Path, int]] = set()  # output directories this delivery has made
        done: queue.SimpleQueue[Sent] = queue.SimpleQueue()

        def run_lane(lane: list[tuple[Work, Account, str]]) -> None:
            for work, account, gres in lane:
                try:
                    done.put(Sent(work.attempt_id, remote_id=submit(cluster, work, account, tag, gres, made)))
                except Exception as exc:
                    log.warning("dispatch of %s to %s failed: %s", work.attempt_id, cluster.name, exc)
                    done.put(Sent(work.attempt_id, error=f"{type(exc).__name__}: {exc}"[:1000]))

        with ThreadPoolExecutor(SUBMITTERS) as pool:
            for lane in lanes(ready):
                pool.submit(run_lane, lane)
            for _ in ready:
                yield done.get()

    def sync(self, cluster: Cluster, works: Sequence[Work]) -> Synced:
        """States, exit codes and output of the asked attempts; a job that vanished from Slurm
        fails. Only this cluster's jobs count (``tags.claim``): live jobs with its tag under the
        name of an attempt not asked about, or a second job under an asked attempt's name, are
        orphans."""
        asked = {w.attempt_id: w for w in works}
        tag = cluster_tag(cluster)
        mark = comment(tag)
        # Only jobs claim can take (an asked attempt's name, or this cluster's tag) are read whole.
        listed = squeue_jobs(cluster, lambda name, text: name in asked or text == mark)
        found, orphans = claim(listed, works, tag)
        states, output = [], []
        accounts: dict[str | None, Account | None] = {}
        for name, slurm_job in found.items():
            chunk = _output(cluster, asked[name], accounts)
            if chunk is not None:
                output.append(chunk)
            states.append(remote_state(name, slurm_job))
        copied = _COPIED.get(cluster.pk, {})
        for gone in set(copied) - set(asked):  # ended, and no longer asked about
            del copied[gone]
        for work in works:
            if work.remote_id and work.attempt_id not in found:
                states.append(
                    RemoteState(
                        work.attempt_id, Phase.FAILED, work.remote_id, message="the job vanished from Slurm"
                    )
                )
        return Synced(states=states, output=output, orphans=orphans)

    def read_back(self, cluster: Cluster, works: Sequence[Work]) -> Synced:
        """``SupportsReadBack``: ``squeue -j`` with the works' Slurm ids, a read of the few jobs
        Slurm rang about instead of every job it holds. A job is taken only under its attempt's
        name and this cluster's tag. One still COMPLETING (its end recorded, its epilogs not yet
        done, its final state not yet said) asks to be read again shortly."""
        by_id = {w.remote_id: w for w in works if w.remote_id}
        mark = comment(cluster_tag(cluster))
        accounts: dict[str | None, Account | None] = {}
        states, output, again = [], [], None
        for slurm_job in squeue_jobs(cluster, job_ids=list(by_id)):
            work = by_id.get(str(slurm_job["job_id"]))
            if work is None or slurm_job["name"] != work.attempt_id or slurm_job["comment"] != mark:
                continue
            if job_state(slurm_job["job_state"]) == "COMPLETING":
                again = COMPLETING_AGAIN_S
            chunk = _output(cluster, work, accounts)
            if chunk is not None:
                output.append(chunk)
            states.append(remote_state(work.attempt_id, slurm_job))
        return Synced(states=states, output=output, again_in_s=again)

    def cancel(self, cluster: Cluster, remote_ids: Sequence[str]) -> int:
        """Cancel Slurm jobs; a refusal (the job ended meanwhile) is logged and the rest go on."""
        client, done = client_for(cluster), 0
        for remote_id in remote_ids:
            try:
                client.cancel(int(remote_id))
                done += 1
            except SlurmError as exc:
                log.warning("could not cancel Slurm job %s: %s", remote_id, exc)
        return done

    def power_down(self, cluster: Cluster, node: str) -> None:
        """Power the node down through Slurm's power saving (``SupportsPowerSaving``): Slurm runs
        its ``SuspendProgram``, and powers the node up again by itself if a job is started there."""
        client_for(cluster).set_node_state(node, "POWER_DOWN")

    def power_up(self, cluster: Cluster, node: str) -> None:
        """Power the node up through Slurm's ``ResumeProgram`` (``SupportsPowerSaving``)."""
        client_for(cluster).set_node_state(node, "POWER_UP")

    def signal(self, cluster: Cluster, remote_ids: Sequence[str], signal: str, grace_s: int) -> int:
        """Signal running Slurm jobs (``SupportsSignal``): the batch script and everything it
        started get ``signal``; the kill after the grace period is a ``cancel``. A refusal (the
        job ended meanwhile) is logged and the rest go on."""
        client, done = client_for(cluster), 0
        for remote_id in remote_ids:
            try:
                client.signal(int(remote_id), signal)
                done += 1
            except SlurmError as exc:
                log.warning("could not signal Slurm job %s (SIG%s): %s", remote_id, signal, exc)
        return done


def lanes(ready: Sequence[tuple[Work, Any, str]]) -> list[list[tuple[Work, Any, str]]]:
    """The works split into lanes that share no node, each in the given order (pure): works
    that share a node, even through a third, are in one lane."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for work, *_ in ready:
        for node in work.nodes[1:]:
            parent[root(node)] = root(work.nodes[0])
    by_root: dict[str, list[tuple[Work, Any, str]]] = {}
    for item in ready:
        by_root.setdefault(root(item[0].nodes[0]) if item[0].nodes else "", []).append(item)
    return list(by_root.values())


def remote_state(attempt_id: str, slurm_job: dict[str, Any]) -> RemoteState:
    """Slurm's word on one job, in neutral terms (pure: tested on recorded answers)."""
    state = job_state(slurm_job.get("job_state"))
    phase = PHASES.get(state, Phase.FAILED)
    remote_id = str(slurm_job.get("job_id") or "")
    why = str(slurm_job.get("state_reason") or "")
    why = "" if why == "None" else why  # Slurm's word for "no reason"
    if phase in (Phase.QUEUED, Phase.HELD):
        text = f"pending in Slurm: {SLURM_PENDING.get(why, why)}"[:512] if why else ""
        return RemoteState(attempt_id, phase, remote_id, message=text)
    if phase is Phase.RUNNING:
        # Only a job really running (not completing, not suspended) can pass its time limit.
        running = raw_job_state(slurm_job.get("job_state")) == "RUNNING"
        started = slurm_job.get("start_time") or None
        return RemoteState(
            attempt_id,
            phase,
            remote_id,
            message=f"running on {nodes}" if (nodes := slurm_job.get("nodes")) else "running in Slurm",
            started_at=float(started) if running and started else None,
        )
    if phase.ended:
        code, signal = decode_exit(slurm_job.get("exit_code"))
        raw = raw_job_state(slurm_job.get("job_state"))  # Slurm's own word, when ours differs
        said = ", ".join(filter(None, [why or (raw if raw != state else ""), code and f"exit code {code}"]))
        message = f"{state.lower()} in Slurm" + (f" ({said})" if said else "")
        if signal:
            message = f"{state.lower()} in Slurm (signal {signal})"
        return RemoteState(attempt_id, phase, remote_id, exit_code=code, message=message)
    return RemoteState(attempt_id, phase, remote_id)


def submit(
    cluster: Cluster,
    work: Work,
    account: Account,
    tag: str,
    gres: str = "",
    made: set[tuple[Path, int]] | None = None,
) -> str:
    """Submit the Slurm job of an attempt, as ``account``, asking for ``gres`` on each node
    (``work_gres``); returns its Slurm job id. The caller has looked for one already submitted
    (``submitted_jobs``). ``made`` holds the output directories already made by this delivery:
    one ``mkdir`` per user and delivery rather than one per job."""
    output = output_path(cluster.config, account, work.attempt_id)
    if made is None or (output.parent, account.uid) not in made:
        make_output_dir(output.parent, account)
        if made is not None:
            made.add((output.parent, account.uid))
    done = subprocess.run(
        sbatch_argv(work, gres, account=account, output=str(output), tag=tag),
        input=batch_script(work),
        capture_output=True,
        text=True,
        env=_cli_env(cluster),
        timeout=60,
        # Slurm creates the output file with the submitter's umask: readable by its owner only.
        umask=0o077,
    )
    if done.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {done.stderr.strip()[:300]}")
    return done.stdout.strip().split(";")[0]


def submitted(cluster: Cluster, attempt_id: str, tag: str) -> str:
    """The Slurm id of the live job this cluster already submitted for an attempt ("" for none):
    a job of that name without the cluster's tag is another's."""
    return submitted_jobs(cluster, [attempt_id], tag).get(attempt_id, "")


def submitted_jobs(cluster: Cluster, attempt_ids: Sequence[str], tag: str) -> dict[str, str]:
    """``submitted`` for many attempts with one ``squeue``: attempt id → Slurm id, for those
    that have a live job of this cluster. An ``squeue`` that fails finds none (``sbatch`` then
    fails the same way, or the next sync finds a duplicate as an orphan)."""
    if not attempt_ids:
        return {}
    found = subprocess.run(
        ["squeue", "-h", "-o", "%j|%i|%k", f"--name={','.join(attempt_ids)}"],
        capture_output=True,
        text=True,
        env=_cli_env(cluster),
        timeout=30,
    )
    if found.returncode != 0:
        return {}
    lines: dict[str, list[str]] = {}
    for line in found.stdout.splitlines():
        name, _, rest = line.partition("|")  # attempt ids hold no "|"
        lines.setdefault(name, []).append(rest)
    return {name: job_id for name, rest in lines.items() if (job_id := submitted_job("\n".join(rest), tag))}


# What sync reads of each job, in slurmrestd's names, and ``squeue -O`` fields that print them.
# Each field ends with a separator no Slurm-made field holds; the free-text comment and name come
# last, and the name is the last field, so a separator typed into either shifts nothing else and
# an attempt's name (a UUID) is read whole.
_SEP = "\x1f"
_SQUEUE_FIELDS = (
    ("job_id", "JobID"),
    ("job_state", "State"),
    ("exit_code", "exit_code"),
    ("start_time", "StartTime"),
    ("state_reason", "Reason"),
    ("nodes", "NodeList"),
)
_SQUEUE_FORMAT = ",".join(f"{field}:{_SEP}" for _, field in _SQUEUE_FIELDS) + f",Comment:{_SEP},Name:{_SEP}"


def squeue_jobs(
    cluster: Cluster, keep: Callable[[str, str], bool] | None = None, *, job_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Every job Slurm still holds, ended ones included (as slurmrestd's job list has them, with
    the fields sync reads), or those whose name and comment ``keep`` takes, or only the jobs of
    ``job_ids`` (those Slurm no longer knows are left out). Raises ``SlurmError`` when Slurm
    cannot be asked."""
    only = [j for j in job_ids if j.isascii() and j.isdigit()] if job_ids is not None else None
    if only == []:
        return []
    try:
        done = subprocess.run(
            ["squeue", "-h", "-t", "all", "--noconvert", "-O", _SQUEUE_FORMAT]
            + ([f"--jobs={','.join(only)}"] if only else []),
            capture_output=True,
            text=True,
            env=_cli_env(cluster),
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"squeue could not read the jobs of {cluster.name}: {exc}") from exc
    if done.returncode != 0:
        if only and "Invalid job id" in done.stderr:
            return []  # none of them is known any more (each known one would be listed)
        raise SlurmError(f"squeue could not read the jobs of {cluster.name}: {done.stderr.strip()[:300]}")
    return [job for line in done.stdout.splitlines() if (job := parse_squeue_line(line, keep)) is not None]


def parse_squeue_line(line: str, keep: Callable[[str, str], bool] | None = None) -> dict[str, Any] | None:
    """One line of ``squeue_jobs`` as slurmrestd would give the job (pure); None for a line that
    is not a job's, or whose name and comment ``keep`` does not take."""
    parts = line.split(_SEP)
    if len(parts) < len(_SQUEUE_FIELDS) + 3 or not parts[0].strip().isdigit():
        return None
    name, text = parts[-2], _SEP.join(parts[len(_SQUEUE_FIELDS) : -2])
    text = "" if text == "(null)" else text
    if keep is not None and not keep(name, text):
        return None
    job_id, state, code, start, reason, nodes = (part.strip() for part in parts[: len(_SQUEUE_FIELDS)])
    return {
        "job_id": int(job_id),
        "job_state": state,
        "exit_code": int(code) if code.isdigit() else None,
        "start_time": _epoch(start),
        "state_reason": reason,
        "nodes": "" if nodes == "(null)" else nodes,
        "comment": text,
        "name": name,
    }


def _epoch(text: str) -> int:
    """squeue's local ``2026-12-02T13:18:37`` as epoch seconds; 0 for ``N/A``, ``Unknown``."""
    try:
        return int(datetime.fromisoformat(text).timestamp())  # naive: local time, as squeue prints
    except ValueError:
        return 0


def sbatch_argv(work: Work, gres: str, *, account: Account, output: str, tag: str) -> list[str]:
    """The ``sbatch`` command line of an attempt (an argv list, never a shell string), asking
    for ``gres`` on each node (``work_gres``: whole GPUs, MIG instances or shards). The job
    runs as ``account`` (``--uid`` and its primary group; the shared service account submits as
    itself), starts in its home, and inherits nothing of the submitting process's environment
    (``--export=NONE``): its variables are set, quoted, by its batch script (``batch_script``),
    which ``sbatch`` reads on stdin."""
    if not account.shared and (account.uid == 0 or account.gid == 0):
        raise NoAccount(f"refusing to run a user's work as root ('{account.name}')")
    argv = [
        "sbatch",
        "--parsable",
        f"--job-name={work.attempt_id}",
        f"--comment={comment(tag)}",
        f"--nodelist={','.join(work.nodes)}",
        f"--nodes={len(work.shares)}",
        f"--output={output}",
        f"--chdir={account.home}",
        # Always: Orrery's failover policy places a retry (anywhere, counted against the job's
        # retries); Slurm's own requeue would rerun it pinned to the same nodes, unseen.
        "--no-requeue",
        "--export=NONE",
    ]
    if not account.shared:
        argv += [f"--uid={account.name}", f"--gid={account.gid}"]
    if gres:
        argv.append(f"--gres={gres}")
    if work.time_limit_s:
        argv.append(f"--time={max(1, -(-work.time_limit_s // 60))}")
    return argv


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def batch_script(work: Work) -> str:
    """The batch script of an attempt: a plain environment (a default ``PATH``, ``HOME`` and
    ``USER`` of the account it runs as), the job's own ``env``, then the ``ORRERY_*`` variables
    and the launch environment (``clusters.adapters.launch``; the job's ``env`` cannot override
    them), each quoted for the shell, then the job's script. No value can inject a variable or a
    command, and nothing of the control plane's environment is there to read.

    The batch script runs on the first node of the allocation. ``MASTER_ADDR`` is that node (the
    first host of ``SLURM_JOB_NODELIST``, rank 0: ``SLURM_NODEID`` counts in the same order). A
    gang's script runs once on every node, as on every kind: one ``srun`` task per node with all
    of the node's allocation (``--whole``), its rank ``NODE_RANK = SLURM_NODEID``; the first task
    to fail ends the others (``--kill-on-bad-exit``) and the job's exit code is the highest."""
    nodes = len(work.shares)
    own = {str(k): str(v) for k, v in work.env.items() if str(k) not in LAUNCH_NAMES}
    variables = {
        **own,
        "ORRERY_JOB_ID": str(work.job_id),
        "ORRERY_ATTEMPT": str(work.number),
        "ORRERY_ATTEMPT_ID": work.attempt_id,
        "ORRERY_GPUS_PER_NODE": str(work.gpus_per_node),
        **launch_env(
            nnodes=nodes,
            gpus_per_node=work.gpus_per_node,
            master_port=work.master_port,
            node_rank=0 if nodes <= 1 else None,
        ),
    }
    bad = [k for k in variables if not _ENV_NAME.fullmatch(k)]
    if bad:
        raise SlurmError(f"not an environment variable name: {bad[0]!r}")
    lines = [
        "#!/bin/sh",
        "umask 077",
        'export PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"',
        'export USER="${USER:-$(id -un)}"',
        'export HOME="${HOME:-$(getent passwd "$(id -un)" | cut -d: -f6)}"',
        *(f"export {k}={shlex.quote(v)}" for k, v in variables.items()),
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1)"',
        'export MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"',
        'export ORRERY_HEAD_ADDR="$MASTER_ADDR"',
    ]
    if nodes <= 1:
        return "\n".join([*lines, work.script]) + "\n"
    local = local_world_size(work.gpus_per_node)
    rank = (
        'export NODE_RANK="$SLURM_NODEID" ORRERY_NODE_RANK="$SLURM_NODEID" '
        f'RANK="$((SLURM_NODEID * {local}))"'
    )
    lines += [
        # The job was submitted with --export=NONE, which its steps would inherit: they get the
        # environment above instead.
        "export SLURM_EXPORT_ENV=ALL",
        f"exec srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --whole --kill-on-bad-exit=1 "
        f"--export=ALL /bin/sh -c {shlex.quote(f'{rank}; {work.script}')}",
    ]
    return "\n".join(lines) + "\n"


def _cli_env(cluster: Cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JWT"}  # a stray SLURM_JWT breaks munge auth
    if cluster.config.get("slurm_conf"):
        env["SLURM_CONF"] = cluster.config["slurm_conf"]
    return env


def work_gres(work: Work, labels: Mapping[str, str], config: Mapping[str, Any]) -> str:
    """What an attempt asks of each of its nodes (``--gres``, "" for nothing), by the head node's
    labels (its GRES, as the inventory keeps it) and the cluster's settings (pure). A gang's
    nodes hold alike, so the head's share speaks for each. Raises ``GresRefused``."""
    if not work.shares:
        return ""
    node = parse_node_gres(labels.get(GRES_LABEL, ""))
    return gres_request(
        work.shares[0],
        gpu_type=labels.get(GRES_TYPE_LABEL, ""),
        node_mig_types={profile: entry.gres_type for profile, entry in node.mig.items()},
        config=config,
    )


def _node_labels(cluster: Cluster, works: Sequence[Work]) -> dict[str, dict[str, str]]:
    """The labels of each node the works run on (its GRES, as the inventory keeps them)."""
    names = {n for w in works for n in w.nodes}
    rows = Node.objects.filter(cluster=cluster, name__in=names).values_list("name", "labels")
    return {name: labels or {} for name, labels in rows}


# Cluster → attempt id → (size, mtime) of the output this process last copied in: a file that has
# not changed since is not read or stored again (a sync every second would otherwise rewrite every
# running job's log row each time). Another process, or this one restarted, copies it once more,
# which ``store_log`` recognises as a replay.
_COPIED: dict[int, dict[str, tuple[int, int]]] = {}


def _output(cluster: Cluster, work: Work, accounts: dict[str | None, Account | None]) -> LogChunk | None:
    """The tail of the job's output file, as the head node's stream (None while there is none,
    while it is empty or unchanged since this process copied it, or when the attempt no longer
    has an account to say where it is)."""
    if not work.shares:
        return None
    if work.run_as not in accounts:
        try:
            accounts[work.run_as] = account_for(work.run_as, cluster.name)
        except NoAccount:
            accounts[work.run_as] = None
    account = accounts[work.run_as]
    if account is None:
        return None
    path = output_path(cluster.config, account, work.attempt_id)
    try:
        seen = os.lstat(path)  # only to skip an unchanged file: read_tail checks what it opens
    except OSError:
        return None
    copied = _COPIED.setdefault(cluster.pk, {})
    if not seen.st_size or copied.get(work.attempt_id) == (seen.st_size, seen.st_mtime_ns):
        return None
    tail = read_tail(path, account.uid, OUTPUT_TAIL)
    if tail is None:
        return None
    copied[work.attempt_id] = (seen.st_size, seen.st_mtime_ns)
    offset, data = tail
    return LogChunk(work.attempt_id, work.shares[0].node, offset, data.decode("utf-8", "replace"))
