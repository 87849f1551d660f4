"""A live control plane with real ``orrery-agent`` processes, for the agent half of the fault
suite (``tests/faults/test_agents.py``).

``Lab`` runs Daphne (the API and the agent protocol) and a Celery worker with beat (heartbeat
flush, node lifecycle, scheduling cycles, dispatch, the failover sweep) on the test database,
with timers shortened through the environment, and agents as root with fake GPUs on a native
cluster whose work runs as the shared account. ``Link`` is a TCP proxy the test can cut, so an
agent that is alive but cannot reach the server is a real fault, not a simulated one. Nothing
here reads an agent's internals: what a scenario observes is the database, the agents' exit
status and the processes running on this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from clusters.choices import ClusterKind, ClusterState, Identity, NodeState
from clusters.models import Node
from clusters.services.credentials import create_join_token
from portal.services.tokens import issue_token
from scheduling.models import Job, JobAttempt
from tests.factories import ensure_catalog, make_cluster, make_project, make_queue, make_user
from tests.processes import Service, celery_worker_argv, control_plane_env, free_port, spawn_agent, wait

ENDED = ("SUCCEEDED", "FAILED", "TIMEOUT", "CANCELLED", "PREEMPTED")
# Scaled down from the production defaults (heartbeat 10 s, grace 40 s, recovery 30 s); each
# scenario sets the failover time it needs.
TIMERS = {
    "ORRERY_HEARTBEAT_INTERVAL": "1",
    "ORRERY_NODE_GRACE": "3",
    "ORRERY_NODE_RECOVERY": "1",
    "ORRERY_NODE_FAILOVER_AFTER": "30",
    "ORRERY_FAILOVER_PER_MINUTE": "100",
}
_SHELL = re.compile(rb"/attempts/([0-9a-f-]{36})/")


class Link:
    """A TCP proxy in front of the server. ``cut()`` closes every open connection and refuses
    new ones (each is accepted and closed at once, as a broken route or a dead server looks to
    the agent) until ``restore()``. ``cuts`` holds the (start, end) wall-clock times of each
    cut, ``end`` None while it lasts."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cuts: list[tuple[float, float | None]] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def is_cut(self) -> bool:
        return bool(self.cuts) and self.cuts[-1][1] is None

    def cut(self) -> None:
        with self._lock:
            self.cuts.append((time.time(), None))
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        with self._lock:
            if self.is_cut:
                self.cuts[-1] = (self.cuts[-1][0], time.time())

    def close(self) -> None:
        self.cut()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                if self.is_cut:
                    raise OSError("cut")
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        with self._lock:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
                self._open.discard(sock)


def attempt_shells() -> list[tuple[str, int]]:
    """``(attempt id, pid)`` of every agent's attempt shell running on this machine, one entry
    per process: an attempt started twice shows twice (``invariants.attempts_running_here``
    keeps one per attempt)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        match = _SHELL.search(argv)
        if match and b"exit_code" in argv:
            found.append((match.group(1).decode(), int(proc.name)))
    return found


def attempts_of(job_id: int) -> set[str]:
    return {str(pk) for pk in JobAttempt.objects.filter(job_id=job_id).values_list("pk", flat=True)}


def job_shells(job_id: int) -> list[tuple[str, int]]:
    """The attempt shells running here for any attempt of one job."""
    mine = attempts_of(job_id)
    return [(a, pid) for a, pid in attempt_shells() if a in mine]


def node_state(name: str) -> str:
    return Node.objects.filter(name=name).values_list("state", flat=True).first() or ""


def job_state(job_id: int) -> str:
    return Job.objects.filter(pk=job_id).values_list("state", flat=True).get()


class Lab:
    """One live control plane, its cluster ``lab`` and its agents; ``close()`` stops every
    process it started (agents, the attempts they left, the services)."""

    def __init__(self, tmp: Path, **timers: str) -> None:
        self.tmp = tmp
        self.env = control_plane_env(tmp, **(TIMERS | timers))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        daphne = [
            sys.executable,
            "-m",
            "daphne",
            "-b",
            "127.0.0.1",
            "-p",
            str(self.port),
            "portal.asgi:application",
        ]
        self.services = [
            Service(daphne, self.env, tmp / "daphne.log", self.port),
            Service(celery_worker_argv(self.env, tmp), self.env, tmp / "celery.log"),
        ]
        self.agents: dict[str, subprocess.Popen] = {}
        self.links: list[Link] = []
        self.accepted: list[int] = []

    def start(self) -> Lab:
        for service in self.services:
            service.start()
        ensure_catalog()
        alice = make_user("alice")
        make_queue(make_project("vision", members=(alice,)))
        cluster = make_cluster(
            "lab", kind=ClusterKind.NATIVE, state=ClusterState.READY, identity=Identity.SHARED
        )
        _, self.join = create_join_token(cluster, max_uses=None)
        _, self.token = issue_token(alice)
        return self

    def add(self, service: Service) -> Service:
        """Another process of the control plane, stopped with the rest."""
        self.services.append(service.start())
        return service

    def link(self) -> Link:
        self.links.append(Link(self.port))
        return self.links[-1]

    # --- agents -------------------------------------------------------------------------------
    def start_agent(self, name: str, gpus: str = "h100:1", via: Link | None = None) -> subprocess.Popen:
        """Start (or restart, on the same work directory) the agent of node ``name``."""
        server = via.url if via else self.url
        self.agents[name] = spawn_agent(
            server, self.join, self.tmp / name, name, gpus, "--address", f"{name}.lab"
        )
        return self.agents[name]

    def kill_agent(self, name: str) -> None:
        self.agents[name].send_signal(signal.SIGKILL)
        self.agents[name].wait()

    def wait_ready(self, *names: str, timeout: float = 30) -> None:
        wait(lambda: all(node_state(n) == NodeState.READY for n in names), f"{names} ready", timeout)

    def agent_log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    # --- jobs ---------------------------------------------------------------------------------
    def submit(self, name: str, run: str, gpus: str = "h100:1", **spec: Any) -> int:
        body = {
            "apiVersion": "orrery/v1",
            "kind": "Job",
            "metadata": {"name": name, "project": "vision"},
            "spec": {"resources": {"gpus": gpus}, "run": run, **spec},
        }
        request = urllib.request.Request(
            f"{self.url}/api/v1/jobs",
            method="POST",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            job = json.loads(response.read())["id"]
        self.accepted.append(job)
        return job

    def wait_job(self, job_id: int, *states: str, timeout: float = 30) -> str:
        return wait(lambda: (s := job_state(job_id)) in states and s, f"job {job_id} {states}", timeout)

    # --- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        for link in self.links:
            link.close()
        self.kill_attempts()
        running = [s.process for s in self.services if s.process is not None and s.process.poll() is None]
        for process in running:  # all at once: each may take seconds to finish its work
            process.terminate()
        for process in running:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def kill_attempts(self) -> None:
        """Every process of the attempts this lab's agents started, tracked or not: their
        shells name the work directory, and the jobs' own processes run in it."""
        ours = str(self.tmp)
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                shell = _SHELL.search(argv := (proc / "cmdline").read_bytes()) and ours.encode() in argv
                if shell or os.readlink(proc / "cwd").startswith(ours + "/"):
                    group = os.getpgid(int(proc.name))
                    if group != os.getpgrp():  # never the test's own group (agents are in it)
                        os.killpg(group, signal.SIGKILL)
