"""The Orrery node agent: register once, then heartbeat, run what the server wants, stop what
it does not, and report — surviving a server outage without losing a report.

Everything it must remember lives in its work directory: the node credential (0600), the
attempts it runs (``attempts/``, see ``runner``), the reports not yet delivered (``spool.jsonl``,
replayed in order when the server answers again) and its lease (``lease.json``). Everything it
writes is its own user's alone (umask 077); only ``jobs/`` is shared, one directory per attempt,
each owned by the account the attempt runs as. What it cannot write it keeps in memory and
writes again later: a full or read-only disk neither stops the agent nor loses a report.

**Self-fencing.** The server fails a silent node over after ``failover_after_s`` (it says so in
every answer) and may then run the node's attempts elsewhere. The agent holds a *lease*,
renewed by each heartbeat the server answers with 200 and counted from when that heartbeat was
sent; it ends ``grace`` and two heartbeat intervals before the failover time (or earlier, with
``lease``). An agent whose lease ends stops all its attempts (SIGTERM, grace, SIGKILL) and
reports them failed ("fenced: …"), so no attempt ever runs on two nodes at once. On return the
server's answer decides: what it no longer wants is stopped, the rest is reported.

**Flow control.** A 429 or 503 answer with ``Retry-After`` is honoured (plus up to half again,
at random, so that a fleet does not come back in step); it does not renew the lease.

**What the node is.** The agent describes its machine (CPU, memory, GPUs and their MIG
instances) when it registers, again after a start with a credential it already holds, and after
it changed a GPU's MIG layout (``mig_layouts`` in the server's answer: applied only to a GPU no
attempt holds or is about to).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from clusters.agent import mig
from clusters.agent.cgroups import Cgroups
from clusters.agent.runner import ENDED_STATES, Refused, Runner
from clusters.agent.telemetry import (
    FAKE_POWER_W,
    CpuMeter,
    Gpus,
    boot_id,
    cpu_count_millicores,
    memory_bytes,
    node_power_w,
)

log = logging.getLogger("orrery.agent")
VERSION = "0.1.0"
MAX_REPORTS_PER_POST = 1000  # what the server takes at once
MAX_POST_BYTES = 4 << 20  # output per POST, encoded: the server refuses bodies over 8 MiB
MAX_RETRY_AFTER_S = 300.0
CLEAN_EVERY_S = 60.0
LAYOUT_RETRY_S = 300.0  # a MIG layout the driver refused is not tried again before this
REDESCRIBE_S = 60.0  # a node told of a layout it has already describes itself again after this


class ServerUnavailable(Exception):
    pass


class Agent:
    def __init__(
        self,
        server: str,
        work_dir: Path,
        *,
        join_token: str | None = None,
        name: str | None = None,
        fake_gpus: str | None = None,
        fake_mig: dict[int, list[str]] | None = None,
        fake_power: tuple[float, float] = FAKE_POWER_W,
        labels: dict[str, str] | None = None,
        address: str | None = None,
        grace: float = 10.0,
        lease: float | None = None,
        retention: float = 3600.0,
        shared_user: str = "nobody",
        podman_args: tuple[str, ...] = (),
        use_cgroups: bool = True,
    ) -> None:
        os.umask(0o077)
        self.server = server.rstrip("/")
        self.work = work_dir
        self.work.mkdir(parents=True, exist_ok=True)
        self.join_token = join_token
        self.name = name or socket.gethostname()
        self.gpus = Gpus(fake_gpus, self.name, fake_mig=fake_mig, fake_power=fake_power)
        self.labels = dict(labels or {})
        self.labels.setdefault("orrery.io/address", address or _my_address())
        cgroups, why = Cgroups.detect(self.name) if use_cgroups else (None, "turned off")
        if cgroups is None:
            log.warning("no cgroups (%s): attempts are limited to their process group", why)
        self.runner = Runner(
            self.work,
            grace=grace,
            shared_user=shared_user,
            podman_args=podman_args,
            cgroups=cgroups,
            real_gpus=not fake_gpus,
        )
        # What this node offers, for placement and for operators to see.
        self.labels["orrery.io/isolation"] = cgroups.name if cgroups else "process-group"
        if self.runner.podman:
            self.labels["orrery.io/containers"] = "podman"
        self.cpu = CpuMeter()
        self.boot = boot_id()
        self.seq = int(time.time() * 1000)  # grows across agent restarts of one boot
        self.interval = 10.0
        self.grace = grace
        self.retention = retention
        self.credential = self._load_credential()
        # A node known already says what it is now: its GPUs or their layouts may have changed
        # while the agent was away.
        self.describe_due = self.credential is not None
        self.described_at = time.monotonic()
        self.layout_failed: dict[int, tuple[list[str], float]] = {}  # GPU → layout refused, when
        # The lease: see the module's docstring. ``last_ok`` is monotonic; the lease file
        # carries it across restarts as wall-clock time.
        self.lease_option = lease
        self.failover_after: float | None = None
        self.lease: float | None = lease
        self.last_ok = time.monotonic()
        self.fenced = False
        self.hold_until = 0.0  # no request before this (monotonic): the server said Retry-After
        self.errors = 0  # steps that failed in part, since start
        self.queue: list[dict[str, Any]] = []  # reports not delivered yet, oldest first
        self.unmarked: dict[str, str] = {}  # ended attempts not yet marked reported on disk
        self.spool_saved = True
        self.cleaned_at = 0.0
        if lease is not None and lease <= 0:
            raise SystemExit(f"--lease {lease:g}: a lease is a number of seconds above 0")
        self._load_lease()
        self._load_spool()

    # --- registration -----------------------------------------------------------------------
    def _credential_file(self) -> Path:
        return self.work / "credential.json"

    def _load_credential(self) -> str | None:
        path = self._credential_file()
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return (
            data["credential"]
            if data.get("server") == self.server and data.get("node") == self.name
            else None
        )

    def register(self) -> None:
        if not self.join_token:
            raise SystemExit(
                "no node credential in the work directory and no join token to get one "
                "(--join-token-file or ORRERY_JOIN_TOKEN)"
            )
        answer = self._post("register", self._description(), self.join_token)
        self.credential = answer["credential"]
        self.describe_due, self.described_at = False, time.monotonic()
        self.interval = float(answer.get("interval") or self.interval)
        self._set_failover(answer.get("failover_after_s"), fatal=False)
        path = self._credential_file()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"server": self.server, "node": self.name, "credential": self.credential}, handle)
        log.info("registered as %s in cluster %s", answer["node"], answer["cluster"])

    def _description(self) -> dict[str, Any]:
        total, _ = memory_bytes()
        return {
            "name": self.name,
            "cpu_millicores": cpu_count_millicores(),
            "memory_bytes": total,
            "agent_version": VERSION,
            "boot_id": self.boot,
            "labels": self.labels,
            "gpus": self.gpus.describe(),
        }

    def _describe(self) -> None:
        """Tell the server what this node is now, with its credential (see the module); tried
        again next round when the server does not answer."""
        if self.credential is None or not self._ready():
            return
        try:
            self._post("describe", self._description(), self.credential)
        except ServerUnavailable as exc:
            log.warning("cannot describe the node yet: %s", exc)
            return
        self.describe_due, self.described_at = False, time.monotonic()

    # --- the lease -----------------------------------------------------------------------------
    def _load_lease(self) -> None:
        try:
            data = json.loads((self.work / "lease.json").read_text())
        except (OSError, ValueError):
            return
        if data.get("server") != self.server:
            return
        self.interval = float(data.get("interval") or self.interval)
        self.last_ok = time.monotonic() - max(time.time() - float(data.get("ok_at") or 0), 0.0)
        self._set_failover(data.get("failover_after_s"), fatal=True)

    def _set_failover(self, value: Any, *, fatal: bool) -> None:
        """Derive the lease from the server's failover time; a ``lease`` option that would
        outlive it is refused: at start-up the agent exits, later it logs an error and uses the
        longest safe lease instead."""
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            return
        self.failover_after = float(value)
        safe = self.failover_after - self.grace - 2 * self.interval
        lease = safe if self.lease_option is None else self.lease_option
        if lease > safe:
            message = (
                f"--lease {lease:g}s would outlive the node failover time: the server fails a "
                f"silent node over after {self.failover_after:g}s, and a lease must end the stop "
                f"grace ({self.grace:g}s) and two heartbeat intervals ({self.interval:g}s) before "
                f"that: {safe:g}s at most"
            )
            if fatal:
                raise SystemExit(message)
            if self.lease != safe:
                log.error("%s; the lease is %gs", message, safe)
            lease = safe
        if lease <= 0 and self.lease != lease:
            log.error(
                "no lease fits in the failover time (%gs) with a %gs grace and a %gs interval: "
                "attempts are stopped as soon as a heartbeat fails",
                self.failover_after,
                self.grace,
                self.interval,
            )
        self.lease = max(lease, 0.0)

    def _renew(self, sent: float, answer: dict[str, Any]) -> None:
        """A heartbeat answered with 200: the lease runs again from when it was sent."""
        self.last_ok = sent
        self.interval = float(answer.get("interval") or self.interval)
        self._set_failover(answer.get("failover_after_s"), fatal=False)
        if self.fenced:
            log.warning("the control plane answers again: reconciling with what it wants")
            self.fenced = False
        state = {
            "server": self.server,
            "ok_at": time.time() - (time.monotonic() - sent),
            "failover_after_s": self.failover_after,
            "interval": self.interval,
        }
        try:
            _write_atomically(self.work / "lease.json", json.dumps(state))
        except OSError as exc:
            log.warning("cannot write the lease file: %s", exc)

    def lease_left(self) -> float | None:
        """Seconds until the lease ends (negative once it has), None without a lease."""
        return None if self.lease is None else self.last_ok + self.lease - time.monotonic()

    def _fence_if_expired(self) -> None:
        """Stop every attempt once the lease has ended, before the server may run them
        elsewhere; their ends are reported as failed ("fenced: …")."""
        left = self.lease_left()
        if left is None or left >= 0 or not self.runner.attempts:
            return
        if not self.fenced:
            log.error(
                "FENCING: no answer from the control plane for %.0f s (lease %.0f s, node failover "
                "after %.0f s): stopping all %d attempts before it may run them elsewhere",
                time.monotonic() - self.last_ok,
                self.lease,
                self.failover_after or 0,
                len(self.runner.attempts),
            )
        self.fenced = True
        for attempt_id in list(self.runner.attempts):
            self.runner.stop(attempt_id, "fenced")
        deadline = time.monotonic() + self.grace + 5
        while self.runner.attempts and time.monotonic() < deadline:
            self._spool_ends()  # SIGKILL after the grace, through runner.poll
            time.sleep(0.05)
        self._spool_ends()

    # --- the loop -------------------------------------------------------------------------------
    def run_forever(self) -> None:
        while True:
            started = time.monotonic()
            self.step(budget=max(self.interval / 2, 1.0))
            pause = self.interval - (time.monotonic() - started)
            left = self.lease_left()
            if left is not None and left > 0 and self.runner.attempts:
                pause = min(pause, left + 0.05)  # wake when the lease ends, not an interval later
            time.sleep(max(pause, 0.2))

    def step(self, budget: float = 120.0) -> None:
        """One round: watch processes, heartbeat, act on the answer, deliver reports and output
        (until all is delivered or ``budget`` seconds are spent). An error in any part is
        logged and counted, and the rest goes on: the agent never dies of one."""
        self._safely("watching the attempts", self._spool_ends)
        answer = self._safely("heartbeat", self._heartbeat)
        if answer is None:
            self._safely("fencing", self._fence_if_expired)
            return
        self._safely(
            "reconciling",
            lambda: self._reconcile(answer.get("desired") or [], set(answer.get("stop") or [])),
        )
        if answer.get("mig_layouts"):
            self._safely("changing MIG layouts", lambda: self._apply_layouts(answer["mig_layouts"]))
        if self.describe_due:
            self._safely("describing the node", self._describe)
        self._safely("watching the attempts", self._spool_ends)
        self._safely("delivering", lambda: self._deliver(budget))
        if time.monotonic() - self.cleaned_at > min(CLEAN_EVERY_S, self.retention):
            self.cleaned_at = time.monotonic()
            self._safely("cleaning up", lambda: self.runner.clean(self.retention))

    def _safely(self, what: str, action: Any) -> Any:
        try:
            return action()
        except Exception:
            self.errors += 1
            log.exception("error while %s (%d so far); the agent goes on", what, self.errors)
            return None

    def _heartbeat(self) -> dict[str, Any] | None:
        """The server's answer, or None when there is none to act on."""
        if self.credential is None:
            if not self._ready():
                return None
            try:
                self.register()
            except ServerUnavailable as exc:
                log.warning("cannot register yet: %s", exc)
                return None
        if not self._ready():
            return None
        sent = time.monotonic()
        try:
            answer = self._post("heartbeat", self._report(), self.credential)
        except ServerUnavailable as exc:
            log.warning("server unavailable, running on: %s", exc)
            return None
        self._renew(sent, answer)
        return answer

    def _ready(self) -> bool:
        """Whether the server may be asked now (not while it asked us to wait)."""
        return time.monotonic() >= self.hold_until

    def _report(self) -> dict[str, Any]:
        self.seq += 1
        _, used = memory_bytes()
        busy = (
            {g for a in self._desired_cache.values() for g in a.get("gpus", [])}
            if self._desired_cache
            else set()
        )
        gpus = self.gpus.telemetry(busy)
        power = node_power_w(gpus)
        return {
            "node": self.name,
            "boot_id": self.boot,
            "seq": self.seq,
            "sent_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": self.cpu.busy(),
            "memory": used,
            "agent_version": VERSION,
            "gpus": gpus,
            "running": self.runner.running_ids(),
        } | ({"power_w": power} if power is not None else {})

    _desired_cache: dict[str, dict[str, Any]] = {}

    def _reconcile(self, desired: list[dict[str, Any]], stop: set[str]) -> None:
        """Act on the server's answer: stop what it no longer wants; stop a preempted attempt
        (an entry with ``stop``) with its own signal and grace period, or report it at once if
        it never started; start what it wants and is not running yet."""
        wanted = {entry["attempt"]: entry for entry in desired}
        self._desired_cache = wanted
        for attempt_id in list(self.runner.attempts):
            preempted = stop_terms(wanted.get(attempt_id), self.grace)
            if preempted is not None:
                if not self.runner.is_stopping(attempt_id):
                    log.info("preempted %s: %s, %g s grace", attempt_id, preempted[0].name, preempted[1])
                self.runner.stop(attempt_id, "preempted", *preempted)
            elif attempt_id not in wanted or attempt_id in stop:
                log.info("stopping %s: the server no longer wants it", attempt_id)
                self.runner.stop(attempt_id, "cancelled")
        for attempt_id, entry in wanted.items():
            if attempt_id in self.runner.attempts or self.runner.is_ended(attempt_id):
                continue
            if "stop" in entry:  # preempted before it started here: it never will
                self.runner.refuse(attempt_id, "preempted")
                self._spool([{"attempt": attempt_id, "state": "preempted", "reason": "before it started"}])
                continue
            try:
                self._check_instances(entry)
                self.runner.start(entry)
            except (Refused, OSError) as exc:
                log.warning("refused %s (job %s): %s", attempt_id, entry["job"], exc)
                reason = f"not started: {exc}"[:500]
                self.runner.refuse(attempt_id)
                self._spool([{"attempt": attempt_id, "state": "failed", "reason": reason}])
                continue
            log.info("started %s (job %s) on GPUs %s", attempt_id, entry["job"], entry.get("gpus"))
            self._spool([{"attempt": attempt_id, "state": "running", "node_rank": entry.get("node_rank", 0)}])

    def _check_instances(self, entry: dict[str, Any]) -> None:
        """Refuse an attempt placed on MIG instances this node does not have (any more: a layout
        changed just before it was placed): CUDA would find no GPU at all."""
        wanted = entry.get("mig_uuids") or []
        if not wanted:
            return
        present = {m["uuid"] for g in self.gpus.describe() for m in g.get("mig") or []}
        if missing := [u for u in wanted if u not in present]:
            raise Refused(f"no MIG instance {str(missing[0])[:64]} on this node")

    # --- MIG layouts --------------------------------------------------------------------------
    def _apply_layouts(self, wanted: Any) -> None:
        """Give GPUs the MIG layouts the server asks for (``[{"gpu": index, "profiles": […]}]``,
        sent while a GPU's reported layout differs from what an operator wants; ``[]`` is MIG
        off). A GPU that an attempt holds, or is about to, waits for a later round; a change
        the driver refused is not tried again for ``LAYOUT_RETRY_S``. After a change the node
        describes itself again, and so it does, every ``REDESCRIBE_S`` at most, while the server
        asks for a layout a GPU has already (the server kept an instance an allocation held)."""
        if not isinstance(wanted, list):
            return
        held = self.runner.held_gpus() | {
            g for entry in self._desired_cache.values() for g in entry.get("gpus") or []
        }
        for item in wanted[:64]:
            try:
                index, layout = item["gpu"], mig.check_layout(item["profiles"])
                if isinstance(index, bool) or not isinstance(index, int):
                    raise TypeError("the GPU is not an index")
            except (KeyError, TypeError, mig.LayoutError) as exc:
                log.warning("ignored a MIG layout the server asked for: %s", exc)
                continue
            current = self.gpus.layout(index)
            if (current is None) == (not layout) and mig.same_layout(current or [], layout):
                if time.monotonic() - self.described_at > REDESCRIBE_S:
                    self.describe_due = True  # already so: the server has not taken it in yet
                continue
            if index in held:
                continue  # when its attempts have ended
            failed = self.layout_failed.get(index)
            if failed and failed[0] == layout and time.monotonic() - failed[1] < LAYOUT_RETRY_S:
                continue
            try:
                self.gpus.reconfigure(index, layout)
            except (OSError, LookupError, mig.LayoutError) as exc:
                self.layout_failed[index] = (layout, time.monotonic())
                log.error("GPU %s: cannot change its MIG layout to %s: %s", index, layout or "off", exc)
                continue
            self.layout_failed.pop(index, None)
            log.info("GPU %d: MIG layout now %s", index, ",".join(layout) or "off")
            self.describe_due = True

    # --- reports, with a spool that survives outages ------------------------------------------
    def _load_spool(self) -> None:
        try:
            lines = (self.work / "spool.jsonl").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("cannot read the spool: %s", exc)
            return
        for line in lines:
            try:
                report = json.loads(line)
            except ValueError:  # a line torn by a crash or a full disk
                report = None
            if isinstance(report, dict) and isinstance(report.get("attempt"), str):
                self.queue.append(report)
            elif line.strip():
                log.warning("dropped a torn line of the spool: %r", line[:100])

    def _save_spool(self) -> bool:
        """Write the undelivered reports to disk (all of them, atomically); False when that
        fails: they stay in memory and the next change tries again."""
        try:
            _write_atomically(self.work / "spool.jsonl", "".join(json.dumps(r) + "\n" for r in self.queue))
        except OSError as exc:
            if self.spool_saved:
                log.error("cannot write the spool (%d reports kept in memory): %s", len(self.queue), exc)
            self.spool_saved = False
            return False
        if not self.spool_saved:
            log.warning("the spool is written again")
        self.spool_saved = True
        return True

    def _spool(self, reports: list[dict[str, Any]]) -> None:
        if reports:
            self.queue.extend(reports)
            self._save_spool()

    def _spool_ends(self) -> None:
        """Ended attempts: spool the report first, then mark the attempt reported, so a crash
        in between reports it twice (harmless) rather than never. While the spool cannot be
        written the marks wait too: a restarted agent then finds the attempt again."""
        ended = self.runner.poll()
        self.unmarked.update({r["attempt"]: r["state"] for r in ended})
        self.queue.extend(ended)
        if ended or not self.spool_saved:
            self._save_spool()
        if self.spool_saved:
            for attempt_id, state in list(self.unmarked.items()):
                if self.runner.mark_reported(attempt_id, state):
                    del self.unmarked[attempt_id]

    def _deliver(self, budget: float) -> None:
        """Send the spooled reports, oldest first, and new output, request after request,
        until nothing is left or ``budget`` seconds are spent."""
        deadline = time.monotonic() + budget
        while self._ready():
            reports = self.queue[:MAX_REPORTS_PER_POST]
            chunks, size = [], 0
            for chunk in self.runner.new_output(MAX_POST_BYTES):
                item = {k: v for k, v in chunk.items() if not k.startswith("_")}
                size += len(json.dumps(item, ensure_ascii=False).encode())
                if chunks and (size > MAX_POST_BYTES or len(chunks) >= MAX_REPORTS_PER_POST):
                    break
                chunks.append(chunk)
            if not reports and not chunks:
                return
            body = {
                "node": self.name,
                "reports": reports,
                "logs": [{k: v for k, v in c.items() if not k.startswith("_")} for c in chunks],
            }
            try:
                self._post("attempts", body, self.credential)
            except ServerUnavailable as exc:
                log.warning("reports kept for later: %s", exc)
                return
            del self.queue[: len(reports)]
            self._save_spool()
            self.runner.mark_shipped(chunks)
            for report in reports:
                if report.get("state") in ENDED_STATES:
                    if self.unmarked.pop(report["attempt"], None):
                        self.runner.mark_reported(report["attempt"], report["state"])
                    self.runner.mark_delivered(report["attempt"])
            if time.monotonic() > deadline:
                return

    def _post(self, endpoint: str, body: dict[str, Any], bearer: str | None) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.server}/api/v1/agent/{endpoint}",
            data=json.dumps(body, ensure_ascii=False).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {bearer}"},
        )
        # A request never outlasts the lease by much: the lease is checked when it fails.
        left = self.lease_left() if self.runner.attempts and not self.fenced else None
        timeout = 15.0 if left is None else min(max(left, 1.0), 15.0)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code in (429, 503):
                self._hold(exc.headers.get("Retry-After"))
            if exc.code == 401 and endpoint != "register":
                log.error("credential refused; registering again")
                self.credential = None
            raise ServerUnavailable(f"HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
            raise ServerUnavailable(str(exc)) from None

    def _hold(self, retry_after: str | None) -> None:
        """Ask nothing of the server for ``Retry-After`` seconds (an interval without one), plus
        up to half again at random."""
        try:
            wait = float(retry_after) if retry_after else self.interval
        except ValueError:  # an HTTP date: not worth parsing, an interval will do
            wait = self.interval
        wait = min(max(wait, 0.5), MAX_RETRY_AFTER_S) * random.uniform(1.0, 1.5)
        self.hold_until = max(self.hold_until, time.monotonic() + wait)
        log.warning("the server asks to wait: next request in %.1f s", wait)


def stop_terms(entry: dict[str, Any] | None, default_grace: float) -> tuple[signal.Signals, float] | None:
    """The signal and grace period of a desired entry's ``stop`` (a preemption), None when it
    has none. A signal this machine does not know is SIGTERM; a grace that is not a number of
    seconds is the agent's own."""
    stop = (entry or {}).get("stop")
    if not isinstance(stop, dict):
        return None
    name = str(stop.get("signal") or "TERM").upper().removeprefix("SIG")
    sig = signal.Signals.__members__.get(f"SIG{name}", signal.SIGTERM)
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        sig = signal.SIGTERM  # a stop leaves room for the job to end on its own
    grace = stop.get("grace_s")
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= 86400:
        grace = default_grace
    return sig, float(grace)


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a crash leaves the old content or the new, never half."""
    temporary = path.with_name(path.name + ".new")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _my_address() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's address
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
