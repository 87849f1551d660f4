"""Quantities with their units, as every page and message shows them."""

from __future__ import annotations

import pytest

from foundation.units import clock_text, duration_text, memory_text, power_text


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (14400, "4h"),
        (93600, "1d 2h"),
        (9000, "2h 30m"),
        (3661, "1h 1m 1s"),
        (45, "45s"),
        (0, "0s"),
        (None, "—"),
    ],
    ids=["hours", "days-hours", "hours-minutes", "every-unit", "seconds", "zero", "none"],
)
def test_durations(seconds, shown):
    assert duration_text(seconds) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(42, "0:42"), (9000, "2:30:00"), (93600, "1-02:00:00"), (-5, "0:00")],
    ids=["seconds", "hours", "days", "negative"],
)
def test_clocks(seconds, shown):
    assert clock_text(seconds) == shown


@pytest.mark.parametrize(
    ("n_bytes", "shown"),
    [
        (80 * 2**30, "80 GiB"),
        (1536 * 2**30, "1.5 TiB"),
        (512 * 2**20, "512 MiB"),
        (12, "12 B"),
        (None, "—"),
    ],
    ids=["gib", "tib", "mib", "bytes", "none"],
)
def test_memory(n_bytes, shown):
    assert memory_text(n_bytes) == shown


@pytest.mark.parametrize(
    ("watts", "shown"), [(349.6, "350 W"), (5600, "5.6 kW"), (None, "—")], ids=["w", "kw", "none"]
)
def test_power(watts, shown):
    assert power_text(watts) == shown
