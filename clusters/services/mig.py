"""MIG layouts an operator asks for: what a GPU may be partitioned into.

A layout is a list of profiles (``["3g.40gb", "2g.20gb", "2g.20gb"]``; ``[]`` turns MIG off).
NVIDIA's A100 and H100 have 7 compute slices and up to 7 instances; a layout that asks for more
than that can never be applied, so it is refused when it is set, not when an agent tries it.
Whether a profile exists on a given model is the GPU's to say: the agent reports what it applied.
"""

from __future__ import annotations

import re
from typing import Any

from django.core.exceptions import ValidationError

PROFILE = re.compile(r"^([1-8])g\.[0-9]{1,4}gb(\+[a-z0-9]{1,8})?$", re.ASCII)
MAX_SLICES = 7
MAX_INSTANCES = 7


def check_mig_layout(value: Any) -> list[str] | None:
    """The layout as stored (profiles lowercased), or None to leave the layout as it is; raises
    ``ValidationError`` saying what is wrong."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValidationError(
            'A MIG layout is a list of profiles, e.g. ["3g.40gb", "3g.40gb"] ([] turns MIG off).'
        )
    profiles = []
    for i, item in enumerate(value):
        profile = item.strip().lower() if isinstance(item, str) else ""
        if not PROFILE.fullmatch(profile):
            raise ValidationError(f"Item {i + 1} is not a MIG profile such as 1g.10gb or 3g.40gb.")
        profiles.append(profile)
    slices = sum(int(PROFILE.fullmatch(p).group(1)) for p in profiles)  # type: ignore[union-attr]
    if len(profiles) > MAX_INSTANCES or slices > MAX_SLICES:
        raise ValidationError(
            f"A GPU holds at most {MAX_INSTANCES} instances and {MAX_SLICES} compute slices; "
            f"this layout asks for {len(profiles)} instances and {slices} slices."
        )
    return profiles
