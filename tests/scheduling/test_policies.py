"""The registry and profiles: what runs where, and clear start-up errors."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from django.core.exceptions import ImproperlyConfigured

from scheduling.engine.cycle.decide import select
from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.engine.registry import REGISTRY
from tests.scheduling.snapshots import job, node, snapshot, state


class PreferLastRow:
    """A dummy Score plugin: proves a new policy is one small class."""

    name: ClassVar[str] = "prefer_last_row"

    def __init__(self, bonus: float = 1.0) -> None:
        self.bonus = bonus

    def score(self, state, snap, job, rows):
        return self.bonus * rows / max(len(snap) - 1, 1)


def test_default_profile_sorts_plugins_into_extension_points():
    profile = build_profile(DEFAULT_PROFILE)
    assert [p.name for p in profile.queue_sort] == ["priority", "fair_share"]
    assert [p.name for p in profile.pre_filter] == [
        "user_limits",
        "array_throttle",
        "quota",
        "gang",
        "backfill",
    ]
    assert [p.name for p in profile.filter] == [
        "node_state",
        "gpu_model",
        "cluster_affinity",
        "selectors",
        "resources_fit",
        "backfill",
    ]
    assert [(p.name, w) for p, w in profile.score] == [("binpack", 1.0)]
    assert [p.name for p in profile.reserve] == ["quota", "fair_share", "backfill"] or [
        p.name for p in profile.reserve
    ] == ["fair_share", "quota", "backfill"]
    assert [p.name for p in profile.post_filter] == ["quota", "preemption", "backfill"]


def test_a_registered_plugin_takes_part_with_its_weight_and_arguments():
    registry = REGISTRY | {"prefer_last_row": PreferLastRow}
    config = {
        "plugins": ["node_state", "resources_fit", "prefer_last_row"],
        "weights": {"prefer_last_row": 2.0},
        "args": {"prefer_last_row": {"bonus": 0.5}},
    }
    profile = build_profile(config, registry)
    ((plugin, weight),) = profile.score
    assert (plugin.name, weight, plugin.bonus) == ("prefer_last_row", 2.0, 0.5)
    snap = snapshot(node(), node(), node())
    placement = select(profile, state(), snap, job(gpus=1), np.ones(3, dtype=bool))
    assert placement.nodes[0].row == 2  # the dummy's preference decided


@pytest.mark.parametrize(
    "config, words",
    [
        ({"plugins": ["node_state", "teleport"]}, "unknown plugin(s) ['teleport']"),
        ({"plugins": ["node_state"], "weights": {"binpack": 1}}, "weights for plugins not in the profile"),
        ({"plugins": ["node_state"], "args": {"node_state": {"x": 1}}}, "bad arguments for node_state"),
        ({"plugins": ["node_state", "binpack"], "weights": {"binpack": -1}}, "weight of binpack"),
        ({"plugins": ["binpack"]}, "at least one filter plugin"),
        ({"plugins": ["node_state", "node_state"]}, "listed twice"),
        ({"plugins": ["node_state"], "weights": {"node_state": 2}}, "weights for plugins that do not score"),
        ({"plugins": ["node_state"], "wieghts": {}}, "unknown key(s)"),
    ],
    ids=[
        "unknown-plugin",
        "stray-weight",
        "bad-args",
        "negative-weight",
        "no-filter",
        "twice",
        "not-scoring",
        "typo",
    ],
)
def test_bad_profiles_fail_at_start_up(config, words):
    with pytest.raises(ImproperlyConfigured) as exc:
        build_profile(config)
    assert words in str(exc.value)


def test_registry_keys_are_plugin_names():
    assert all(cls.name == key for key, cls in REGISTRY.items())


class HalfAFilter:
    name: ClassVar[str] = "half_a_filter"

    def filter(self, state, snap, job, rows):
        return rows >= 0


def test_a_plugin_missing_part_of_its_extension_point_is_refused():
    with pytest.raises(ImproperlyConfigured, match="half_a_filter implements no extension point"):
        build_profile({"plugins": ["node_state", "half_a_filter"]}, REGISTRY | {"half_a_filter": HalfAFilter})
