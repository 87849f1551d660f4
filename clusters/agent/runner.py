"""Running attempts as real process groups, and reporting what became of them.

Each attempt runs in its own session (its own process group), under ``/bin/sh``, with its
output in ``WORK/attempts/<id>/output.log``. The shell writes the command's exit status to
``exit_code`` when it ends, and the group's id is kept in ``pgid``, so an agent that restarts
finds its attempts again: it can still stop them, and learn how they ended.

Stopping is SIGTERM to the whole group, then SIGKILL after ``grace`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Attempt:
    id: str
    pgid: int
    directory: Path
    started: float
    time_limit: float | None
    popen: subprocess.Popen | None = None
    stopping_since: float | None = None
    stop_reason: str = ""  # "cancelled" or "timeout" once we stop it
    shipped: int = 0  # bytes of output already sent
    reported: set[str] = field(default_factory=set)


class Runner:
    def __init__(self, work_dir: Path, grace: float = 10.0) -> None:
        self.root = work_dir / "attempts"
        self.root.mkdir(parents=True, exist_ok=True)
        self.grace = grace
        self.attempts: dict[str, Attempt] = {}
        self._adopt()

    def _adopt(self) -> None:
        """Attempts a previous run of the agent started, still running or not."""
        for directory in self.root.iterdir():
            meta = directory / "meta.json"
            if not meta.exists() or (directory / "reported").exists():
                continue
            info = json.loads(meta.read_text())
            self.attempts[directory.name] = Attempt(
                directory.name, info["pgid"], directory, info["started"], info.get("time_limit")
            )

    # --- starting ---------------------------------------------------------------------------
    def start(self, entry: dict[str, Any], env_base: dict[str, str]) -> Attempt:
        directory = self.root / entry["attempt"]
        directory.mkdir(parents=True, exist_ok=True)
        gpus = ",".join(str(i) for i in entry.get("gpus") or [])
        env = {
            **env_base,
            **{str(k): str(v) for k, v in (entry.get("env") or {}).items()},
            "CUDA_VISIBLE_DEVICES": gpus,
            "ORRERY_JOB_ID": str(entry["job"]),
            "ORRERY_ATTEMPT": str(entry.get("number", 1)),
            "ORRERY_ATTEMPT_ID": entry["attempt"],
            "ORRERY_NNODES": str(entry.get("nnodes", 1)),
            "ORRERY_NODE_RANK": str(entry.get("node_rank", 0)),
            "ORRERY_HEAD_ADDR": str(entry.get("head_addr", "")),
            "ORRERY_GPUS_PER_NODE": str(len(entry.get("gpus") or [])),
        }
        exit_file = directory / "exit_code"
        # The subshell runs the job; the outer shell records how it ended, even if the agent
        # that started it is gone by then.
        wrapper = f'( {entry["script"]} ); echo $? > "{exit_file}"'
        with open(directory / "output.log", "ab") as output:
            popen = subprocess.Popen(
                ["/bin/sh", "-c", wrapper],
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=directory,
                start_new_session=True,
            )
        limit = entry.get("time_limit_s")
        attempt = Attempt(
            entry["attempt"], popen.pid, directory, time.time(), float(limit) if limit else None, popen
        )
        (directory / "meta.json").write_text(
            json.dumps({"pgid": popen.pid, "started": attempt.started, "time_limit": attempt.time_limit})
        )
        self.attempts[attempt.id] = attempt
        return attempt

    # --- stopping -----------------------------------------------------------------------------
    def stop(self, attempt_id: str, reason: str = "cancelled") -> None:
        attempt = self.attempts.get(attempt_id)
        if attempt is None or attempt.stopping_since is not None:
            return
        attempt.stopping_since, attempt.stop_reason = time.time(), reason
        _signal_group(attempt.pgid, signal.SIGTERM)

    def running_ids(self) -> list[str]:
        return list(self.attempts)

    # --- watching -------------------------------------------------------------------------------
    def poll(self) -> list[dict[str, Any]]:
        """Enforce time limits and grace periods; return reports of attempts that ended."""
        now = time.time()
        reports = []
        for attempt in list(self.attempts.values()):
            if (
                attempt.time_limit
                and attempt.stopping_since is None
                and now - attempt.started > attempt.time_limit
            ):
                self.stop(attempt.id, "timeout")
            if attempt.stopping_since is not None and now - attempt.stopping_since > self.grace:
                _signal_group(attempt.pgid, signal.SIGKILL)
            if self._alive(attempt):
                continue
            reports.append(self._ended(attempt))
        return reports

    def _alive(self, attempt: Attempt) -> bool:
        if attempt.popen is not None:
            if attempt.popen.poll() is None:
                return True
        elif not (attempt.directory / "exit_code").exists() and _group_alive(attempt.pgid):
            # adopted after a restart: the exit_code file, not the process group id (which may
            # have been reused), says that it ended
            return True
        # The shell is gone; make sure nothing of the group lingers.
        if _group_alive(attempt.pgid):
            _signal_group(attempt.pgid, signal.SIGKILL)
        return False

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
        del self.attempts[attempt.id]
        return {"attempt": attempt.id, "state": state, "exit_code": code, "reason": reason}

    def mark_reported(self, attempt_id: str, state: str) -> None:
        """Called once the end of an attempt is safely in the spool."""
        (self.root / attempt_id / "reported").write_text(state)

    def new_output(self, limit: int = 256 * 1024) -> list[dict[str, Any]]:
        """Output not shipped yet, per attempt (running or just ended)."""
        chunks = []
        for directory in self.root.iterdir():
            log = directory / "output.log"
            shipped_file = directory / "shipped"
            shipped = int(shipped_file.read_text()) if shipped_file.exists() else 0
            try:
                size = log.stat().st_size
            except OSError:
                continue
            if size <= shipped:
                continue
            with open(log, "rb") as handle:
                handle.seek(shipped)
                data = handle.read(limit)
            if len(data) == limit:  # do not cut a UTF-8 character in two: end on a whole one
                keep = len(data)
                while keep > len(data) - 4 and keep > 0 and (data[keep - 1] & 0xC0) == 0x80:
                    keep -= 1
                if keep > 0 and data[keep - 1] >= 0xC0:
                    keep -= 1
                data = data[:keep] or data
            chunks.append(
                {
                    "attempt": directory.name,
                    "offset": shipped,
                    "end": shipped + len(data),
                    "data": data.decode("utf-8", "replace"),
                    "_end": shipped + len(data),
                    "_dir": str(directory),
                }
            )
        return chunks

    @staticmethod
    def mark_shipped(chunks: list[dict[str, Any]]) -> None:
        for chunk in chunks:
            (Path(chunk["_dir"]) / "shipped").write_text(str(chunk["_end"]))


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


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
