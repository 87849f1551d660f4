"""Quantities as people read them: memory in KiB…TiB, power in W or kW, durations as ``4h`` or
``1d 2h 30m``. One place, used by the portal's templates, the console and event messages, so a
quantity reads the same wherever it is shown. Pure functions of numbers; None is "—"."""

from __future__ import annotations

MISSING = "—"
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_SPANS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def _number(value: float) -> str:
    """At most one decimal, none when it is whole: 512, 1.5, 0.3."""
    return f"{value:.1f}".removesuffix(".0")


def memory_text(n_bytes: float | None) -> str:
    """``80 GiB``, ``1.5 TiB``, ``512 MiB``; a few bytes as ``12 B``."""
    if n_bytes is None:
        return MISSING
    for unit, size in _BINARY:
        if abs(n_bytes) >= size:
            return f"{_number(n_bytes / size)} {unit}"
    return f"{int(n_bytes)} B"


def power_text(watts: float | None) -> str:
    """``350 W``; ``5.6 kW`` from a kilowatt on."""
    if watts is None:
        return MISSING
    if abs(watts) >= 1000:
        return f"{_number(watts / 1000)} kW"
    return f"{round(watts)} W"


def duration_text(seconds: float | None) -> str:
    """Every non-zero unit of a whole number of seconds, largest first: ``4h``, ``1d 2h``,
    ``2h 30m``, ``45s``; ``0s`` for nothing. Exact, so a time limit reads as it was set."""
    if seconds is None:
        return MISSING
    left, parts = int(seconds), []
    if left < 0:
        return "-" + duration_text(-left)
    for unit, size in _SPANS:
        count, left = divmod(left, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts) or "0s"


def clock_text(seconds: float | None) -> str:
    """Time used, as a running clock: ``0:42``, ``2:30:00``, ``1-02:00:00`` (Slurm's form)."""
    if seconds is None:
        return MISSING
    total = max(int(seconds), 0)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"
