"""The Orrery node agent: register once, then heartbeat, run what the server wants, stop what
it does not, and report — surviving a server outage without losing a report.

Everything it must remember lives in its work directory: the node credential (0600), the
attempts it runs (``attempts/``, see ``runner``) and the reports not yet delivered
(``spool.jsonl``, replayed in order when the server answers again). Everything it writes is its
own user's alone (umask 077); only ``jobs/`` is shared, one directory per attempt, each owned by
the account the attempt runs as.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from clusters.agent.cgroups import Cgroups
from clusters.agent.runner import Refused, Runner
from clusters.agent.telemetry import CpuMeter, Gpus, boot_id, cpu_count_millicores, memory_bytes

log = logging.getLogger("orrery.agent")
VERSION = "0.1.0"


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
        labels: dict[str, str] | None = None,
        address: str | None = None,
        grace: float = 10.0,
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
        self.gpus = Gpus(fake_gpus, self.name)
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
        self.credential = self._load_credential()

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
        total, _ = memory_bytes()
        body = {
            "name": self.name,
            "cpu_millicores": cpu_count_millicores(),
            "memory_bytes": total,
            "agent_version": VERSION,
            "boot_id": self.boot,
            "labels": self.labels,
            "gpus": self.gpus.describe(),
        }
        answer = self._post("register", body, self.join_token)
        self.credential = answer["credential"]
        path = self._credential_file()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"server": self.server, "node": self.name, "credential": self.credential}, handle)
        log.info("registered as %s in cluster %s", answer["node"], answer["cluster"])

    # --- the loop -------------------------------------------------------------------------------
    def run_forever(self) -> None:
        while True:
            started = time.monotonic()
            self.step()
            time.sleep(max(self.interval - (time.monotonic() - started), 0.2))

    def step(self) -> None:
        """One round: watch processes, heartbeat, act on the answer, deliver reports."""
        if self.credential is None:
            try:
                self.register()
            except ServerUnavailable as exc:
                log.warning("cannot register yet: %s", exc)
                return
        self._spool_ends()
        try:
            answer = self._post("heartbeat", self._report(), self.credential)
        except ServerUnavailable as exc:
            log.warning("server unavailable, running on: %s", exc)
            return
        self.interval = float(answer.get("interval") or self.interval)
        self._reconcile(answer.get("desired") or [], set(answer.get("stop") or []))
        self._spool_ends()
        self._deliver()

    def _report(self) -> dict[str, Any]:
        self.seq += 1
        _, used = memory_bytes()
        busy = (
            {g for a in self._desired_cache.values() for g in a.get("gpus", [])}
            if self._desired_cache
            else set()
        )
        return {
            "node": self.name,
            "boot_id": self.boot,
            "seq": self.seq,
            "sent_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": self.cpu.busy(),
            "memory": used,
            "agent_version": VERSION,
            "gpus": self.gpus.telemetry(busy),
            "running": self.runner.running_ids(),
        }

    _desired_cache: dict[str, dict[str, Any]] = {}

    def _reconcile(self, desired: list[dict[str, Any]], stop: set[str]) -> None:
        wanted = {entry["attempt"]: entry for entry in desired}
        self._desired_cache = wanted
        for attempt_id in list(self.runner.attempts):
            if attempt_id not in wanted or attempt_id in stop:
                log.info("stopping %s: the server no longer wants it", attempt_id)
                self.runner.stop(attempt_id, "cancelled")
        for attempt_id, entry in wanted.items():
            if attempt_id in self.runner.attempts or (self.runner.root / attempt_id / "reported").exists():
                continue
            try:
                self.runner.start(entry)
            except (Refused, OSError) as exc:
                log.warning("refused %s (job %s): %s", attempt_id, entry["job"], exc)
                reason = f"not started: {exc}"[:500]
                self._spool([{"attempt": attempt_id, "state": "failed", "reason": reason}])
                self.runner.refuse(attempt_id)
                continue
            log.info("started %s (job %s) on GPUs %s", attempt_id, entry["job"], entry.get("gpus"))
            self._spool([{"attempt": attempt_id, "state": "running", "node_rank": entry.get("node_rank", 0)}])

    # --- reports, with a spool that survives outages ------------------------------------------
    def _spool_ends(self) -> None:
        """Ended attempts: spool the report first, then mark the attempt reported, so a crash
        in between reports it twice (harmless) rather than never."""
        ended = self.runner.poll()
        self._spool(ended)
        for report in ended:
            self.runner.mark_reported(report["attempt"], report["state"])

    def _spool(self, reports: list[dict[str, Any]]) -> None:
        if not reports:
            return
        with open(self.work / "spool.jsonl", "a") as handle:
            for report in reports:
                handle.write(json.dumps(report) + "\n")

    def _deliver(self) -> None:
        path = self.work / "spool.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        reports = [json.loads(line) for line in lines[:500]]  # the server takes 1000 at most
        chunks = self.runner.new_output()[:20]  # 256 KiB each at most: a POST stays under 8 MiB
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
        if reports:
            path.write_text("".join(line + "\n" for line in lines[len(reports) :]))
        self.runner.mark_shipped(chunks)

    def _post(self, endpoint: str, body: dict[str, Any], bearer: str | None) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.server}/api/v1/agent/{endpoint}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {bearer}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=15) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 401 and endpoint != "register":
                log.error("credential refused; registering again")
                self.credential = None
            raise ServerUnavailable(f"HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise ServerUnavailable(str(exc)) from None


def _my_address() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's address
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
