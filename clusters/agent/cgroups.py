"""One control group per attempt: CPU and memory limits, and a kill that no process escapes.

A process group is not a boundary: a job that double-forks or calls ``setsid`` leaves it and
would outlive a cancel. A cgroup is: every descendant stays in it whatever it does, so killing
what the cgroup holds kills all of the attempt (``kill``).

Version 2 (the unified hierarchy mounted on ``/sys/fs/cgroup``) is used where the kernel offers
it; otherwise version 1 controllers (``memory``, ``cpu``, ``pids`` and ``freezer`` — freezing
first means nothing can fork while it is being killed). Groups live under the agent's own
cgroup, ``orrery/<node>/<attempt id>``, so a systemd unit with ``Delegate=yes`` contains them;
the node's name keeps apart the ranks of one gang attempt when several agents share a machine
(as in development).
Creating them needs root; without it (or without cgroupfs) ``Cgroups.detect`` says why and the
agent falls back to process groups.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "cpu", "pids", "freezer")
CPU_PERIOD_US = 100_000


class Cgroups:
    """Where attempt groups are made, on one cgroup version."""

    def __init__(self, version: int, bases: dict[str, Path], max_pids: int) -> None:
        self.version = version
        self.bases = bases  # controller (v1) or "unified" (v2) → the directory holding attempt groups
        self.max_pids = max_pids

    @classmethod
    def detect(cls, node: str, max_pids: int = 8192) -> tuple[Cgroups | None, str]:
        """The cgroups the agent of ``node`` can use, or None and why not."""
        if os.geteuid() != 0:
            return None, "the agent does not run as root"
        own = _own_cgroups()
        scope = re.sub(r"[^A-Za-z0-9_.-]", "_", node).lstrip(".") or "node"
        try:
            if (ROOT / "cgroup.controllers").exists():
                return cls._v2(own.get("", "/"), scope, max_pids), ""
            bases = {}
            for controller in V1_CONTROLLERS:
                if (ROOT / controller / "cgroup.procs").exists():
                    base = ROOT / controller / own.get(controller, "/").lstrip("/") / "orrery" / scope
                    base.mkdir(parents=True, exist_ok=True)
                    bases[controller] = base
            if "memory" not in bases or "cpu" not in bases:
                return None, "no writable memory and cpu cgroup controllers"
            return cls(1, bases, max_pids), ""
        except OSError as exc:
            return None, f"cgroups are not writable: {exc}"

    @classmethod
    def _v2(cls, own: str, scope: str, max_pids: int) -> Cgroups:
        # "No internal processes": the agent moves into a leaf of its own cgroup, so the
        # controllers can be handed down to the attempts' groups beside it.
        home = ROOT / own.lstrip("/")
        if home != ROOT:
            leaf = home / "agent"
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
        available = (home / "cgroup.controllers").read_text().split()
        wanted = " ".join(f"+{c}" for c in ("cpu", "memory", "pids") if c in available)
        (home / "cgroup.subtree_control").write_text(wanted)
        base = home / "orrery" / scope
        for level in (base.parent, base):
            level.mkdir(exist_ok=True)
            (level / "cgroup.subtree_control").write_text(wanted)
        return cls(2, {"unified": base}, max_pids)

    @property
    def name(self) -> str:
        return f"cgroup-v{self.version}"

    def group(self, attempt_id: str) -> Group:
        return Group(self, attempt_id)


class Group:
    """The cgroup(s) of one attempt; the same id names the same group after an agent restart."""

    def __init__(self, cgroups: Cgroups, attempt_id: str) -> None:
        self.version = cgroups.version
        self.max_pids = cgroups.max_pids
        self.paths = {c: base / attempt_id for c, base in cgroups.bases.items()}

    @property
    def relative(self) -> str:
        """The group's path inside its hierarchy (what ``podman --cgroup-parent`` takes; on v1
        podman applies it to every controller, and the freezer's is the one kills go by)."""
        if self.version == 2:
            return "/" + str(self.paths["unified"].relative_to(ROOT))
        controller = "freezer" if "freezer" in self.paths else next(iter(self.paths))
        return "/" + str(self.paths[controller].relative_to(ROOT / controller))

    def create(self, cpu_millicores: int = 0, memory_bytes: int = 0) -> None:
        for path in self.paths.values():
            path.mkdir(exist_ok=True)
        quota = cpu_millicores * CPU_PERIOD_US // 1000 if cpu_millicores else 0
        if self.version == 2:
            path = self.paths["unified"]
            _write(path / "memory.max", str(memory_bytes) if memory_bytes else "max")
            _write(path / "memory.swap.max", "0" if memory_bytes else "max")
            _write(path / "cpu.max", f"{quota or 'max'} {CPU_PERIOD_US}")
            _write(path / "pids.max", str(self.max_pids))
            return
        if memory_bytes:
            _write(self.paths["memory"] / "memory.limit_in_bytes", str(memory_bytes))
        if quota:
            _write(self.paths["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(self.paths["cpu"] / "cpu.cfs_quota_us", str(quota))
        if "pids" in self.paths:
            _write(self.paths["pids"] / "pids.max", str(self.max_pids))

    def join(self) -> None:
        """Move the calling process in (run in the child before it execs: everything it starts
        is then born inside)."""
        pid = str(os.getpid())
        for path in self.paths.values():
            (path / "cgroup.procs").write_text(pid)

    def pids(self) -> set[int]:
        """Every process in the group and in the groups below it (a container's own group)."""
        found: set[int] = set()
        for path in self.paths.values():
            for directory, _, _ in os.walk(path):
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in (Path(directory) / "cgroup.procs").read_text().split())
        return found

    def signal(self, sig: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self, timeout: float = 5.0) -> bool:
        """SIGKILL everything in the group until it is empty; True once it is."""
        deadline = time.monotonic() + timeout
        while True:
            if self.version == 2 and (self.paths["unified"] / "cgroup.kill").exists():
                _write(self.paths["unified"] / "cgroup.kill", "1")
            else:
                self._freeze("FROZEN")
                self.signal(signal.SIGKILL)
                self._freeze("THAWED")
            if not self.pids():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def remove(self) -> None:
        """Delete the (empty) group, children first."""
        for path in self.paths.values():
            if not path.exists():
                continue
            for directory, _, _ in sorted(os.walk(path), key=lambda w: -len(Path(w[0]).parts)):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)

    def exists(self) -> bool:
        return any(path.exists() for path in self.paths.values())

    def _freeze(self, state: str) -> None:
        if "freezer" in self.paths:
            _write(self.paths["freezer"] / "freezer.state", state)


def _write(path: Path, value: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.write_text(value)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup in each hierarchy: controller (v1) or "" (v2) → path."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller.removeprefix("name=")] = path
    return own
