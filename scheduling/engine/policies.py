"""Profiles: which plugins run, with which weights and arguments (``ORRERY_SCHEDULER_PROFILE``).

    ORRERY_SCHEDULER_PROFILE = {
        "plugins": ["priority", "fair_share", "user_limits", "array_throttle", "quota", "gang",
                    "node_state", "gpu_model", "cluster_affinity", "selectors", "resources_fit",
                    "preemption", "backfill", "binpack"],
        "weights": {"binpack": 1.0},
        "args": {},
    }

The order of ``plugins`` is the order each extension point runs them in (queue-sort keys are
compared in that order). A plugin takes part in every extension point its class implements.
An unknown plugin, weight or argument is an ``ImproperlyConfigured`` error at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from scheduling.engine.framework import (
    FilterPlugin,
    PostFilterPlugin,
    PreFilterPlugin,
    QueueSortPlugin,
    ReservePlugin,
    ScorePlugin,
)
from scheduling.engine.registry import REGISTRY

DEFAULT_PROFILE: dict[str, Any] = {
    "plugins": [
        "priority",
        "fair_share",
        "user_limits",  # limits first: a job its owner may not run now claims no quota
        "array_throttle",
        "quota",
        "gang",
        "node_state",
        "gpu_model",
        "cluster_affinity",
        "selectors",
        "resources_fit",
        "preemption",
        "backfill",
        "binpack",
    ],
    "weights": {"binpack": 1.0},
    "args": {},
}


@dataclass(frozen=True)
class Profile:
    """The plugins of each extension point, in profile order; scorers with their weights."""

    queue_sort: tuple[QueueSortPlugin, ...] = ()
    pre_filter: tuple[PreFilterPlugin, ...] = ()
    filter: tuple[FilterPlugin, ...] = ()
    score: tuple[tuple[ScorePlugin, float], ...] = ()
    reserve: tuple[ReservePlugin, ...] = ()
    post_filter: tuple[PostFilterPlugin, ...] = ()
    names: tuple[str, ...] = field(default=())


def build_profile(config: dict[str, Any], registry: dict[str, type] | None = None) -> Profile:
    registry = REGISTRY if registry is None else registry
    unknown_keys = set(config) - {"plugins", "weights", "args"}
    if unknown_keys:
        raise ImproperlyConfigured(f"scheduler profile: unknown key(s) {sorted(unknown_keys)}")
    names = list(config.get("plugins") or [])
    if len(set(names)) != len(names):
        raise ImproperlyConfigured("scheduler profile: a plugin is listed twice")
    missing = [n for n in names if n not in registry]
    if missing:
        raise ImproperlyConfigured(
            f"scheduler profile: unknown plugin(s) {missing}; known: {', '.join(sorted(registry))}"
        )
    weights = dict(config.get("weights") or {})
    args = dict(config.get("args") or {})
    for what, mapping in (("weights", weights), ("args", args)):
        stray = set(mapping) - set(names)
        if stray:
            raise ImproperlyConfigured(
                f"scheduler profile: {what} for plugins not in the profile: {sorted(stray)}"
            )
    plugins = []
    for name in names:
        try:
            plugins.append(registry[name](**args.get(name, {})))
        except TypeError as exc:
            raise ImproperlyConfigured(f"scheduler profile: bad arguments for {name}: {exc}") from None
    points = (QueueSortPlugin, PreFilterPlugin, FilterPlugin, ScorePlugin, ReservePlugin, PostFilterPlugin)
    for plugin in plugins:
        if not any(isinstance(plugin, point) for point in points):
            raise ImproperlyConfigured(
                f"scheduler profile: {plugin.name} implements no extension point completely "
                "(a Filter needs filter() and explain(), a Reserve reserve() and unreserve())"
            )
    not_scoring = [
        n for n, p in zip(names, plugins, strict=True) if n in weights and not isinstance(p, ScorePlugin)
    ]
    if not_scoring:
        raise ImproperlyConfigured(f"scheduler profile: weights for plugins that do not score: {not_scoring}")
    scorers = []
    for plugin in plugins:
        if isinstance(plugin, ScorePlugin):
            weight = weights.get(plugin.name, 1.0)
            if not isinstance(weight, int | float) or weight < 0:
                raise ImproperlyConfigured(f"scheduler profile: weight of {plugin.name} must be a number ≥ 0")
            scorers.append((plugin, float(weight)))
    if not any(isinstance(p, FilterPlugin) for p in plugins):
        raise ImproperlyConfigured("scheduler profile: at least one filter plugin is needed")
    return Profile(
        queue_sort=tuple(p for p in plugins if isinstance(p, QueueSortPlugin)),
        pre_filter=tuple(p for p in plugins if isinstance(p, PreFilterPlugin)),
        filter=tuple(p for p in plugins if isinstance(p, FilterPlugin)),
        score=tuple(scorers),
        reserve=tuple(p for p in plugins if isinstance(p, ReservePlugin)),
        post_filter=tuple(p for p in plugins if isinstance(p, PostFilterPlugin)),
        names=tuple(names),
    )


_profile: Profile | None = None


def active_profile() -> Profile:
    global _profile
    if _profile is None:
        _profile = build_profile(settings.ORRERY_SCHEDULER_PROFILE or DEFAULT_PROFILE)
    return _profile
