"""``{% load units %}``: the filters that put units on quantities in every page (the portal's and
the console's), from ``foundation.units``."""

from __future__ import annotations

from django import template

from foundation import units

register = template.Library()


@register.filter
def memory(n_bytes: float | None) -> str:
    """Bytes → ``80 GiB``."""
    return units.memory_text(n_bytes)


@register.filter
def mebibytes(n_mib: float | None) -> str:
    """MiB (what GPUs report) → ``79.6 GiB``."""
    return units.memory_text(None if n_mib is None else n_mib * 2**20)


@register.filter
def power(watts: float | None) -> str:
    """Watts → ``350 W``."""
    return units.power_text(watts)


@register.filter
def duration(seconds: float | None) -> str:
    """Seconds → ``4h``, ``1d 2h`` (a time limit); None → ``none``."""
    return "none" if seconds is None else units.duration_text(seconds)


@register.filter
def clock(seconds: float | None) -> str:
    """Seconds → ``2:30:00`` (time used)."""
    return units.clock_text(seconds)


@register.filter
def cores(millicores: int | None) -> str:
    """Millicores → ``8``, ``0.5`` (CPUs)."""
    return units.MISSING if millicores is None else f"{millicores / 1000:g}"
