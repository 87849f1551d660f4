"""Running attempts as the users they belong to, and reporting what became of them.

Each attempt has two directories:

* its **state** (``WORK/attempts/<id>/``, root's, mode 0700): ``output.log`` (the captured
  output, which the job's own user cannot open), ``exit_code``, ``meta.json``, the marks of
  what was shipped and reported;
* its **job directory** (``WORK/jobs/<id>/``, owned by the account the attempt runs as, mode
  0700): the job's working directory, with its script and environment file.

The attempt runs under ``/bin/sh`` as the job owner's POSIX account (``entry["user"]``,
resolved in the node's own user database: uid, gid and supplementary groups) through
``setpriv``, with a clean environment (the spec's ``env``, ``ORRERY_*``,
``CUDA_VISIBLE_DEVICES``, ``HOME``, ``USER``, ``LOGNAME``, ``PATH``) that is applied only after
the privileges are dropped. A container-image attempt runs under ``podman`` as that same
account. The outer shell, root's, writes the job's exit status to ``exit_code`` when it ends,
so an agent that restarts finds its attempts again and learns how they ended. That shell first
writes its own pid to ``pid``: an agent killed between starting an attempt and recording it
(``meta.json``) finds the unrecorded processes by it and kills them before anything else
(checking ``/proc`` that they still belong to the attempt: pids are reused).

An attempt's directories go ``retention`` seconds after its end reached the server and its
output was all shipped (``clean``); its id stays in ``WORK/ended`` (one line each), so an
attempt the server still lists is never started again.

Each attempt has its own cgroup (``cgroups``): CPU and memory limits from the job's request,
and a stop that reaches every process it started (SIGTERM to all, SIGKILL to all after
``grace`` seconds), however it forked. Without cgroups (an agent not running as root) the
process group is all there is. A preemption stops an attempt the same way with its own signal
and grace period, and its end is reported ``preempted`` whatever its exit code (``stop.json``
keeps that across a restart of the agent).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import math
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusters.agent import mig
from clusters.agent.cgroups import Cgroups, Group

log = logging.getLogger("orrery.agent")
FENCED = "fenced: lost contact with the control plane"
LOG_CHUNK = 256 * 1024  # bytes of output per chunk: a chunk stays far below the server's 1 MiB
LOG_KEEP = 1 << 20  # the server keeps this much of each attempt's output (JobLog.MAX_BYTES)…
LOG_SKIP_PAST = 8 << 20  # …so a backlog past this is skipped down to its last LOG_KEEP bytes
LOG_HOP = 32 << 20  # a skip moves at most this far per chunk: half the server's MAX_LOG_GAP
ENDED_STATES = frozenset({"succeeded", "failed", "timeout", "cancelled", "preempted"})
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
STOP_SIGNALS = ("TERM", "INT", "HUP", "USR1", "USR2", "QUIT")  # what a stop may send (not KILL)


class Refused(Exception):
    """An attempt this node will not start; the message says why (it becomes the attempt's)."""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


@dataclass
class Attempt:
    id: str
    pgid: int
    directory: Path
    started: float
    time_limit: float | None
    popen: subprocess.Popen | None = None
    stopping_since: float | None = None
    stop_reason: str = ""  # "cancelled", "timeout", "fenced" or "preempted" once we stop it
    stop_signal: int = signal.SIGTERM
    stop_grace: float | None = None  # seconds to SIGKILL; None: the runner's grace
    killed: bool = False  # SIGKILLed at the end of its grace
    group: Group | None = None
    container: str = ""  # the podman container's name, for an image attempt
    gpus: tuple[int, ...] = ()  # the indices of the GPUs it holds (parents of its MIG instances)


class Runner:
    def __init__(
        self,
        work_dir: Path,
        grace: float = 10.0,
        *,
        shared_user: str = "nobody",
        podman_args: tuple[str, ...] = (),
        cgroups: Cgroups | None = None,
        real_gpus: bool = False,
    ) -> None:
        self.root = work_dir / "attempts"
        self.jobs = work_dir / "jobs"
        for directory, mode in ((work_dir, 0o711), (self.root, 0o700), (self.jobs, 0o711)):
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(mode)  # jobs may pass through to their own directory, never list
        self.grace = grace
        self.shared_user = shared_user
        self.podman_args = tuple(podman_args)
        self.podman = shutil.which("podman")
        self.cgroups = cgroups
        self.real_gpus = real_gpus
        self.attempts: dict[str, Attempt] = {}
        # What is known in memory first, so that a work directory that cannot be written
        # never makes an attempt run twice nor its output ship again and again.
        self.ended: dict[str, str] = {}  # attempt id → end state, for attempts ended in this run
        self.shipped: dict[str, int] = {}  # attempt id → bytes of output shipped
        self.ended_record = work_dir / "ended"
        self.cleaned = self._cleaned()
        self._adopt()

    def _cleaned(self) -> set[str]:
        try:
            return {line.split()[0] for line in self.ended_record.read_text().splitlines() if line.strip()}
        except FileNotFoundError:
            return set()

    def _adopt(self) -> None:
        """Attempts a previous run of the agent started, still running or not."""
        for directory in self.root.iterdir():
            meta = directory / "meta.json"
            if (directory / "reported").exists():
                continue
            try:
                info = json.loads(meta.read_text())
            except (OSError, ValueError):
                # Started but never recorded (or recorded in part): nothing to adopt, and
                # nothing of it may run on beside a later start.
                self._kill_unrecorded(directory.name)
                continue
            attempt = Attempt(
                directory.name,
                info["pgid"],
                directory,
                info["started"],
                info.get("time_limit"),
                group=self.cgroups.group(directory.name) if self.cgroups and info.get("cgroup") else None,
                container=info.get("container", ""),
                gpus=tuple(int(g) for g in info.get("gpus") or ()),
            )
            self._resume_stop(attempt)
            self.attempts[directory.name] = attempt

    @staticmethod
    def _resume_stop(attempt: Attempt) -> None:
        """A stop begun by an earlier run of the agent goes on where it was: same reason, same
        signal, same deadline (the signal is not sent again)."""
        try:
            stop = json.loads((attempt.directory / "stop.json").read_text())
            attempt.stopping_since = float(stop["since"])
            attempt.stop_reason = str(stop["reason"])
            attempt.stop_signal = int(stop.get("signal") or signal.SIGTERM)
            grace = stop.get("grace")
            attempt.stop_grace = None if grace is None else float(grace)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no stop begun (or a torn file): the server's answer decides again

    # --- who runs it ------------------------------------------------------------------------
    def account(self, user: str | None) -> Account:
        """The POSIX account an attempt runs as: the named one ("" is the node's shared
        account), resolved on this node. Never root."""
        if user is None:
            raise Refused("the job's owner has no POSIX account on this cluster")
        name = user or self.shared_user
        if os.geteuid() != 0:
            own = pwd.getpwuid(os.geteuid())
            if user and user != own.pw_name:
                raise Refused(f"the agent does not run as root: it cannot start work as '{user}'")
            name = own.pw_name
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise Refused(f"no user '{name}' on node's user database") from None
        if entry.pw_uid == 0:
            raise Refused(f"'{name}' is root: work never runs as root")
        groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != 0)
        return Account(name, entry.pw_uid, entry.pw_gid, groups or (entry.pw_gid,), entry.pw_dir)

    # --- starting ---------------------------------------------------------------------------
    def is_ended(self, attempt_id: str) -> bool:
        """Whether this node ran (or refused) the attempt to its end: it never starts again."""
        return (
            attempt_id in self.ended
            or attempt_id in self.cleaned
            or (self.root / attempt_id / "reported").exists()
        )

    def refuse(self, attempt_id: str, state: str = "failed") -> None:
        """Remember an attempt that was refused (or preempted before it started: ``state``
        "preempted"), so it is never started later."""
        self.ended[attempt_id] = state
        directory = self.root / attempt_id
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            (directory / "reported").write_text(state)
        except OSError as exc:
            log.warning("cannot record the end of %s before its start (kept in memory): %s", attempt_id, exc)

    def _kill_unrecorded(self, attempt_id: str) -> None:
        """Kill what an earlier start of the attempt left running without a record (the agent
        died between starting it and writing ``meta.json``): through its cgroup, its container,
        and the process group its wrapper shell wrote to ``pid``."""
        state = self.root / attempt_id
        killed = 0
        if self.cgroups is not None:
            group = self.cgroups.group(attempt_id)
            if group.exists() and group.pids():
                killed += len(group.pids())
                group.kill()
        with contextlib.suppress(FileNotFoundError, ValueError):
            leader = int((state / "pid").read_text().strip())
            members = _members(leader, str(state / "exit_code"), attempt_id)
            if leader in members:  # the wrapper itself, checked: its whole group goes
                _signal_group(leader, signal.SIGKILL)
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed += len(members)
        if (state / "env.list").exists() and self.podman:
            subprocess.run(
                [self.podman, "rm", "--force", "--time=0", f"orrery-{attempt_id}"],
                capture_output=True,
                timeout=60,
                check=False,
            )
        if killed:
            log.warning("killed %d unrecorded process(es) of %s left by an earlier start", killed, attempt_id)

    def start(self, entry: dict[str, Any]) -> Attempt:
        """Start one attempt; raises ``Refused`` (nothing started) when it cannot run here."""
        account = self.account(entry.get("user", ""))
        image = str(entry.get("image") or "")
        if image and not self.podman:
            raise Refused("this node cannot run container images (no podman)")
        env = self._environment(entry, account)
        state, job = self.root / entry["attempt"], self.jobs / entry["attempt"]
        state.mkdir(mode=0o700, exist_ok=True)
        shutil.rmtree(job, ignore_errors=True)  # a start that crashed half-way
        job.mkdir(mode=0o700)
        # A plain attempt's shell reads its environment from a file; podman takes an env file
        # only root can read (below).
        files = {".orrery-script": str(entry.get("script") or "")} | (
            {} if image else {".orrery-env": _exports(env)}
        )
        for name, text in files.items():
            (job / name).write_text(text)
            os.chown(job / name, account.uid, account.gid)
        os.chown(job, account.uid, account.gid)
        # An agent killed between starting this attempt and recording it left processes it
        # cannot adopt: they go before the attempt starts again, never beside it.
        self._kill_unrecorded(entry["attempt"])
        for stale in ("pid", "exit_code", "meta.json"):
            with contextlib.suppress(FileNotFoundError):
                (state / stale).unlink()
        group = None
        if self.cgroups is not None:
            group = self.cgroups.group(entry["attempt"])
            group.create(int(entry.get("cpu_millicores") or 0), int(entry.get("memory_bytes") or 0))
        container = f"orrery-{entry['attempt']}" if image else ""
        if image:
            (state / "env.list").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
            command = self._podman(entry, account, job, state / "env.list", container, group)
        else:
            command = self._as_user(account)
        exit_file, pid_file = state / "exit_code", state / "pid"
        # Root's shell writes its pid first (what a restarted agent goes by when this start was
        # never recorded), runs the job's command and records how it ended, even if the agent
        # that started it is gone by then; nothing of the job's environment reaches it. A stop
        # signals the whole process group: the shell catches the signals a stop may send (a
        # caught signal is reset to its default in the job it starts) and so outlives them, to
        # wait for the job's own end within its grace period and record its exit code.
        wrapper = (
            f"trap : {' '.join(STOP_SIGNALS)}; echo $$ > {shlex.quote(str(pid_file))}; "
            f"{shlex.join(command)}; echo $? > {shlex.quote(str(exit_file))}"
        )
        fd = os.open(state / "output.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as output:
            popen = subprocess.Popen(
                ["/bin/sh", "-c", wrapper],
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={"PATH": SAFE_PATH},
                cwd=job,
                start_new_session=True,
                preexec_fn=group.join if group else None,
            )
        limit = entry.get("time_limit_s")
        attempt = Attempt(
            entry["attempt"],
            popen.pid,
            state,
            time.time(),
            float(limit) if limit else None,
            popen,
            group=group,
            container=container,
            gpus=tuple(int(g) for g in entry.get("gpus") or ()),
        )
        (state / "meta.json").write_text(
            json.dumps(
                {
                    "pgid": popen.pid,
                    "started": attempt.started,
                    "time_limit": attempt.time_limit,
                    "user": account.name,
                    "cgroup": group is not None,
                    "container": container,
                    "gpus": list(attempt.gpus),
                }
            )
        )
        self.attempts[attempt.id] = attempt
        return attempt

    def _environment(self, entry: dict[str, Any], account: Account) -> dict[str, str]:
        """The whole environment of the job: nothing of the agent's."""
        gpus = list(entry.get("gpus") or [])
        share = share_environment(entry)
        env = {
            "PATH": SAFE_PATH,
            "HOME": account.home,
            "USER": account.name,
            "LOGNAME": account.name,
            **{str(k): str(v) for k, v in (entry.get("env") or {}).items()},
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpus),
            **share,  # a MIG instance's or a shared GPU's: after the job's, which cannot change them
            "ORRERY_JOB_ID": str(entry["job"]),
            "ORRERY_ATTEMPT": str(entry.get("number", 1)),
            "ORRERY_ATTEMPT_ID": entry["attempt"],
            "ORRERY_NNODES": str(entry.get("nnodes", 1)),
            "ORRERY_NODE_RANK": str(entry.get("node_rank", 0)),
            "ORRERY_HEAD_ADDR": str(entry.get("head_addr", "")),
            "ORRERY_GPUS_PER_NODE": str(len(gpus)),
            # MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK…: the gang's agreement, as the server
            # computed it for this node; last, so the job's own env cannot change it
            **{str(k): str(v) for k, v in (entry.get("launch") or {}).items()},
        }
        if bad := [k for k in env if not ENV_NAME.fullmatch(k)]:
            raise Refused(f"not an environment variable name: {bad[0][:64]!r}")
        if entry.get("image") and any("\n" in v or "\0" in v for v in env.values()):
            raise Refused("a container's environment cannot hold a value with a newline")
        return env

    @staticmethod
    def _as_user(account: Account) -> list[str]:
        """Drop to the account (no way back: no new privileges), then clear the environment
        and read the job's own from its file, then run its script. An agent that is not root
        runs work as itself: there is nothing to drop."""
        job = ["/usr/bin/env", "-i", "/bin/sh", "-c", ". ./.orrery-env && exec /bin/sh ./.orrery-script"]
        if os.geteuid() != 0:
            return job
        return [
            "/usr/bin/setpriv",
            f"--reuid={account.uid}",
            f"--regid={account.gid}",
            f"--groups={','.join(str(g) for g in account.groups)}",
            "--no-new-privs",
            "--",
            *job,
        ]

    def _podman(
        self,
        entry: dict[str, Any],
        account: Account,
        job: Path,
        env_file: Path,
        name: str,
        group: Group | None,
    ) -> list[str]:
        argv = [
            str(self.podman),
            "run",
            "--rm",
            f"--name={name}",
            f"--user={account.uid}:{account.gid}",
            *(f"--group-add={g}" for g in account.groups if g != account.gid),
            "--security-opt=no-new-privileges",
            "--cap-drop=all",
            "--network=host",  # gang members reach their head like plain attempts do
            f"--env-file={env_file}",
            f"--volume={job}:{job}",
            f"--workdir={job}",
            "--pull=missing",
            *self.podman_args,
        ]
        if group is not None:
            argv.append(f"--cgroup-parent={group.relative}")
        if entry.get("memory_bytes"):
            argv.append(f"--memory={int(entry['memory_bytes'])}")
        if entry.get("cpu_millicores"):
            argv.append(f"--cpus={int(entry['cpu_millicores']) / 1000:g}")
        if self.real_gpus:  # through the NVIDIA Container Toolkit's CDI specification
            devices = entry.get("mig_uuids") or list(dict.fromkeys(entry.get("gpus") or []))
            argv += [f"--device=nvidia.com/gpu={d}" for d in devices]
        argv.append(str(entry["image"]))
        if entry.get("script"):
            argv += ["/bin/sh", f"{job}/.orrery-script"]
        return argv

    # --- stopping -----------------------------------------------------------------------------
    def stop(
        self,
        attempt_id: str,
        reason: str = "cancelled",
        sig: int = signal.SIGTERM,
        grace: float | None = None,
    ) -> None:
        """Send ``sig`` to every process of the attempt, and SIGKILL to all of them ``grace``
        seconds later (None: the runner's grace) unless they ended; ``reason`` is the state its
        end is reported with. Once per attempt: a second stop changes nothing."""
        attempt = self.attempts.get(attempt_id)
        if attempt is None or attempt.stopping_since is not None:
            return
        attempt.stopping_since, attempt.stop_reason = time.time(), reason
        attempt.stop_signal, attempt.stop_grace = sig, grace
        if reason == "preempted":  # its end is reported as such even after a restart
            record = {"since": attempt.stopping_since, "reason": reason, "signal": int(sig), "grace": grace}
            with contextlib.suppress(OSError):
                (attempt.directory / "stop.json").write_text(json.dumps(record))
        _signal_group(attempt.pgid, sig)
        if attempt.group is not None:
            attempt.group.signal(sig)  # also what left the process group

    def is_stopping(self, attempt_id: str) -> bool:
        attempt = self.attempts.get(attempt_id)
        return attempt is not None and attempt.stopping_since is not None

    def running_ids(self) -> list[str]:
        return list(self.attempts)

    def held_gpus(self) -> set[int]:
        """The indices of the GPUs that attempts still running (or stopping) hold."""
        return {g for attempt in self.attempts.values() for g in attempt.gpus}

    # --- watching -------------------------------------------------------------------------------
    def poll(self) -> list[dict[str, Any]]:
        """Enforce time limits and grace periods; return reports of attempts that ended. A
        failure with one attempt is logged and the others are watched all the same (an ended
        attempt's report is never dropped for another's error)."""
        now = time.time()
        reports = []
        for attempt in list(self.attempts.values()):
            try:
                if (
                    attempt.time_limit
                    and attempt.stopping_since is None
                    and now - attempt.started > attempt.time_limit
                ):
                    self.stop(attempt.id, "timeout")
                grace = self.grace if attempt.stop_grace is None else attempt.stop_grace
                if attempt.stopping_since is not None and now - attempt.stopping_since > grace:
                    attempt.killed = attempt.killed or self._alive(attempt, reap=False)
                    self._kill(attempt)
                if self._alive(attempt):
                    continue
                reports.append(self._ended(attempt))
            except Exception:
                log.exception("error while watching %s", attempt.id)
        return reports

    def _alive(self, attempt: Attempt, *, reap: bool = True) -> bool:
        """Whether the attempt's shell still runs; once it is gone (and ``reap``), nothing it
        started lingers."""
        if attempt.popen is not None:
            if attempt.popen.poll() is None:
                return True
        elif not (attempt.directory / "exit_code").exists() and (
            attempt.group.pids() if attempt.group is not None else _group_alive(attempt.pgid)
        ):
            # adopted after a restart: the exit_code file, not the process group id (which may
            # have been reused), says that it ended
            return True
        if not reap:
            return False
        # The shell is gone; make sure nothing it started lingers, however it forked.
        self._kill(attempt)
        if attempt.group is not None:
            attempt.group.remove()
        return False

    def _kill(self, attempt: Attempt) -> None:
        if _group_alive(attempt.pgid):
            _signal_group(attempt.pgid, signal.SIGKILL)
        if attempt.group is not None and not attempt.group.kill():
            log.warning("processes of %s survive SIGKILL (uninterruptible sleep?)", attempt.id)
        if attempt.container and self.podman:
            subprocess.run(
                [self.podman, "rm", "--force", "--time=0", attempt.container],
                capture_output=True,
                timeout=60,
                check=False,
            )

    def _ended(self, attempt: Attempt) -> dict[str, Any]:
        exit_file = attempt.directory / "exit_code"
        code = (
            int(exit_file.read_text().strip())
            if exit_file.exists() and exit_file.read_text().strip()
            else None
        )
        if attempt.stop_reason:
            state = attempt.stop_reason
        elif code == 0:
            state = "succeeded"
        else:
            state = "failed"
        reason = {"timeout": "time limit reached", "cancelled": "stopped by the agent"}.get(state, "")
        if state == "failed" and code is None:
            reason = "killed"
        if state == "preempted":
            reason = _preempted(attempt, self.grace, code)
        if state == "fenced":
            state, reason = "failed", FENCED
        del self.attempts[attempt.id]
        self.ended[attempt.id] = state
        return {"attempt": attempt.id, "state": state, "exit_code": code, "reason": reason}

    def mark_reported(self, attempt_id: str, state: str) -> bool:
        """Called once the end of an attempt is safely in the spool (or at the server); False
        when the mark cannot be written (the end stays known in memory)."""
        try:
            (self.root / attempt_id / "reported").write_text(state)
            return True
        except OSError as exc:
            log.warning("cannot mark %s reported: %s", attempt_id, exc)
            return False

    def mark_delivered(self, attempt_id: str) -> None:
        """The server has the end of the attempt: its directories may go after ``retention``."""
        with contextlib.suppress(OSError):
            (self.root / attempt_id / "delivered").write_text("")

    def _shipped_of(self, directory: Path) -> int:
        if directory.name not in self.shipped:
            try:
                self.shipped[directory.name] = int((directory / "shipped").read_text())
            except (OSError, ValueError):
                self.shipped[directory.name] = 0
        return self.shipped[directory.name]

    def new_output(self, budget: int = 4 << 20) -> list[dict[str, Any]]:
        """Output not shipped yet (running attempts or ended ones), ``LOG_CHUNK`` bytes a chunk,
        about ``budget`` bytes in all. A backlog past ``LOG_SKIP_PAST`` is skipped down to its
        last ``LOG_KEEP`` bytes, all the server keeps: it gets one small chunk every
        ``LOG_HOP`` bytes on the way (within its gap limit; it marks each gap), then the tail."""
        chunks: list[dict[str, Any]] = []
        for directory in self.root.iterdir():
            if budget <= 0:
                break
            try:
                size = (directory / "output.log").stat().st_size
            except OSError:
                continue
            shipped = self._shipped_of(directory)
            if size <= shipped:
                continue
            with open(directory / "output.log", "rb") as handle:
                if size - shipped > LOG_SKIP_PAST:
                    shipped = _skip(handle, shipped, size, directory, chunks)
                while shipped < size and budget > 0:
                    handle.seek(shipped)
                    data = _whole_characters(handle.read(min(LOG_CHUNK, size - shipped)))
                    if not data:
                        break
                    chunks.append(_chunk(directory, shipped, data))
                    shipped += len(data)
                    budget -= len(data)
        return chunks

    def mark_shipped(self, chunks: list[dict[str, Any]]) -> None:
        ends = {chunk["attempt"]: (Path(chunk["_dir"]), chunk["_end"]) for chunk in chunks}
        for attempt_id, (directory, end) in ends.items():
            self.shipped[attempt_id] = max(end, self.shipped.get(attempt_id, 0))
            with contextlib.suppress(OSError):  # memory knows; the file is for a restart
                (directory / "shipped").write_text(str(self.shipped[attempt_id]))

    def clean(self, retention: float) -> int:
        """Remove the directories of attempts whose end the server has had for ``retention``
        seconds and whose output is all shipped; their ids stay in ``WORK/ended``. Returns how
        many went."""
        now, removed = time.time(), 0
        for directory in list(self.root.iterdir()):
            attempt_id = directory.name
            try:
                delivered = (directory / "delivered").stat().st_mtime
            except FileNotFoundError:
                continue
            if attempt_id in self.attempts or now - delivered < retention:
                continue
            try:
                size = (directory / "output.log").stat().st_size
            except FileNotFoundError:
                size = 0
            if size > self._shipped_of(directory):
                continue
            with open(self.ended_record, "a") as record:  # first the record, then the removal
                record.write(f"{attempt_id} {int(now)}\n")
            self.cleaned.add(attempt_id)
            shutil.rmtree(self.jobs / attempt_id, ignore_errors=True)
            shutil.rmtree(directory, ignore_errors=True)
            self.shipped.pop(attempt_id, None)
            self.ended.pop(attempt_id, None)
            removed += 1
        return removed


def _preempted(attempt: Attempt, default_grace: float, code: int | None) -> str:
    """How a preempted attempt ended, in words: "SIGTERM, then exit code 0", "SIGUSR1, then
    killed after its 2 s grace"."""
    try:
        name = signal.Signals(attempt.stop_signal).name
    except ValueError:
        name = f"signal {attempt.stop_signal}"
    if attempt.killed:
        grace = default_grace if attempt.stop_grace is None else attempt.stop_grace
        return f"{name}, then killed after its {grace:g} s grace"
    return f"{name}, then exit code {code}" if code is not None else f"{name}, then ended"


def _skip(handle: Any, shipped: int, size: int, directory: Path, chunks: list[dict[str, Any]]) -> int:
    """Skip a backlog down to its last ``LOG_KEEP`` bytes (from the start of a line where one
    is near): a chunk of a few bytes every ``LOG_HOP`` tells the server how far the stream
    went. Returns where shipping goes on."""
    target = size - LOG_KEEP
    handle.seek(target)
    newline = handle.read(64 * 1024).find(b"\n")
    if newline >= 0:
        target += newline + 1
    while target - shipped > LOG_HOP:
        shipped += LOG_HOP
        handle.seek(shipped)
        line = handle.read(4096)
        data = _whole_characters(line[: line.find(b"\n") + 1] or line[:1])
        chunks.append(_chunk(directory, shipped, data))
        shipped += len(data)
    return target


def _whole_characters(data: bytes) -> bytes:
    """Do not cut a UTF-8 character in two: end on a whole one (unless there is none)."""
    if len(data) < LOG_CHUNK:
        return data
    keep = len(data)
    while keep > len(data) - 4 and keep > 0 and (data[keep - 1] & 0xC0) == 0x80:
        keep -= 1
    if keep > 0 and data[keep - 1] >= 0xC0:
        keep -= 1
    return data[:keep] or data


def _chunk(directory: Path, offset: int, data: bytes) -> dict[str, Any]:
    """A chunk as the server takes it. Bytes that are not UTF-8 become "?", one for one, so
    the text is as long in bytes as what it stands for and the offsets stay true."""
    return {
        "attempt": directory.name,
        "offset": offset,
        "end": offset + len(data),
        "data": data.decode("utf-8", "orrery-bytes"),
        "_end": offset + len(data),
        "_dir": str(directory),
    }


codecs.register_error("orrery-bytes", lambda error: ("?" * (error.end - error.start), error.end))


def share_environment(entry: dict[str, Any]) -> dict[str, str]:
    """What a desired entry smaller than whole GPUs adds to the job's environment (nothing for
    whole GPUs); ``Refused`` for a share that makes no sense.

    * MIG instances (``mig_uuids``): ``CUDA_VISIBLE_DEVICES`` names them by UUID, and
      ``ORRERY_MIG_PROFILE`` says which profile they are.
    * A fraction of a shared GPU (``gpu_memory_mb`` > 0, ``gpu_share``): the GPU's index, and the
      limits an MPS client keeps to — ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the share in percent,
      rounded up, at least 1) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``<index>=<MiB>M``) — and
      ``ORRERY_GPU_MEMORY_MB``. They bind only where the node runs an MPS control daemon
      (docs/agent.md, *Fractions of a GPU*)."""
    uuids = entry.get("mig_uuids") or []
    memory = entry.get("gpu_memory_mb") or 0
    gpus = list(entry.get("gpus") or [])
    if uuids:
        if not isinstance(uuids, list) or not all(
            isinstance(u, str) and mig.MIG_UUID.fullmatch(u) for u in uuids
        ):
            raise Refused("the MIG instances it was given are not MIG UUIDs")
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(uuids),
            "ORRERY_MIG_PROFILE": str(entry.get("mig_profile") or ""),
        }
    if not memory:
        return {}
    share = entry.get("gpu_share") or 0
    if (
        isinstance(memory, bool)
        or not isinstance(memory, int)
        or memory < 0
        or isinstance(share, bool)
        or not isinstance(share, int | float)
        or not 0 <= share <= 1
        or len(gpus) != 1
    ):
        raise Refused("a fraction of a GPU needs one GPU, its memory in MiB and a share between 0 and 1")
    return {
        "CUDA_VISIBLE_DEVICES": str(gpus[0]),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(math.ceil(round(share * 100, 6)), 1)),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{gpus[0]}={memory}M",
        "ORRERY_GPU_MEMORY_MB": str(memory),
    }


def _exports(env: dict[str, str]) -> str:
    """The job's environment as a file its own shell reads, each value quoted."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _members(leader: int, exit_path: str, attempt_id: str) -> list[int]:
    """The processes of the process group ``leader`` that belong to the attempt: its wrapper
    shell (whose command line names the attempt's ``exit_code``) or the job's processes (whose
    environment names the attempt). Anything else in a reused group id is left alone."""
    marker = f"ORRERY_ATTEMPT_ID={attempt_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != leader:
                continue
            ours = exit_path.encode() in (entry / "cmdline").read_bytes() or marker in (
                entry / "environ"
            ).read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ours:
            found.append(int(entry.name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader of ours still counts as a member; reap it if it is our child.
    try:
        pid, _ = os.waitpid(pgid, os.WNOHANG)
        if pid == pgid:
            return _group_alive(pgid)
    except ChildProcessError:
        pass
    return True
