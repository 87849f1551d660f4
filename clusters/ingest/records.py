"""Validation of heartbeat reports into compact records, without a serializer per record.

A report is what a node says about itself every interval::

    {"node": "a-n001", "boot_id": "…", "seq": 42, "sent_at": "2026-11-30T12:00:00Z",
     "cpu": 0.35, "memory": 123456789, "power_w": 900.0, "agent_version": "0.1.0",
     "gpus": [{"index": 0, "uuid": "GPU-…", "model": "NVIDIA H100 80GB HBM3",
               "memory_total_mb": 81559, "memory_used_mb": 1024, "util": 87.0,
               "power_w": 612.5, "temp_c": 61.0, "health": "healthy", "xid": null}],
     "running": ["<attempt id>", …]}

``cpu`` is the busy fraction (0–1), ``memory`` the bytes in use. The record keeps what the
aggregator needs under short keys; ``t`` is the *server's* receive time, the only clock
liveness is judged by.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

MAX_GPUS = 64
MAX_RUNNING = 256
_HEALTH = {"healthy", "unhealthy"}


class ReportError(Exception):
    """A malformed report: ``path`` names the field (``nodes[3].gpus[1].util``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path, self.message = path, message
        super().__init__(f"{path}: {message}")


def _number(value: Any, path: str, low: float, high: float, *, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ReportError(path, "must be a number")
    if not low <= value <= high:
        raise ReportError(path, f"must be between {low:g} and {high:g}")
    return float(value)


def _integer(value: Any, path: str, low: int, high: int, *, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportError(path, "must be an integer")
    if not low <= value <= high:
        raise ReportError(path, f"must be between {low} and {high}")
    return value


def _text(value: Any, path: str, max_length: int, *, optional: bool = True) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str) or len(value) > max_length or "\x00" in value:
        raise ReportError(path, f"must be a string of at most {max_length} characters")
    return value


_NUM = (int, float)


def _fast_gpu(gpu: Any) -> list[Any] | None:
    """The common case, checked inline (this runs for every GPU of every report): a row, or
    None when anything is off — then ``_checked_gpu`` finds the field and says what is wrong.
    ``type(x) in _NUM`` leaves out booleans; NaN fails every range check."""
    if type(gpu) is not dict:
        return None
    get = gpu.get
    index, uuid, model = get("index"), get("uuid"), get("model")
    total, used, util = get("memory_total_mb"), get("memory_used_mb"), get("util")
    power, temp, health, xid = get("power_w"), get("temp_c"), get("health") or "healthy", get("xid")
    if not (
        type(index) is int
        and 0 <= index < MAX_GPUS
        and (uuid is None or (type(uuid) is str and len(uuid) <= 64 and "\x00" not in uuid))
        and (model is None or (type(model) is str and len(model) <= 120 and "\x00" not in model))
        and (total is None or (type(total) is int and 0 <= total <= 10**7))
        and (used is None or (type(used) is int and 0 <= used <= 10**7))
        and (util is None or (type(util) in _NUM and 0 <= util <= 100))
        and (power is None or (type(power) in _NUM and 0 <= power <= 10_000))
        and (temp is None or (type(temp) in _NUM and -50 <= temp <= 200))
        and health in _HEALTH
        and (xid is None or (type(xid) is int and 0 <= xid <= 10**6))
    ):
        return None
    return [
        index,
        uuid or "",
        model or "",
        total,
        used,
        None if util is None else float(util),
        None if power is None else float(power),
        None if temp is None else float(temp),
        health,
        xid,
    ]


def _checked_gpu(gpu: Any, g: str) -> list[Any]:
    """The slow, precise check: raises ``ReportError`` naming the first bad field."""
    if not isinstance(gpu, dict):
        raise ReportError(g, "must be an object")
    health = gpu.get("health") or "healthy"
    if health not in _HEALTH:
        raise ReportError(f"{g}.health", "must be healthy or unhealthy")
    return [
        _integer(gpu.get("index"), f"{g}.index", 0, MAX_GPUS - 1, optional=False),
        _text(gpu.get("uuid"), f"{g}.uuid", 64),
        _text(gpu.get("model"), f"{g}.model", 120),
        _integer(gpu.get("memory_total_mb"), f"{g}.memory_total_mb", 0, 10**7),
        _integer(gpu.get("memory_used_mb"), f"{g}.memory_used_mb", 0, 10**7),
        _number(gpu.get("util"), f"{g}.util", 0, 100),
        _number(gpu.get("power_w"), f"{g}.power_w", 0, 10_000),
        _number(gpu.get("temp_c"), f"{g}.temp_c", -50, 200),
        health,
        _integer(gpu.get("xid"), f"{g}.xid", 0, 10**6),
    ]


def parse_report(
    report: Any, path: str, *, node_id: int, cluster_id: int, received_at: float
) -> dict[str, Any]:
    """One validated record for the node ``node_id`` (the caller has matched the name)."""
    if not isinstance(report, dict):
        raise ReportError(path or "(body)", "must be an object")
    p = f"{path}." if path else ""
    gpus_raw = report.get("gpus") or []
    if not isinstance(gpus_raw, list) or len(gpus_raw) > MAX_GPUS:
        raise ReportError(f"{p}gpus", f"must be a list of at most {MAX_GPUS} GPUs")
    gpus = []
    for i, gpu in enumerate(gpus_raw):
        row = _fast_gpu(gpu)
        gpus.append(row if row is not None else _checked_gpu(gpu, f"{p}gpus[{i}]"))
    running = report.get("running") or []
    if (
        not isinstance(running, list)
        or len(running) > MAX_RUNNING
        or not all(isinstance(r, str) and len(r) <= 64 for r in running)
    ):
        raise ReportError(f"{p}running", f"must be a list of at most {MAX_RUNNING} attempt ids")
    return {
        "n": node_id,
        "c": cluster_id,
        "b": _text(report.get("boot_id"), f"{p}boot_id", 64, optional=False),
        "q": _integer(report.get("seq"), f"{p}seq", 0, 2**53, optional=False),
        "t": received_at,
        "s": _text(report.get("sent_at"), f"{p}sent_at", 40),
        "cpu": _number(report.get("cpu"), f"{p}cpu", 0, 1),
        "mem": _integer(report.get("memory"), f"{p}memory", 0, 2**60),
        "pw": _number(report.get("power_w"), f"{p}power_w", 0, 10**6),
        "av": _text(report.get("agent_version"), f"{p}agent_version", 40),
        "g": gpus,
        "r": running,
    }


def node_name(report: Any, path: str) -> str:
    if not isinstance(report, dict):
        raise ReportError(path or "(body)", "must be an object")
    return _text(report.get("node"), f"{path}.node" if path else "node", 120, optional=False)


def collector_record(
    node_id: int, cluster_id: int, *, boot: str, agent: str, gpus: list[list[Any]], now: float
) -> dict[str, Any]:
    """A heartbeat a collector (Slurm, Kubernetes) writes for a node it reads from its cluster's
    API, in the agents' record shape: no sequence of its own (the time in ms), no host metrics."""
    return {
        "n": node_id,
        "c": cluster_id,
        "b": boot,
        "q": int(now * 1000),
        "t": now,
        "s": "",
        "cpu": None,
        "mem": None,
        "pw": None,
        "av": agent,
        "g": gpus,
        "r": [],
    }


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """The slim form the aggregator reads every pass: liveness, a fingerprint of the slow facts,
    and the GPU sums the roll-ups need — a fraction of the full record's size.

    ``fp`` is 32 hex characters: 16 for the node's facts (boot, agent version) then 16 for its
    GPUs' (index, health, XID, reason), so the aggregator can tell which rows need writing."""
    gpus = record["g"]
    # A collector may add an eleventh field, why the GPU may not be used (Kubernetes: held by a
    # pod Orrery did not place); an agent's report never has it.
    bad = [[g[0], g[9], *g[10:11]] for g in gpus if g[8] != "healthy"]
    node_facts = f"{record['b']}|{record['av']}".encode()
    gpu_facts = ";".join(",".join(map(str, b)) for b in bad).encode() if bad else b""
    utils = [g[5] for g in gpus if g[5] is not None]
    return {
        "n": record["n"],
        "c": record["c"],
        "b": record["b"],
        "q": record["q"],
        "t": record["t"],
        "av": record["av"],
        "fp": _hash(node_facts) + _hash(gpu_facts + b"#" + str(len(gpus)).encode()),
        "k": len(utils),
        "u": sum(utils),
        "p": sum(g[6] for g in gpus if g[6] is not None),
        "bad": bad,
    }


def _hash(data: bytes) -> str:
    return blake2b(data, digest_size=8).hexdigest()
