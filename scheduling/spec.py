"""The job spec (``apiVersion: orrery/v1``): parsing and normalisation, with no database.

``parse_job_spec(document)`` turns a decoded JSON/YAML document into a ``JobSpec`` in base
units, or raises ``SpecError`` listing *every* problem with the path of the field at fault
(``spec.resources.gpus``). Names that need the database — the project, the queue, the GPU model
— are kept as strings here and resolved by ``scheduling.services.submission``.

Units, chosen to match what Slurm and Kubernetes users type:

* memory: ``256Gi``, ``256G``, ``256GB``, ``512Mi``, ``1T``… — every suffix is binary (``1G`` =
  1024 MiB, as in Slurm); a bare number is MiB (Slurm's default unit);
* cpus: ``32``, ``0.5`` or ``500m`` (millicores, as in Kubernetes);
* time: ``2h``, ``90m``, ``1h30m``, ``45s``, ``1d``; Slurm's ``MM``, ``MM:SS``, ``HH:MM:SS``,
  ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; ISO 8601 ``PT2H``, ``P1DT2H``; a bare integer is minutes
  (Slurm's default unit);
* gpus: ``"h100:8"``, ``"gpu:h100:8"``, ``"h100"`` (one), ``{model: h100, count: 8}``, or ``0``;
  any model: ``8``, ``"8"``, ``"gpu:8"``, ``"gpu"`` (one), ``{count: 8}``, and ``{count: 8,
  models: [h100, a100]}`` for any of these models, best first (the scheduler records the model
  it chose when it places the job);
* smaller than whole GPUs: a MIG instance ``"a100:1g.10gb"`` (one), ``"a100:1g.10gb:2"`` or
  ``{model: a100, mig: 1g.10gb, count: 2}``; a fraction of a shareable GPU with ``gpus`` one
  GPU (per node) and ``resources.gpuMemory: 20Gi`` (memory, units as for ``memory``) or
  ``resources.gpuShare: 0.25`` (a fraction of the GPU's memory and compute);
* topology: ``placement.topology: required|preferred`` keeps a gang under one switch or rack;
* preemption: ``preemptible`` (default true) and ``preemption: {signal: USR1, grace: 2m}`` — the
  signal a preempted job gets first (``TERM``, ``INT``, ``HUP``, ``USR1``, ``USR2``, ``QUIT``, with
  or without ``SIG``) and how long it then has to save its work before it is killed (a duration
  as for the time limit, at most 1 hour; its queue may allow less).

Hostile input is refused, never crashes: numbers are read from ASCII digits only (``int()`` and
``float()`` also read ``"١٢"``), and a digit string too long for any range is refused by its
length before it is converted; no string anywhere in the document, key or value, may hold NUL or
a lone surrogate (neither can be stored, nor shown back in an error).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from clusters.agent.mig import PROFILE as MIG_PROFILE  # the one grammar: agents, ingest, the console

API_VERSION = "orrery/v1"
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
MAX_TIME_LIMIT_S = 365 * 24 * 3600
MAX_SIM_DURATION_S = MAX_TIME_LIMIT_S
MAX_ARRAY_SIZE = 10_000
MAX_ARRAY_INDEX = 4_000_000  # Slurm's largest MaxArraySize less one
MAX_RETRIES = 100
MAX_CPUS = 1_000_000
MAX_MEMORY_BYTES = 2**50
PRIORITY_NAMES = {"low": -100, "normal": 0, "high": 100}
PRIORITY_RANGE = (-1000, 1000)
FAILOVER_POLICIES = ("requeue", "hold", "fail")
MAX_GPU_MODELS = 16  # in one any-model request's list of preferences
PREEMPTION_SIGNALS = ("TERM", "INT", "HUP", "USR1", "USR2", "QUIT")
MAX_PREEMPTION_GRACE_S = 3600
MAX_DEPENDENCY_REFS = 1000  # job or array references in one job's dependency
DEPENDENCY_KINDS = ("afterok", "afterany", "afternotok")  # and "singleton", which takes no reference

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SLUG = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)(B?)\s*$", re.IGNORECASE | re.ASCII)
_UNITS = {"": 2**20, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_DURATION_PARTS = re.compile(r"(\d+)\s*([dhms])", re.IGNORECASE | re.ASCII)
_DURATION = re.compile(r"^\s*(?:\d+\s*[dhms]\s*)+$", re.IGNORECASE | re.ASCII)
_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$", re.ASCII)
_ISO_DURATION = re.compile(r"^P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?$", re.IGNORECASE | re.ASCII)
_ARRAY = re.compile(r"^\d+(-\d+(:\d+)?)?$", re.ASCII)
_JOB_REF = re.compile(r"(\d{1,18})(?:_(\d{1,9}))?", re.ASCII)
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?", re.ASCII)
_BEYOND = 10**18  # more than any count, size or duration a spec holds
_MAX_TEXT_NUMBER = 64  # characters: no duration, size or index range is longer

TOP_FIELDS = {"apiVersion", "kind", "metadata", "spec"}
METADATA_FIELDS = {"name", "project", "labels"}
SPEC_FIELDS = {
    "queue",
    "priority",
    "resources",
    "timeLimit",
    "run",
    "setup",
    "image",
    "env",
    "secretEnv",
    "workdir",
    "placement",
    "retries",
    "failover",
    "array",
    "sim",
    "preemptible",
    "preemption",
    "dependency",
}
RESOURCE_FIELDS = {"nodes", "gpus", "cpus", "memory", "gpuMemory", "gpuShare"}
GPU_FIELDS = {"model", "models", "count", "mig"}
TOPOLOGIES = ("required", "preferred")
PREEMPTION_FIELDS = {"signal", "grace"}
PLACEMENT_FIELDS = {"clusters", "nodeSelector", "topology"}
SIM_FIELDS = {"duration", "exitCode"}
ARRAY_FIELDS = {"indices", "throttle"}


class SpecError(Exception):
    """The spec is invalid. ``errors`` lists ``(path, message)`` pairs, in document order."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{path}: {message}" for path, message in errors))


class FieldProblems(ValueError):
    """A parser's refusal of parts of its value: ``(where, message)`` pairs, ``where`` appended
    to the field's path (``.models[1]``)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(message for _, message in problems))


@dataclass(frozen=True)
class GpuRequest:
    """GPUs per node: ``count`` of ``model``; with ``model`` None and a count, any model —
    of ``models`` (names, best first) when given, else of every model."""

    model: str | None
    count: int
    models: tuple[str, ...] = ()
    mig: str = ""  # a MIG profile: ``count`` instances of it on GPUs of ``model``

    @property
    def any_model(self) -> bool:
        return self.count > 0 and self.model is None


@dataclass(frozen=True)
class JobSpec:
    """A parsed spec in base units. Names (project, queue, GPU model, clusters) are unresolved."""

    name: str
    project: str | None
    labels: dict[str, str]
    queue: str
    priority: int
    nodes: int
    gpus: GpuRequest
    cpu_millicores: int
    memory_bytes: int
    time_limit_s: int | None
    run: str
    setup: str
    image: str
    env: dict[str, str]
    secret_env: dict[str, str]
    workdir: str
    clusters: list[str]
    node_selector: dict[str, str]
    retries: int
    failover: str
    array: list[int] | None
    sim_duration_s: float | None
    sim_exit_code: int
    preemptible: bool
    preemption_signal: str
    preemption_grace_s: int | None  # None: the queue's grace period
    document: dict[str, Any] = field(repr=False)
    array_throttle: int | None = None  # Slurm's "%N": at most N members run at once
    # (kind, reference) pairs, references unresolved ("74", "74_3"); kind "singleton" has ref "".
    dependency: tuple[tuple[str, str], ...] = ()
    gpu_memory_mb: int = 0  # a fraction of a shareable GPU, by memory …
    gpu_share: float | None = None  # … or by share
    topology: str = ""  # a gang's "required" or "preferred" keeping to one switch or rack


class _Collector:
    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append((path, message))

    def mapping(self, value: Any, path: str, allowed: set[str] | None = None) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.add(path or "(body)", f"must be a mapping, not {_kind(value)}")
            return {}
        for key in value:
            if not isinstance(key, str):
                self.add(path or "(body)", f"keys must be strings, not {_kind(key)}")
            elif allowed is not None and key not in allowed:
                where = f"{path}.{path_key(key)}" if path else (path_key(key) or '""')
                self.add(where, f"unknown field; expected one of {', '.join(sorted(allowed))}")
        return {k: v for k, v in value.items() if isinstance(k, str)}

    def string(self, value: Any, path: str, *, required: bool = False, max_length: int = 10_000) -> str:
        if value is None:
            if required:
                self.add(path, "is required")
            return ""
        if not isinstance(value, str):
            self.add(path, f"must be a string, not {_kind(value)}")
            return ""
        if "\x00" in value:
            self.add(path, "must not contain NUL characters")
            return ""
        if len(value) > max_length:
            self.add(path, f"is longer than {max_length} characters")
            return ""
        if required and not value.strip():
            self.add(path, "must not be empty")
        return value

    def integer(self, value: Any, path: str, *, default: int, low: int, high: int) -> int:
        if value is None:
            return default
        if isinstance(value, str) and ascii_integer(value) is not None:
            value = ascii_integer(value)
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(path, f"must be an integer, not {_kind(value)}")
            return default
        if not low <= value <= high:
            self.add(path, f"must be between {low} and {high}, got {_shown(value)}")
            return default
        return value

    def string_map(self, value: Any, path: str, key_pattern: re.Pattern[str], what: str) -> dict[str, str]:
        out = {}
        for key, item in self.mapping(value, path).items():
            where = f"{path}.{path_key(key)}"
            if not key_pattern.fullmatch(key):
                self.add(where, f"is not a valid {what} name")
            elif isinstance(item, bool) or not isinstance(item, str | int | float):
                self.add(where, f"must be a string, not {_kind(item)}")
            elif isinstance(item, int) and not -_BEYOND < item < _BEYOND:
                self.add(where, "is a number too large to be a value; quote it")
            else:
                text = str(item)
                if len(text) > 4096 or "\x00" in text:
                    self.add(where, "must be at most 4096 characters without NUL")
                else:
                    out[key] = text
        return out


def _environment(c: _Collector, env: Any, secret: Any, path: str) -> tuple[dict[str, str], dict[str, str]]:
    """The job's plain and secret environment. Secret values come from ``secretEnv`` or from
    ``env`` entries written ``{value: …, secret: true}``; a name is either plain or secret."""
    plain: dict[str, Any] = {}
    marked: dict[str, Any] = {}
    for key, item in c.mapping(env, f"{path}.env").items():
        if not isinstance(item, dict):
            plain[key] = item
            continue
        entry = c.mapping(item, f"{path}.env.{key}", {"value", "secret"})
        if not isinstance(entry.get("secret", False), bool):
            c.add(f"{path}.env.{key}.secret", f"must be true or false, not {_kind(entry['secret'])}")
        elif "value" not in entry:
            c.add(f"{path}.env.{key}.value", "is required")
        else:
            (marked if entry.get("secret") else plain)[key] = entry["value"]
    plain_env = c.string_map(plain, f"{path}.env", _ENV_KEY, "environment variable")
    secret_env = c.string_map(marked, f"{path}.env", _ENV_KEY, "environment variable")
    given = c.string_map(secret, f"{path}.secretEnv", _ENV_KEY, "environment variable")
    for key in sorted(given.keys() & (plain_env.keys() | secret_env.keys())):
        c.add(f"{path}.secretEnv.{key}", "is also set in env; give each variable once")
    return plain_env, secret_env | given


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored or shown back (NUL, a lone surrogate), or None."""
    if "\x00" in text:
        return "must not contain NUL characters"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "must not contain lone surrogates (\\ud800-\\udfff are not Unicode text)"
    return None


def path_key(key: Any) -> str:
    """A mapping key as it can be shown in an error's path: at most 100 characters, with NUL
    and lone surrogates escaped (a path is rendered back to the client)."""
    text = str(key)[:100]
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def text_errors(document: Any, path: str = "") -> list[tuple[str, str]]:
    """Every string of the document, keys included, that holds NUL or a lone surrogate, with its
    path, in document order. Each list or mapping is visited once (YAML aliases share them), at
    most 64 deep. Text without fault, nearly all, is walked once without building paths; a
    document with a fault is walked again to name where."""
    if _clean_text(document):
        return []
    errors: list[tuple[str, str]] = []
    visited: set[int] = set()
    stack: list[tuple[Any, Any, str, int]] = [(None, document, path, 0)]
    while stack:
        key, value, where, depth = stack.pop()
        problem = text_problem(key) if isinstance(key, str) else None
        if problem:
            errors.append((where, f"its name {problem}"))
        if isinstance(value, str):
            problem = text_problem(value)
            if problem:
                errors.append((where or "(body)", problem))
        elif isinstance(value, dict | list) and id(value) not in visited and depth < 64:
            visited.add(id(value))
            if isinstance(value, dict):
                children = [
                    (k, item, f"{where}.{path_key(k)}" if where else path_key(k), depth + 1)
                    for k, item in value.items()
                ]
            else:
                children = [(None, item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
            stack.extend(reversed(children))
    return errors


def _clean_text(document: Any) -> bool:
    """Whether ``text_errors`` would find nothing: its walk without the paths (a list's or a
    mapping's strings are judged where they are met, not pushed)."""
    visited: set[int] = set()
    stack: list[tuple[Any, int]] = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if text_problem(value):
                return False
            continue
        if not isinstance(value, dict | list) or id(value) in visited or depth >= 64:
            continue
        visited.add(id(value))
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and text_problem(key):
                    return False
            items = value.values()
        else:
            items = value
        nested = []
        for item in items:
            if isinstance(item, str):
                if text_problem(item):
                    return False
            elif isinstance(item, dict | list):
                nested.append((item, depth + 1))
        # In document order, as ``text_errors`` goes: a list or mapping met twice (YAML aliases)
        # is then first walked at the same depth by both, so both stop at 64 at the same place.
        stack.extend(reversed(nested))
    return True


def ascii_integer(text: str) -> int | None:
    """The integer ``text`` spells in ASCII digits (``[+-]?[0-9]+`` around blanks), or None.
    More than 18 digits is beyond every range of a spec: judged by its length and returned as
    ±10**18 without being converted (``int()`` of thousands of digits raises, and is slow)."""
    text = text.strip()
    if not _INTEGER.fullmatch(text):
        return None
    if len(text.lstrip("+-").lstrip("0")) > 18:
        return -_BEYOND if text.startswith("-") else _BEYOND
    return int(text)


def _shown(value: int) -> str:
    """A number as an error message may show it (huge ones are not printed: str() of more than
    4300 digits raises)."""
    return str(value) if -_BEYOND < value < _BEYOND else "a larger number"


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__
    )


def parse_memory(value: Any) -> int:
    """Bytes for ``256Gi``/``256G``/``512`` (MiB); raises ValueError with a readable reason."""
    if isinstance(value, bool):
        raise ValueError("must be a size such as 256Gi, not a boolean")
    if isinstance(value, int) and not -_BEYOND < value < _BEYOND:
        raise ValueError("is more memory than any node has (the limit is 1 PiB)")
    if isinstance(value, int | float):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a size such as 256Gi, not {_kind(value)}")
    match = _MEMORY.fullmatch(value) if len(value) <= 40 else None
    if not match:
        raise ValueError(f"'{value[:40]}' is not a size; use a number with K, M, G, T (binary), e.g. 256Gi")
    number, unit = float(match.group(1)), match.group(2).upper()
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size > MAX_MEMORY_BYTES:
        raise ValueError(f"'{value[:40]}' is more memory than any node has (the limit is 1 PiB)")
    return int(size)


def parse_cpus(value: Any) -> int:
    """Millicores for ``32``, ``0.5`` or ``500m``."""
    if isinstance(value, bool):
        raise ValueError("must be a number of CPUs, not a boolean")
    if isinstance(value, str):
        text = value.strip()
        millicores = ascii_integer(text[:-1]) if text.endswith("m") else None
        if millicores is not None:
            if not 0 <= millicores <= MAX_CPUS * 1000:
                raise ValueError(f"must be between 0 and {MAX_CPUS * 1000}m")
            return millicores
        if len(text) > _MAX_TEXT_NUMBER or not _DECIMAL.fullmatch(text):
            raise ValueError(f"'{text[:40]}' is not a number of CPUs (e.g. 32, 0.5 or 500m)")
        value = float(text)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"must be a finite number of CPUs, not {value!r:.40}")
    if not 0 <= value <= MAX_CPUS:
        raise ValueError(f"must be between 0 and {MAX_CPUS}")
    return round(value * 1000)


_SIM_SECONDS = re.compile(r"^\d{1,6}\.\d{1,3}s$")


def _sim_duration(value: Any) -> float:
    """A simulated job's run time: any duration, or seconds with a fraction (``0.5s``), so that
    benchmarks can run jobs shorter than a second."""
    if isinstance(value, str) and _SIM_SECONDS.fullmatch(value.strip()):
        return float(value.strip()[:-1])
    return parse_duration(value)


def parse_duration(value: Any) -> int:
    """Seconds for ``2h``, ``1-00:00:00``, ``PT2H`` or a bare number of minutes."""
    if isinstance(value, bool):
        raise ValueError("must be a duration such as 2h, not a boolean")
    if isinstance(value, int):
        return value * 60
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a duration such as 2h, 1-00:00:00 or PT2H, not {_kind(value)}")
    text = value.strip()
    if len(text) > _MAX_TEXT_NUMBER:  # every number in it then has few enough digits for int()
        raise ValueError(f"'{text[:40]}…' is too long for a duration; use e.g. 2h, 90m or 1-00:00:00")
    if _DURATION.fullmatch(text):
        seconds = {"d": 86400, "h": 3600, "m": 60, "s": 1}
        return sum(int(n) * seconds[u.lower()] for n, u in _DURATION_PARTS.findall(text))
    match = _SLURM_TIME.fullmatch(text)
    if match:
        days, a, b, c = match.groups()
        if days is not None:  # D-HH[:MM[:SS]]
            return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
        if c is not None:  # HH:MM:SS
            return int(a) * 3600 + int(b) * 60 + int(c)
        if b is not None:  # MM:SS
            return int(a) * 60 + int(b)
        return int(a) * 60  # MM
    match = _ISO_DURATION.fullmatch(text)
    if match and text.upper() not in {"P", "PT"}:
        d, h, m, s = (int(g or 0) for g in match.groups())
        return d * 86400 + h * 3600 + m * 60 + s
    raise ValueError(f"'{text[:40]}' is not a duration; use e.g. 2h, 90m, 1-00:00:00 or PT2H")


def parse_gpus(value: Any) -> GpuRequest:
    """A ``GpuRequest`` for ``"h100:8"``, ``"gpu:h100:8"``, ``"h100"``, ``{model, count}`` or 0;
    of any model for ``8``, ``"8"``, ``"gpu:8"``, ``"gpu"`` (one), ``{count}`` or ``{count,
    models}``. Problems in ``models`` raise ``FieldProblems`` naming the item."""
    if isinstance(value, bool):
        raise ValueError("must be like 'h100:8', 8 (any model) or {model: h100, count: 8}, not a boolean")
    if value is None or value == 0:
        return GpuRequest(None, 0)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"cannot be negative, got {_shown(value)}")
        return _gpu_request(None, value)
    if isinstance(value, dict):
        return _gpu_mapping(value)
    if not isinstance(value, str):
        raise ValueError(f"must be like 'h100:8' or 8 (any model), not {_kind(value)}")
    parts = [p.strip() for p in value.strip().split(":")]
    if parts[0].lower() == "gpu":
        if len(parts) == 1:
            return GpuRequest(None, 1)  # Slurm's --gres=gpu: one GPU of any model
        parts = parts[1:]
    if len(parts) == 1:
        count = ascii_integer(parts[0])
        return _gpu_request(parts[0], 1) if count is None else parse_gpus(count)
    if len(parts) == 2 and ascii_integer(parts[1]) is not None:
        return _gpu_request(parts[0], ascii_integer(parts[1]))
    if len(parts) in (2, 3) and MIG_PROFILE.fullmatch(parts[1].lower()):
        count = ascii_integer(parts[2]) if len(parts) == 3 else 1
        if count is not None:
            return _mig_request(parts[0], parts[1], count)
    raise ValueError(
        f"'{value[:40]}' is not a GPU request; use MODEL:COUNT (h100:8), MODEL:MIG-PROFILE[:COUNT] "
        "(a100:1g.10gb) or a count"
    )


def _mig_request(model: str, profile: str, count: int) -> GpuRequest:
    """``count`` MIG instances of ``profile`` on GPUs of ``model``."""
    profile = profile.strip().lower() if isinstance(profile, str) else ""
    if not MIG_PROFILE.fullmatch(profile):
        raise FieldProblems([(".mig", "must be a MIG profile such as 1g.10gb or 3g.40gb")])
    if count < 1:
        raise ValueError("a MIG request asks for at least one instance")
    request = _gpu_request(model, count)
    return GpuRequest(request.model, request.count, mig=profile)


def _gpu_mapping(value: dict[Any, Any]) -> GpuRequest:
    """``{model, count}``, ``{count}`` or ``{count, models}``."""
    unknown = set(value) - GPU_FIELDS
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(sorted(map(str, unknown)))}; use count, with model or models"
        )
    if "model" in value and "models" in value:
        raise FieldProblems([(".models", "give model (that model) or models (any of them), not both")])
    if not value:
        raise ValueError("give count (any model), with model or models to choose")
    count = value.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int):
        raise ValueError("count must be an integer")
    if "mig" in value and "model" not in value:
        raise FieldProblems([(".model", "a MIG request names its GPU model: {model: a100, mig: 1g.10gb}")])
    if "model" in value:
        model = value["model"]
        if not isinstance(model, str) or not model.strip():
            raise ValueError("model must be a GPU model name such as h100")
        if "mig" in value:
            return _mig_request(model, value["mig"], count)
        return _gpu_request(model, count)
    models = _gpu_models(value["models"]) if "models" in value else ()
    return _gpu_request(None, count, models)


def _gpu_models(value: Any) -> tuple[str, ...]:
    """The model names of an any-model request, best first, lowercased; every bad item named."""
    if not isinstance(value, list):
        raise FieldProblems([(".models", f"must be a list of GPU model names, not {_kind(value)}")])
    if len(value) > MAX_GPU_MODELS:
        raise FieldProblems([(".models", f"lists at most {MAX_GPU_MODELS} models")])
    problems: list[tuple[str, str]] = []
    names: list[str] = []
    for i, item in enumerate(value):
        name = item.strip().lower() if isinstance(item, str) else ""
        if not name or len(name) > 120 or not name.isprintable():
            problems.append((f".models[{i}]", "must be a GPU model name such as h100"))
        elif name in names:
            problems.append((f".models[{i}]", f"'{name}' is listed twice"))
        else:
            names.append(name)
    if problems:
        raise FieldProblems(problems)
    return tuple(names)


def _gpu_request(model: str | None, count: int, models: tuple[str, ...] = ()) -> GpuRequest:
    if count < 0:
        raise ValueError(f"count cannot be negative, got {_shown(count)}")
    if count > MAX_GPUS_PER_NODE:
        raise ValueError(f"count {_shown(count)} is more than {MAX_GPUS_PER_NODE} GPUs per node")
    if model is not None and (not model or len(model) > 120 or not model.isprintable()):
        raise ValueError("model must be a GPU model name such as h100")
    if not count:
        return GpuRequest(None, 0)
    return GpuRequest(model.strip().lower() if model is not None else None, count, models)


def parse_share(value: Any) -> float:
    """A fraction of a GPU: a number above 0 and at most 1 (``0.25``), or a percentage (``"25%"``)."""
    text = value.strip() if isinstance(value, str) else value
    percent = isinstance(text, str) and text.endswith("%")
    if percent:
        text = text[:-1].strip()
    if isinstance(text, str):
        number: Any = float(text) if len(text) <= _MAX_TEXT_NUMBER and _DECIMAL.fullmatch(text) else None
    else:
        number = text
    if isinstance(number, bool) or not isinstance(number, int | float) or number != number:
        raise ValueError("must be a fraction of a GPU such as 0.25 or 25%")
    share = number / 100 if percent else float(number)
    if not 0 < share <= 1:
        raise ValueError("must be above 0 and at most 1 (or 100%)")
    return share


def _gpu_fraction(c: _Collector, values: dict[str, Any], path: str) -> tuple[int, float | None]:
    """A fraction of a shareable GPU (``gpuMemory`` or ``gpuShare``): one GPU per node, whole
    GPUs' request otherwise unchanged."""
    memory, share, gpus = values["gpuMemory"], values["gpuShare"], values["gpus"]
    if not memory and share is None:
        return 0, None
    if memory and share is not None:
        c.add(f"{path}.gpuShare", "give gpuMemory or gpuShare, not both")
        return 0, None
    where = f"{path}.gpuMemory" if memory else f"{path}.gpuShare"
    if gpus.count != 1 or gpus.mig:
        c.add(where, "a fraction of a GPU goes with gpus: one GPU per node (e.g. gpus: a100), not MIG")
        return 0, None
    if memory:
        mb = -(-memory // 2**20)
        if not 0 < mb <= 10**7:
            c.add(where, "must be between 1Mi and about 10Ti")
            return 0, None
        return mb, None
    return 0, share


def parse_signal(value: Any) -> str:
    """The signal a preempted job asks for first: ``USR1`` for ``USR1``, ``SIGUSR1``, ``usr1``."""
    if not isinstance(value, str):
        raise ValueError(f"must be a signal name such as USR1, not {_kind(value)}")
    name = value.strip().upper().removeprefix("SIG")
    if name not in PREEMPTION_SIGNALS:
        choices = ", ".join(PREEMPTION_SIGNALS)
        raise ValueError(f"'{value[:40]}' is not a signal a job may ask for; use {choices}")
    return name


def parse_array(value: Any) -> tuple[list[int], int | None]:
    """The indices and the throttle of an array, as Slurm's ``--array`` writes them:
    ``"0-99"``, ``"0-99:4"`` (step), ``"1,3,5-7"``, each with an optional ``%N`` (at most N tasks
    run at once: ``"0-99%10"``); or ``{indices: "0-99", throttle: 10}``. An index is at most
    ``MAX_ARRAY_INDEX``, a throttle between 1 and ``MAX_ARRAY_SIZE``."""
    throttle: Any = None
    where = ""  # the throttle's place: spec.array itself, or its throttle key
    if isinstance(value, dict):
        unknown = sorted(str(k)[:40] for k in value if k not in ARRAY_FIELDS)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; use indices and throttle")
        if "indices" not in value:
            raise FieldProblems([(".indices", "is required, e.g. 0-99")])
        value, throttle, where = value["indices"], value.get("throttle"), ".throttle"
        if isinstance(value, str) and "%" in value:
            raise FieldProblems([(".indices", "give the throttle once, in throttle")])
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError("must be like '0-99', '0-99%10', '0-99:2' or '1,3,5'")
    if isinstance(value, int) and not 0 <= value <= MAX_ARRAY_INDEX:
        raise ValueError(f"index {_shown(value)} is out of range (0 to {MAX_ARRAY_INDEX})")
    text = str(value).replace(" ", "")
    if "%" in text:
        text, _, throttle = text.rpartition("%")
        number = ascii_integer(throttle) if len(throttle) <= _MAX_TEXT_NUMBER else None
        if number is None or not throttle.isdigit():
            raise ValueError(f"'%{throttle[:40]}' is not a throttle; use e.g. 0-99%10")
        throttle = number
    indices: set[int] = set()
    for part in text.split(","):
        if len(part) > _MAX_TEXT_NUMBER or not _ARRAY.fullmatch(part):
            raise ValueError(f"'{part[:40]}' is not an index range; use e.g. 0-99, 0-99:2 or 1,3,5")
        bounds, _, step = part.partition(":")
        first, _, last = bounds.partition("-")
        lo, hi, by = int(first), int(last or first), int(step or 1)
        if hi < lo or by < 1:
            raise ValueError(f"'{part}' is an empty range")
        if hi > MAX_ARRAY_INDEX:
            raise ValueError(f"index {_shown(hi)} is out of range (0 to {MAX_ARRAY_INDEX})")
        if (hi - lo) // by + 1 + len(indices) > MAX_ARRAY_SIZE:
            raise ValueError(f"an array has at most {MAX_ARRAY_SIZE} tasks")
        indices.update(range(lo, hi + 1, by))
    return sorted(indices), parse_throttle(throttle, where=where)


def parse_throttle(value: Any, *, where: str = "") -> int | None:
    """An array's throttle (Slurm's ``%N``): at most N of its tasks run at once; None (or 0):
    no throttle. Problems raise ``FieldProblems`` at ``where``."""
    if value is None:
        return None
    if isinstance(value, str) and ascii_integer(value) is not None:
        value = ascii_integer(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldProblems([(where, f"must be an integer (tasks at once), not {_kind(value)}")])
    if not 0 <= value <= MAX_ARRAY_SIZE:
        raise FieldProblems(
            [(where, f"must be between 0 (no throttle) and {MAX_ARRAY_SIZE}, got {_shown(value)}")]
        )
    return value or None


def parse_dependency(value: Any) -> tuple[tuple[str, str], ...]:
    """``(kind, reference)`` pairs for Slurm's ``"afterok:74:75_3,afterany:80,singleton"`` or the
    mapping ``{afterok: [74, "75_3"], afterany: [80], singleton: true}``; ``singleton`` has the
    reference ``""``. A reference is a job or array id (``74``) or one array member (``74_3``),
    in ASCII digits; duplicates are dropped, order is kept. Slurm's ``?`` (any of), ``after``
    (after the start), ``aftercorr`` and ``+time`` are refused by name. Problems inside the
    mapping raise ``FieldProblems`` naming the item (``.afterok[1]``)."""
    if isinstance(value, dict):
        pairs = _dependency_mapping(value)
    elif isinstance(value, str):
        pairs = _dependency_text(value)
    else:
        raise ValueError(f"must be like 'afterok:74:75_3,afterany:80' or a mapping, not {_kind(value)}")
    if sum(1 for kind, _ in pairs if kind != "singleton") > MAX_DEPENDENCY_REFS:
        raise ValueError(f"names at most {MAX_DEPENDENCY_REFS} jobs")
    return tuple(dict.fromkeys(pairs))


def _dependency_text(text: str) -> list[tuple[str, str]]:
    if len(text) > 20 * MAX_DEPENDENCY_REFS:
        raise ValueError(f"is too long; a dependency names at most {MAX_DEPENDENCY_REFS} jobs")
    if not text.strip():
        raise ValueError("is empty; leave it out when the job depends on nothing")
    if "?" in text:
        raise ValueError("'?' (any of) is not supported; separate dependencies with ',' (all must be met)")
    pairs: list[tuple[str, str]] = []
    for part in (p.strip() for p in text.split(",")):
        kind, _, refs = part.partition(":")
        kind = kind.strip().lower()
        if kind == "singleton":
            if refs:
                raise ValueError("singleton takes no job id: it waits for your earlier jobs of the same name")
            pairs.append(("singleton", ""))
            continue
        if kind not in DEPENDENCY_KINDS:
            raise ValueError(_unknown_kind(kind))
        if not refs:
            raise ValueError(f"'{part[:40]}' names no job; use e.g. {kind}:74 or {kind}:74_3")
        pairs += [(kind, job_ref(ref)) for ref in refs.split(":")]
    return pairs


def _dependency_mapping(value: dict[Any, Any]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    pairs: list[tuple[str, str]] = []
    for key, refs in value.items():
        kind = str(key).lower()
        if kind == "singleton":
            if not isinstance(refs, bool):
                problems.append((".singleton", f"must be true or false, not {_kind(refs)}"))
            elif refs:
                pairs.append(("singleton", ""))
            continue
        if kind not in DEPENDENCY_KINDS:
            problems.append((f".{path_key(key)}", _unknown_kind(kind)))
            continue
        items = refs if isinstance(refs, list) else [refs]
        if len(items) > MAX_DEPENDENCY_REFS:
            problems.append((f".{key}", f"names at most {MAX_DEPENDENCY_REFS} jobs"))
            continue
        for i, ref in enumerate(items):
            where = f".{key}[{i}]" if isinstance(refs, list) else f".{key}"
            try:
                pairs.append((kind, job_ref(ref)))
            except ValueError as exc:
                problems.append((where, str(exc)))
    if problems:
        raise FieldProblems(problems)
    return pairs


def _unknown_kind(kind: str) -> str:
    shown = f"'{kind[:40]}'" if kind else "an empty type"
    return f"{shown} is not a dependency type; use afterok, afterany, afternotok or singleton"


def job_ref(value: Any) -> str:
    """A job reference in its canonical form: ``"74"`` for ``74``, ``"074"`` or ``" 74 "``;
    ``"74_3"`` for an array member. Raises ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _BEYOND:
        return str(value)
    match = _JOB_REF.fullmatch(value.strip()) if isinstance(value, str) else None
    if not match or int(match.group(1)) == 0:
        shown = f"'{value[:40]}'" if isinstance(value, str) else _kind(value)
        raise ValueError(f"{shown} is not a job id; use a job or array id (74) or an array member (74_3)")
    job, member = match.groups()
    return str(int(job)) if member is None else f"{int(job)}_{int(member)}"


def parse_priority(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str) and value.strip().lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[value.strip().lower()]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be low, normal, high or an integer, not {value!r:.40}")
    low, high = PRIORITY_RANGE
    if not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}")
    return value


def _text_kept(parser: Any) -> Any:
    """``parser`` with its answers for short text kept: the specs of a batch mostly repeat their
    values (``h100:8``, ``256Gi``, ``2h``). Only immutable answers are kept; a refusal is not."""
    kept = functools.lru_cache(maxsize=1024)(parser)

    def parse(value: Any) -> Any:
        return kept(value) if type(value) is str and len(value) <= 256 else parser(value)

    return parse


_KEPT_PRIORITY = _text_kept(parse_priority)
_KEPT_DURATION = _text_kept(parse_duration)
_KEPT_SIM_DURATION = _text_kept(_sim_duration)
_KEPT_GPUS = _text_kept(parse_gpus)
_KEPT_CPUS = _text_kept(parse_cpus)
_KEPT_MEMORY = _text_kept(parse_memory)
_KEPT_SIGNAL = _text_kept(parse_signal)


def parse_job_spec(document: Any, *, path: str = "", text_checked: bool = False) -> JobSpec:
    """Validate and normalise one job document; raise ``SpecError`` listing every problem.
    ``text_checked``: the caller has refused every document with text that can be neither stored
    nor shown back (the API's JSON parser does, ``portal.api.parsers.check_document``)."""
    c = _Collector()
    p = f"{path}." if path else ""
    if not isinstance(document, dict):
        raise SpecError([(path or "(body)", f"must be a job spec (a mapping), not {_kind(document)}")])
    # Text that can be neither stored nor shown back is refused before anything else reads it:
    # later messages quote values and paths name keys.
    bad_text = [] if text_checked else text_errors(document, path)
    if bad_text:
        raise SpecError(bad_text)
    top = c.mapping(document, path, TOP_FIELDS)
    if top.get("apiVersion") != API_VERSION:
        c.add(f"{p}apiVersion", f"must be {API_VERSION}")
    if top.get("kind", "Job") != "Job":
        c.add(f"{p}kind", "must be Job")
    meta = c.mapping(top.get("metadata"), f"{p}metadata", METADATA_FIELDS)
    spec = c.mapping(top.get("spec"), f"{p}spec", SPEC_FIELDS)
    if "spec" not in top:
        c.add(f"{p}spec", "is required")

    name = c.string(meta.get("name"), f"{p}metadata.name", required=True, max_length=128)
    if name and not _NAME.fullmatch(name):
        c.add(f"{p}metadata.name", "use letters, digits, '.', '_' and '-', starting with a letter or digit")
    project = c.string(meta.get("project"), f"{p}metadata.project", max_length=63) or None
    labels = c.string_map(meta.get("labels"), f"{p}metadata.labels", _LABEL_KEY, "label")

    queue = c.string(spec.get("queue"), f"{p}spec.queue", max_length=63) or "default"
    if not _SLUG.fullmatch(queue):
        c.add(f"{p}spec.queue", "is not a queue name")
    values: dict[str, Any] = {}

    def convert(source: dict[str, Any], key: str, field_path: str, parser: Any, default: Any) -> None:
        if source.get(key) is None:
            values[key] = default
            return
        try:
            values[key] = parser(source[key])
        except FieldProblems as exc:
            for where, message in exc.problems:
                c.add(field_path + where, message)
            values[key] = default
        except ValueError as exc:
            c.add(field_path, str(exc))
            values[key] = default

    convert(spec, "priority", f"{p}spec.priority", _KEPT_PRIORITY, 0)
    convert(spec, "timeLimit", f"{p}spec.timeLimit", _KEPT_DURATION, None)
    convert(spec, "array", f"{p}spec.array", parse_array, None)
    resources = c.mapping(spec.get("resources"), f"{p}spec.resources", RESOURCE_FIELDS)
    convert(resources, "gpus", f"{p}spec.resources.gpus", _KEPT_GPUS, GpuRequest(None, 0))
    convert(resources, "cpus", f"{p}spec.resources.cpus", _KEPT_CPUS, 0)
    convert(resources, "memory", f"{p}spec.resources.memory", _KEPT_MEMORY, 0)
    convert(resources, "gpuMemory", f"{p}spec.resources.gpuMemory", _KEPT_MEMORY, 0)
    convert(resources, "gpuShare", f"{p}spec.resources.gpuShare", parse_share, None)
    gpu_memory_mb, gpu_share = _gpu_fraction(c, values, f"{p}spec.resources")
    nodes = c.integer(resources.get("nodes"), f"{p}spec.resources.nodes", default=1, low=1, high=MAX_NODES)
    for key, limit in (("cpus", 10**9), ("memory", 2**62)):
        if not 0 <= values[key] <= limit:
            c.add(f"{p}spec.resources.{key}", "cannot be negative" if values[key] < 0 else "is too large")
    time_limit = values["timeLimit"]
    if time_limit is not None and not 0 < time_limit <= MAX_TIME_LIMIT_S:
        c.add(f"{p}spec.timeLimit", f"must be more than 0 and at most {MAX_TIME_LIMIT_S // 86400} days")

    run = c.string(spec.get("run"), f"{p}spec.run", max_length=1_000_000)
    image = c.string(spec.get("image"), f"{p}spec.image", max_length=512)
    if not run.strip() and not image:
        c.add(f"{p}spec.run", "is required (a shell command), unless an image is given")
    setup = c.string(spec.get("setup"), f"{p}spec.setup", max_length=1_000_000)
    workdir = c.string(spec.get("workdir"), f"{p}spec.workdir", max_length=4096)
    env, secret_env = _environment(c, spec.get("env"), spec.get("secretEnv"), f"{p}spec")

    placement = c.mapping(spec.get("placement"), f"{p}spec.placement", PLACEMENT_FIELDS)
    clusters_raw = placement.get("clusters") or []
    clusters: list[str] = []
    if not isinstance(clusters_raw, list):
        c.add(f"{p}spec.placement.clusters", f"must be a list of cluster names, not {_kind(clusters_raw)}")
    else:
        for i, item in enumerate(clusters_raw):
            if isinstance(item, str) and _SLUG.fullmatch(item):
                clusters.append(item)
            else:
                c.add(f"{p}spec.placement.clusters[{i}]", "is not a cluster name")
    selector = c.string_map(
        placement.get("nodeSelector"), f"{p}spec.placement.nodeSelector", _LABEL_KEY, "label"
    )
    topology = placement.get("topology") or ""
    if topology not in ("", *TOPOLOGIES):
        c.add(f"{p}spec.placement.topology", f"must be one of {', '.join(TOPOLOGIES)}")
        topology = ""

    retries = c.integer(spec.get("retries"), f"{p}spec.retries", default=0, low=0, high=MAX_RETRIES)
    failover = spec.get("failover")
    if failover is None:
        failover = "requeue" if retries > 0 else "hold"
    elif failover not in FAILOVER_POLICIES:
        c.add(f"{p}spec.failover", f"must be one of {', '.join(FAILOVER_POLICIES)}")
        failover = "hold"

    sim = c.mapping(spec.get("sim"), f"{p}spec.sim", SIM_FIELDS)
    sim_duration = None
    if sim.get("duration") is not None:
        try:
            sim_duration = _KEPT_SIM_DURATION(sim["duration"])
        except ValueError as exc:
            c.add(f"{p}spec.sim.duration", str(exc))
        if sim_duration is not None and not 0 <= sim_duration <= MAX_SIM_DURATION_S:
            c.add(f"{p}spec.sim.duration", f"must be between 0 and {MAX_SIM_DURATION_S // 86400} days")
            sim_duration = None
    sim_exit = c.integer(sim.get("exitCode"), f"{p}spec.sim.exitCode", default=0, low=0, high=255)

    preemptible = spec.get("preemptible")
    if preemptible is None:
        preemptible = True
    elif not isinstance(preemptible, bool):
        c.add(f"{p}spec.preemptible", f"must be true or false, not {_kind(preemptible)}")
        preemptible = True
    preemption = c.mapping(spec.get("preemption"), f"{p}spec.preemption", PREEMPTION_FIELDS)
    convert(preemption, "signal", f"{p}spec.preemption.signal", _KEPT_SIGNAL, PREEMPTION_SIGNALS[0])
    convert(preemption, "grace", f"{p}spec.preemption.grace", _KEPT_DURATION, None)
    convert(spec, "dependency", f"{p}spec.dependency", parse_dependency, ())
    grace = values["grace"]
    if grace is not None and not 0 <= grace <= MAX_PREEMPTION_GRACE_S:
        c.add(
            f"{p}spec.preemption.grace",
            f"must be between 0s and {MAX_PREEMPTION_GRACE_S // 60}m (a bare number is minutes; "
            "write seconds as e.g. 30s)",
        )
        grace = None

    indices, throttle = values["array"] or (None, None)
    if name and indices and len(name) + len(f"-{indices[-1]}") > 128:
        c.add(f"{p}metadata.name", "is too long for an array: NAME-INDEX must fit in 128 characters")
    if c.errors:
        raise SpecError(c.errors)
    return JobSpec(
        name=name,
        project=project,
        labels=labels,
        queue=queue,
        priority=values["priority"],
        nodes=nodes,
        gpus=values["gpus"],
        cpu_millicores=values["cpus"],
        memory_bytes=values["memory"],
        time_limit_s=time_limit,
        run=run,
        setup=setup,
        image=image,
        env=env,
        secret_env=secret_env,
        workdir=workdir,
        clusters=clusters,
        node_selector=selector,
        retries=retries,
        dependency=values["dependency"],
        failover=failover,
        array=indices,
        array_throttle=throttle,
        sim_duration_s=sim_duration,
        sim_exit_code=sim_exit,
        preemptible=preemptible,
        preemption_signal=values["signal"],
        preemption_grace_s=grace,
        document=document,
        gpu_memory_mb=gpu_memory_mb,
        gpu_share=gpu_share,
        topology=topology,
    )
