"""Resource quantities in the canonical form kube-apiserver stores them (``3749519360Ki`` → ``3661640Mi``).

The server re-serializes every quantity it stores: binary suffixes move to the largest one that keeps
an integer mantissa, decimal ones to the largest multiple of 10³ (``1000`` → ``1k``, ``0.5`` → ``500m``).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {v: k for k, v in _DECIMAL.items()}
_BINARY_SUFFIX = {v: k for k, v in _BINARY.items()}
_PATTERN = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")


def parse(text: str) -> tuple[Fraction, str] | None:
    """(value, format) with format ``binary``/``decimal``/``exponent``, or None if not a quantity."""
    match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
    if not match:
        return None
    number = Fraction(match.group(1))
    suffix = match.group(2) or ""
    if suffix in _BINARY:
        return number * (1 << _BINARY[suffix]), "binary"
    if suffix in _DECIMAL:
        return number * Fraction(10) ** _DECIMAL[suffix], "decimal"
    return number * Fraction(10) ** int(suffix[1:]), "exponent"


def canonical(text: str) -> str:
    """The server's canonical spelling of a quantity; anything unparsable is returned unchanged."""
    parsed = parse(text)
    if parsed is None:
        return text
    value, fmt = parsed
    if value == 0:
        return "0"
    if fmt == "binary" and value.denominator == 1 and abs(value) >= 1024:
        shift = 0
        while shift < 60 and (value / (1 << (shift + 10))).denominator == 1:
            shift += 10
        return f"{int(value / (1 << shift))}{_BINARY_SUFFIX.get(shift, '')}" if shift else str(int(value))
    # decimal (and small or fractional binary): the largest 10^(3k) with an integer mantissa
    exponent = -9
    while (value / Fraction(10) ** exponent).denominator != 1 and exponent < 0:
        exponent += 3
    if (value / Fraction(10) ** exponent).denominator != 1:
        exponent = -9  # rounds like the server would not; good enough for test data
    while exponent < 18 and (value / Fraction(10) ** (exponent + 3)).denominator == 1:
        exponent += 3
    mantissa = value / Fraction(10) ** exponent
    if fmt == "exponent":
        return f"{int(mantissa)}e{exponent}" if exponent else str(int(mantissa))
    return f"{int(mantissa)}{_DECIMAL_SUFFIX[exponent]}"


def canonical_map(resources: dict | None) -> dict | None:
    """Every value of a ``{resource: quantity}`` map canonicalised (None stays None)."""
    if not isinstance(resources, dict):
        return resources
    return {key: canonical(value) if isinstance(value, str) else value for key, value in resources.items()}


def is_integer(text: str) -> bool:
    parsed = parse(text)
    return parsed is not None and parsed[0].denominator == 1
