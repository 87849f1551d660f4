"""Job references as users write them, Slurm's way, with no database.

* ``74``: job 74 — and, when 74 is the id of an array (its first member's job id, as Slurm's
  ``ArrayJobId``), an action on it acts on the whole array (``scancel 74``);
* ``74_3``: member 3 of array 74;
* ``74_[1-5]``, ``74_[1,3,7-9]``: those members of array 74 (a range: for actions and updates).

``parse_ref`` is strict: ASCII digits only, ids and indices within what the database stores,
at most ``MAX_REF_LENGTH`` characters; anything else raises ``ValueError`` (the URL routes then
answer 404). ``compact`` writes indices back the same way (``4-7,9``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from scheduling.spec import MAX_ARRAY_INDEX

MAX_JOB_ID = 2**63 - 1  # a bigint
MAX_REF_LENGTH = 256
MAX_SPANS = 100  # ranges in one bracket
# What a URL route accepts; ``parse_ref`` then checks the numbers.
PATTERN = r"[0-9]{1,19}(?:_(?:[0-9]{1,7}|\[[0-9,\-]{1,250}\]))?"
_REF = re.compile(r"(?P<id>[0-9]+)(?:_(?:(?P<index>[0-9]+)|\[(?P<spans>[0-9,\-]+)\]))?", re.ASCII)
_SPAN = re.compile(r"([0-9]+)(?:-([0-9]+))?", re.ASCII)


@dataclass(frozen=True)
class JobRef:
    """A parsed reference. ``spans`` is None for a bare id; one ``(i, i)`` span for ``74_3``
    (``ranged`` False); the inclusive ``(low, high)`` spans of a bracket, sorted and merged."""

    job_id: int
    spans: tuple[tuple[int, int], ...] | None = None
    ranged: bool = False

    @property
    def index(self) -> int | None:
        """The member's index for ``74_3``; None otherwise."""
        return self.spans[0][0] if self.spans is not None and not self.ranged else None

    @property
    def single(self) -> bool:
        """Names one job: a bare id or one member (a bare id may still stand for its array in
        an action)."""
        return not self.ranged

    def __str__(self) -> str:
        if self.spans is None:
            return str(self.job_id)
        if not self.ranged:
            return f"{self.job_id}_{self.spans[0][0]}"
        return f"{self.job_id}_[{format_spans(self.spans)}]"


def parse_ref(text: str) -> JobRef:
    """The ``JobRef`` ``text`` spells; raises ``ValueError`` saying why not."""
    if not isinstance(text, str) or len(text) > MAX_REF_LENGTH:
        raise ValueError("a job reference is at most 256 characters")
    match = _REF.fullmatch(text.strip())
    if not match:
        raise ValueError(f"'{text[:40]}' is not a job reference; use e.g. 74, 74_3 or 74_[1-5,9]")
    job_id = _number(match["id"], MAX_JOB_ID, "job id")
    if job_id < 1:
        raise ValueError("job ids start at 1")
    if match["index"] is not None:
        index = _number(match["index"], MAX_ARRAY_INDEX, "array index")
        return JobRef(job_id, ((index, index),))
    if match["spans"] is None:
        return JobRef(job_id)
    parts = match["spans"].split(",")
    if len(parts) > MAX_SPANS:
        raise ValueError(f"at most {MAX_SPANS} ranges in one reference")
    spans = []
    for part in parts:
        found = _SPAN.fullmatch(part)
        if not found:
            raise ValueError(f"'{part[:40]}' is not an index or a range of indices (e.g. 1-5)")
        low = _number(found[1], MAX_ARRAY_INDEX, "array index")
        high = _number(found[2], MAX_ARRAY_INDEX, "array index") if found[2] else low
        if high < low:
            raise ValueError(f"'{part}' is an empty range")
        spans.append((low, high))
    return JobRef(job_id, merge_spans(spans), ranged=True)


def _number(digits: str, high: int, what: str) -> int:
    if len(digits.lstrip("0")) > len(str(high)) or int(digits) > high:
        raise ValueError(f"{what} {digits[:20]} is out of range")
    return int(digits)


def merge_spans(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Inclusive spans sorted, with overlapping and adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for low, high in sorted(spans):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    return tuple(merged)


def format_spans(spans: Iterable[tuple[int, int]]) -> str:
    """``1-5,7,9-10`` for ``[(1, 5), (7, 7), (9, 10)]``."""
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in spans)


def array_label(array_id: int, spans: Iterable[tuple[int, int]], throttle: int | None = None) -> str:
    """squeue's name for members of an array shown as one row: ``74_[4-99%10]`` (``74_5`` for
    one member without a throttle)."""
    spans = tuple(spans)
    text = format_spans(spans) + (f"%{throttle}" if throttle else "")
    if len(spans) == 1 and spans[0][0] == spans[0][1] and not throttle:
        return f"{array_id}_{text}"
    return f"{array_id}_[{text}]"
