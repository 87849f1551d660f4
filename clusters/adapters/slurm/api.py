"""Talking to a Slurm cluster through slurmrestd (OpenAPI v0.0.36–v0.0.38, Slurm 22.05+; node
updates for power saving through v0.0.39 or later, Slurm 23.02+).

Two parts: pure functions that map Slurm's answers to Orrery's terms (tested on recorded
output), and ``SlurmClient``, a small HTTP client that authenticates with a JWT
(``X-SLURM-USER-NAME`` / ``X-SLURM-USER-TOKEN``), picks the newest API version the server
serves, and says exactly what is wrong when it cannot connect.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from clusters.adapters.base import AdapterError
from clusters.choices import NodeState

VERSIONS = ("v0.0.38", "v0.0.37", "v0.0.36")
# Node updates (``POST node/{name}``, power saving) came with v0.0.39 (Slurm 23.02). Orrery never
# posts to an older version: v0.0.36–v0.0.38 ignore the method and answer a POST like a GET, so the
# node would silently stay as it was.
NODE_UPDATE_VERSIONS = ("v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40", "v0.0.39")
# The node states Orrery asks Slurm for (``scontrol update nodename=… state=…``).
POWER_STATES = frozenset({"POWER_DOWN", "POWER_UP"})
_GRES = re.compile(r"^gpu(?::([A-Za-z0-9_.-]+))?:(\d+)")

# Slurm node states (base state, lowercase as slurmrestd gives them) → Orrery's. Flags such as
# DRAIN or NOT_RESPONDING override the base state (see ``node_state``).
NODE_STATES = {
    "idle": NodeState.READY,
    "mixed": NodeState.READY,
    "allocated": NodeState.READY,
    "completing": NodeState.READY,
    "planned": NodeState.READY,
    "down": NodeState.DOWN,
    "error": NodeState.DOWN,
    "future": NodeState.NOT_READY,
    "unknown": NodeState.NOT_READY,
}

# Slurm job states → Orrery job states (upper case, as squeue prints them).
JOB_STATES = {
    "PENDING": "PENDING",
    "CONFIGURING": "STARTING",
    "RUNNING": "RUNNING",
    "COMPLETING": "COMPLETING",
    "SUSPENDED": "RUNNING",
    "COMPLETED": "SUCCEEDED",
    "FAILED": "FAILED",
    "BOOT_FAIL": "FAILED",
    "NODE_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "DEADLINE": "TIMEOUT",
    "TIMEOUT": "TIMEOUT",
    "CANCELLED": "CANCELLED",
    "PREEMPTED": "PREEMPTED",
    "REQUEUED": "PENDING",
    "REQUEUE_FED": "PENDING",
    "REQUEUE_HOLD": "HELD",
    "RESV_DEL_HOLD": "HELD",
    "SPECIAL_EXIT": "HELD",
}


def parse_gres(gres: str | None) -> tuple[str | None, int]:
    """``"gpu:a100:4"`` → ``("a100", 4)``; ``"gpu:4"`` → ``(None, 4)``; no GPU → ``(None, 0)``.
    Only the first GPU entry of a comma-separated list counts (nodes rarely mix models)."""
    for part in (gres or "").split(","):
        match = _GRES.match(part.strip())
        if match:
            return match.group(1), int(match.group(2))
    return None, 0


def node_state(
    state: str | list[str] | None, flags: list[str] | None = None, reason: str = ""
) -> tuple[str, str]:
    """Orrery's state and a reason for a Slurm node. A drained or draining node is an
    operator's decision and maps to ``drained``/``draining``; a node not responding takes no new
    work, and is lost (``down``) once Slurm says so."""
    parts = [state] if isinstance(state, str) else list(state or [])
    words = {p.lower() for p in parts} | {f.lower() for f in (flags or [])}
    base = next((w for w in (p.lower() for p in parts) if w in NODE_STATES), "unknown")
    if "not_responding" in words:
        # a flag Slurm raises between pings; Slurm itself calls the node DOWN after SlurmdTimeout
        return (NodeState.DOWN if base == "down" else NodeState.NOT_READY), reason or "slurmd not responding"
    if "drain" in words or "draining" in words or "drained" in words:
        busy = base in {"mixed", "allocated", "completing"}
        return (NodeState.DRAINING if busy else NodeState.DRAINED), reason or "drained in Slurm"
    return NODE_STATES[base], reason


def raw_job_state(state: str | list[str] | None) -> str:
    """Slurm's own job state, upper case (slurmrestd gives a string or a list of them)."""
    first = state if isinstance(state, str) else (state or ["PENDING"])[0]
    return (first or "PENDING").upper()


def job_state(state: str | list[str] | None) -> str:
    return JOB_STATES.get(raw_job_state(state), "FAILED")


def decode_exit(raw: int | None) -> tuple[int | None, int | None]:
    """Slurm's ``exit_code`` in JSON is a raw wait status: ``(exit code, signal)``."""
    if raw is None:
        return None, None
    if raw & 0x7F:
        return None, raw & 0x7F
    return raw >> 8 & 0xFF, None


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str
    reason: str
    cpus: int
    memory_mb: int
    gpu_type: str | None
    gpus: int
    partitions: tuple[str, ...]
    gres: str = ""  # as Slurm gives it: read in full by ``gres.parse_node_gres`` (MIG, shards)


def parse_nodes(payload: dict[str, Any]) -> list[SlurmNode]:
    nodes = []
    for n in payload.get("nodes") or []:
        state, reason = node_state(n.get("state"), n.get("state_flags"), n.get("reason") or "")
        gpu_type, gpus = parse_gres(n.get("gres"))
        nodes.append(
            SlurmNode(
                name=n["name"],
                state=state,
                reason=reason,
                cpus=int(n.get("cpus") or 0),
                memory_mb=int(n.get("real_memory") or 0),
                gpu_type=gpu_type,
                gpus=gpus,
                partitions=tuple(n.get("partitions") or ()),
                gres=n["gres"] if isinstance(n.get("gres"), str) else "",
            )
        )
    return nodes


def node_update(version: str, node: str, state: str) -> tuple[str, str, dict[str, Any]]:
    """The request that asks slurmrestd to move ``node`` to ``state``: method, path and body
    (``{"state": ["POWER_DOWN"]}``). The name is quoted whole into the path: a name with ``/`` or
    ``?`` in it cannot reach another endpoint."""
    if version not in NODE_UPDATE_VERSIONS:
        raise SlurmError(f"slurmrestd {version} cannot update nodes (v0.0.39 or later, Slurm 23.02+)")
    if state not in POWER_STATES:
        raise SlurmError(f"not a power state Orrery asks for: {state!r}")
    if not node or len(node) > 255:
        raise SlurmError(f"not a node name: {node!r}")
    return "POST", f"/slurm/{version}/node/{urllib.parse.quote(node, safe='')}", {"state": [state]}


def update_errors(answer: dict[str, Any]) -> str:
    """What went wrong in a node update slurmrestd answered with 200 ("" for nothing): the
    newer versions report refusals in ``errors`` of an otherwise ordinary answer."""
    errors = answer.get("errors") or []
    if not isinstance(errors, list):
        return str(errors)[:300]
    words = [
        str(e.get("description") or e.get("error") or e) if isinstance(e, dict) else str(e) for e in errors
    ]
    return "; ".join(w for w in words if w)[:300]


class SlurmError(AdapterError):
    """What is wrong, in words an operator can act on; ``field`` names the onboarding setting
    at fault (``url`` or ``token``), when one is. ``slurmrestd`` is true when a slurmrestd
    itself said it (not any server at that address)."""

    def __init__(self, message: str, field: str = "", *, slurmrestd: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.slurmrestd = slurmrestd


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """slurmrestd never redirects; following one would carry the token to another address."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect refused ({msg})", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirects)


class SlurmClient:
    def __init__(self, url: str, token: str, user: str = "root", timeout: float = 10.0) -> None:
        self.url, self.token, self.user, self.timeout = url.rstrip("/"), token, user, timeout
        self.version: str | None = None
        self.update_version: str | None = None

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={
                "X-SLURM-USER-NAME": self.user,
                "X-SLURM-USER-TOKEN": self.token,
                "Content-Type": "application/json",
            },
        )
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                body = response.read() or b"{}"
            answer = json.loads(body)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
            return answer
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            if exc.code == 401:
                raise SlurmError(
                    "slurmrestd refused the token (401): check the JWT and the user name", "token"
                ) from None
            try:
                errors = json.loads(text).get("errors") or []
            except ValueError:
                errors = []
            if any(e.get("source") == "slurm_load_ctl_conf" for e in errors):
                raise SlurmError(
                    "slurmrestd could not use the token: expired, or signed with another key",
                    "token",
                    slurmrestd=True,
                ) from None
            if exc.code == 404:
                raise SlurmError(f"not found: {path}") from None
            detail = "; ".join(e.get("error") or e.get("description") or "" for e in errors) or text[:200]
            raise SlurmError(f"slurmrestd answered {exc.code}: {detail}") from None
        except ValueError:
            raise SlurmError(
                f"{self.url}{path} did not answer with slurmrestd's JSON: is this the slurmrestd URL?", "url"
            ) from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise SlurmError(
                f"cannot reach slurmrestd at {self.url}: {getattr(exc, 'reason', exc)}", "url"
            ) from None

    def connect(self) -> str:
        """Find the newest supported API version; ``SlurmError`` says why not."""
        self.version = self._served(VERSIONS)
        if self.version is None:
            raise SlurmError(
                f"slurmrestd serves none of the API versions Orrery speaks ({', '.join(VERSIONS)})", "url"
            )
        return self.version

    def _served(self, versions: tuple[str, ...]) -> str | None:
        """The first of ``versions`` the server answers a ping on (None: none of them)."""
        for version in versions:
            try:
                self._request("GET", f"/slurm/{version}/ping")
            except SlurmError as exc:
                if str(exc).startswith("not found"):
                    continue
                raise
            return version
        return None

    def _path(self, rest: str) -> str:
        if self.version is None:
            self.connect()
        return f"/slurm/{self.version}/{rest}"

    def nodes(self) -> list[SlurmNode]:
        return parse_nodes(self._request("GET", self._path("nodes")))

    def jobs(self) -> list[dict[str, Any]]:
        return self._request("GET", self._path("jobs")).get("jobs") or []

    def cancel(self, job_id: int) -> None:
        """Kill a job (``DELETE job/{id}`` without a signal is SIGKILL to all of it)."""
        self._request("DELETE", self._path(f"job/{job_id}"))

    def signal(self, job_id: int, signal: str) -> None:
        """Send ``signal`` (a name: ``TERM``, ``USR1``…) to every step of a running job, its batch
        script and the processes it started included: slurmrestd v0.0.36–v0.0.38 signal the
        full job (what ``scancel --full --signal`` does). Slurm refuses to signal a job that is
        still pending."""
        if not signal.isalnum():
            raise SlurmError(f"not a signal name: {signal!r}")
        self._request("DELETE", self._path(f"job/{job_id}?signal={signal}"))

    def set_node_state(self, node: str, state: str) -> None:
        """Ask Slurm to move a node to ``state`` (``POWER_DOWN``, ``POWER_UP``) — what
        ``scontrol update nodename=NODE state=STATE`` does — through the newest API version that
        updates nodes. ``SlurmError`` says why not: a slurmrestd too old for it, a refusal."""
        if self.update_version is None:
            self.update_version = self._served(NODE_UPDATE_VERSIONS)
        if self.update_version is None:
            raise SlurmError(
                f"slurmrestd at {self.url} cannot update nodes: power saving needs API v0.0.39 or later "
                "(Slurm 23.02+)"
            )
        method, path, body = node_update(self.update_version, node, state)
        refused = update_errors(self._request(method, path, body))
        if refused:
            raise SlurmError(f"Slurm refused {state} for {node}: {refused}")
