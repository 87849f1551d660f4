"""Load-aware and energy-aware scores, table-driven on tiny snapshots, and load-aware placement
through a whole cycle against the database."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from clusters.models import GpuDevice
from scheduling.choices import JobState
from scheduling.engine import policies
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.engine.plugins.energy import NEUTRAL as ENERGY_NEUTRAL
from scheduling.engine.plugins.energy import Energy
from scheduling.engine.plugins.load_aware import NEUTRAL, LoadAware
from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.models import Allocation
from tests.factories import make_cluster, make_job, make_node
from tests.scheduling.snapshots import job, node, snapshot, state

NOW = 10_000.0
FRESH = NOW - 60  # a minute old: trusted
STALE = NOW - 600  # ten minutes old: past the default 180 s


def load_scores(plugin: LoadAware, *nodes) -> list[float]:
    snap = snapshot(*nodes)
    return [round(float(s), 4) for s in plugin.score(state(now=NOW), snap, job(), snap.all_rows)]


# --- load_aware -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "plugin, nodes, expected",
    [
        (
            LoadAware(),
            [node(util=50, mem_used=0.5, temp=42.5, seen=FRESH)],
            [0.5],  # every term 0.5 (42.5 °C is half of 85)
        ),
        (
            LoadAware(),
            [
                node(util=0, mem_used=0.0, temp=0, seen=FRESH),
                node(util=100, mem_used=1.0, temp=84, seen=FRESH),
            ],
            [1.0, round((0 + 0 + 1 / 85) / 3, 4)],
        ),
        (
            LoadAware(),
            [
                node(util=10, mem_used=0.1, temp=45, seen=FRESH),
                node(util=10, mem_used=0.1, temp=85, seen=FRESH),
            ],
            [round((0.9 + 0.9 + 40 / 85) / 3, 4), 0.0],  # at the threshold: a hot spot, 0
        ),
        (
            LoadAware(),
            [node(util=95, mem_used=0.9, temp=95, seen=STALE), node(seen=0.0)],
            [NEUTRAL, NEUTRAL],  # stale and never reported: neutral, not hot and not cool
        ),
        (
            LoadAware(),
            [node(util=0, seen=FRESH)],  # memory and temperature unknown: neutral on those terms
            [round((1.0 + NEUTRAL + NEUTRAL) / 3, 4)],
        ),
        (
            LoadAware(stale_after_s=900),
            [node(util=100, mem_used=1.0, temp=20, seen=STALE)],  # ten minutes is fresh enough here
            [round((0 + 0 + 1 - 20 / 85) / 3, 4)],
        ),
        (
            LoadAware(utilisation=0, memory=0),
            [
                node(util=100, mem_used=1.0, temp=17, seen=FRESH),
                node(util=0, mem_used=0.0, temp=17, seen=FRESH),
            ],
            [0.8, 0.8],  # only temperature counts
        ),
        (
            LoadAware(temperature=0),
            [node(util=20, mem_used=0.2, temp=99, seen=FRESH)],
            [0.8],  # temperature weighs nothing: a hot node is not a hot spot
        ),
        (
            LoadAware(utilisation=3, memory=1, temperature=0),
            [node(util=40, mem_used=0.0, seen=FRESH)],
            [round((3 * 0.6 + 1 * 1.0) / 4, 4)],
        ),
        (
            LoadAware(hot_temperature_c=70),
            [
                node(util=0, mem_used=0.0, temp=75, seen=FRESH),
                node(util=0, mem_used=0.0, temp=35, seen=FRESH),
            ],
            [0.0, round((1 + 1 + 0.5) / 3, 4)],
        ),
        (
            LoadAware(),
            [node(util=250, mem_used=-3.0, temp=-40, seen=FRESH)],  # out-of-range readings are clipped
            [round((0 + 1 + 1) / 3, 4)],
        ),
    ],
    ids=[
        "halfway",
        "idle-vs-busy",
        "hot-spot-scores-0",
        "stale-and-unknown-neutral",
        "partly-unknown",
        "stale-after-arg",
        "weights-0-turn-terms-off",
        "temperature-off",
        "weighted-mean",
        "hot-threshold-arg",
        "hostile-readings",
    ],
)
def test_load_aware_scores(plugin, nodes, expected):
    assert load_scores(plugin, *nodes) == expected


def test_load_aware_prefers_the_cool_node_of_two_otherwise_equal():
    scores = load_scores(
        LoadAware(),
        node(util=90, mem_used=0.8, temp=88, seen=FRESH),
        node(util=30, mem_used=0.3, temp=50, seen=FRESH),
        node(util=30, mem_used=0.3, temp=50, seen=STALE),
    )
    assert scores[1] > scores[2] > scores[0]  # cool, then the one not trusted, then the hot spot


def test_load_aware_answers_for_the_rows_asked_and_keeps_the_fleet_scores_for_the_cycle():
    snap = snapshot(node(util=0, mem_used=0.0, temp=0, seen=FRESH), node(seen=0.0))
    plugin, cycle = LoadAware(), state(now=NOW)
    assert plugin.score(cycle, snap, job(), np.array([1, 0])).tolist() == [NEUTRAL, 1.0]
    snap.util[0] = 100  # telemetry is read between cycles, never within one
    assert plugin.score(cycle, snap, job(), np.array([0])).tolist() == [1.0]
    assert plugin.score(state(now=NOW), snap, job(), np.array([0])).tolist() == [2 / 3]


# --- energy -----------------------------------------------------------------------------------
def energy_scores(plugin: Energy, snap) -> list[float]:
    return [round(float(s), 4) for s in plugin.score(state(), snap, job(), snap.all_rows)]


ONLY = {  # one term at a time
    "performance_per_watt": Energy(price=0, carbon=0, consolidation=0),
    "price": Energy(performance_per_watt=0, carbon=0, consolidation=0),
    "carbon": Energy(performance_per_watt=0, price=0, consolidation=0),
    "consolidation": Energy(performance_per_watt=0, price=0, carbon=0),
}


@pytest.mark.parametrize(
    "plugin, snap, expected",
    [
        (
            ONLY["performance_per_watt"],
            snapshot(node(model=0), node(model=1), perf_per_watt=[2.5 / 700, 1.0 / 400]),
            [1.0, round((1.0 / 400) / (2.5 / 700), 4)],
        ),
        (
            ONLY["performance_per_watt"],
            snapshot(node(model=0), node(model=1), perf_per_watt=[0.004, 0.0]),  # 0: no TDP known
            [1.0, ENERGY_NEUTRAL],
        ),
        (
            ONLY["performance_per_watt"],
            snapshot(node(model=0), node(model=1)),  # nothing known anywhere
            [ENERGY_NEUTRAL, ENERGY_NEUTRAL],
        ),
        (
            ONLY["price"],
            snapshot(node(cluster=0), node(cluster=1), price=[0.10, 0.30]),
            [1.0, round(1 - 0.2 / 0.3, 4)],
        ),
        (
            ONLY["price"],
            snapshot(node(cluster=0), node(cluster=1), price=[0.10, np.nan]),
            [1.0, ENERGY_NEUTRAL],
        ),
        (
            ONLY["price"],
            snapshot(node(cluster=0), node(cluster=1), price=[0.0, 0.0]),  # free energy everywhere
            [1.0, 1.0],
        ),
        (
            ONLY["carbon"],
            snapshot(node(cluster=0), node(cluster=1), carbon=[400, 50]),
            [round(1 - 350 / 400, 4), 1.0],
        ),
        (
            ONLY["carbon"],
            snapshot(node(cluster=0), node(cluster=1), carbon=[np.nan, np.nan]),
            [ENERGY_NEUTRAL, ENERGY_NEUTRAL],
        ),
        (
            ONLY["consolidation"],
            snapshot(node(free=8), node(free=5), node(free=0)),
            [0.0, 1.0, 1.0],
        ),
        (
            Energy(consolidation=0),
            snapshot(node(cluster=0), node(cluster=1), price=[0.1, 0.2], carbon=[100, 100]),
            [round((ENERGY_NEUTRAL + 1 + 1) / 3, 4), round((ENERGY_NEUTRAL + 0.5 + 1) / 3, 4)],
        ),
        (
            Energy(performance_per_watt=0, price=0, carbon=2, consolidation=1),
            snapshot(node(cluster=0, free=4), node(cluster=1), carbon=[300, 100]),
            [round((2 * (1 - 200 / 300) + 1) / 3, 4), round((2 * 1.0 + 0) / 3, 4)],
        ),
    ],
    ids=[
        "perf-per-watt-prefers-the-better-model",
        "perf-per-watt-unknown-neutral",
        "perf-per-watt-all-unknown",
        "cheaper-price",
        "price-nan-neutral",
        "price-all-zero",
        "greener-carbon",
        "carbon-nan-neutral",
        "consolidation-prefers-partly-used",
        "weight-0-turns-a-term-off",
        "weighted-mean",
    ],
)
def test_energy_scores(plugin, snap, expected):
    assert energy_scores(plugin, snap) == expected


def test_consolidation_sees_mig_instances_and_shared_memory_handed_out():
    snap = snapshot(
        node(gpus=1, mig={0: ["1g.10gb"] * 7}),
        node(gpus=1, mig={0: ["1g.10gb"] * 7}),
        node(gpus=1, shared={0: 81920}),
        node(gpus=1, shared={0: 81920}),
    )
    snap.take_instances(1, (8,))  # one instance of the second node's GPU
    snap.take_share(3, 0, 20480)  # 20 GiB of the fourth node's GPU
    assert energy_scores(ONLY["consolidation"], snap) == [0.0, 1.0, 0.0, 1.0]


def test_consolidation_follows_the_cycles_placements():
    snap = snapshot(node(), node())
    plugin, cycle = ONLY["consolidation"], state()
    assert plugin.score(cycle, snap, job(), snap.all_rows).tolist() == [0.0, 0.0]
    snap.take(1, (7,), 0, 0)
    assert plugin.score(cycle, snap, job(), snap.all_rows).tolist() == [0.0, 1.0]


# --- profiles ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, args, words",
    [
        ("load_aware", {"utilization": 1}, "unexpected keyword argument 'utilization'"),
        ("load_aware", {"memory": -1}, "numbers ≥ 0"),
        ("load_aware", {"utilisation": 0, "memory": 0, "temperature": 0}, "at least one"),
        ("load_aware", {"hot_temperature_c": 0}, "hot_temperature_c is a number > 0"),
        ("load_aware", {"stale_after_s": "3m"}, "stale_after_s is a number > 0"),
        ("load_aware", {"temperature": True}, "numbers ≥ 0"),
        ("load_aware", {"stale_after_s": float("nan")}, "stale_after_s is a number > 0"),
        ("energy", {"price": "cheap"}, "numbers ≥ 0"),
        ("energy", {"carbon": 1e300}, "numbers ≥ 0"),
        ("energy", {"watts": 1}, "unexpected keyword argument 'watts'"),
        (
            "energy",
            {"performance_per_watt": 0, "price": 0, "carbon": 0, "consolidation": 0},
            "at least one of the weights",
        ),
    ],
    ids=[
        "load-unknown-arg",
        "load-negative",
        "load-all-zero",
        "load-hot-zero",
        "load-stale-text",
        "load-bool",
        "load-nan",
        "energy-text",
        "energy-huge",
        "energy-unknown-arg",
        "energy-all-zero",
    ],
)
def test_bad_arguments_fail_at_start_up(name, args, words):
    config = {"plugins": ["node_state", name], "args": {name: args}}
    with pytest.raises(ImproperlyConfigured, match=f"bad arguments for {name}") as exc:
        build_profile(config)
    assert words in str(exc.value)


def test_neither_plugin_is_in_the_default_profile_and_both_take_weights():
    assert not {"load_aware", "energy"} & set(DEFAULT_PROFILE["plugins"])
    profile = build_profile(
        DEFAULT_PROFILE
        | {
            "plugins": [*DEFAULT_PROFILE["plugins"], "load_aware", "energy"],
            "weights": {"binpack": 1.0, "load_aware": 2.0, "energy": 0.5},
            "args": {"load_aware": {"hot_temperature_c": 80}, "energy": {"consolidation": 0}},
        }
    )
    assert [(p.name, w) for p, w in profile.score] == [("binpack", 1.0), ("load_aware", 2.0), ("energy", 0.5)]


# --- a whole cycle ----------------------------------------------------------------------------
LOAD_AWARE_PROFILE = DEFAULT_PROFILE | {
    "plugins": [*DEFAULT_PROFILE["plugins"], "load_aware"],
    "weights": {"binpack": 1.0, "load_aware": 1.0},
}


@pytest.mark.parametrize(
    "profile, reading_age_s, lands_on",
    [
        (LOAD_AWARE_PROFILE, 30, "cool"),
        (None, 30, "hot"),  # the default profile: binpack ties, the first node wins
        (LOAD_AWARE_PROFILE, 3600, "hot"),  # hour-old readings are trusted neither way: a tie again
    ],
    ids=["load-aware-avoids-the-hot-node", "default-profile-does-not", "stale-reading-ignored"],
)
@pytest.mark.django_db
def test_a_cycle_with_load_aware_places_a_job_on_the_cool_node(
    alice, queue, settings, monkeypatch, profile, reading_age_s, lands_on
):
    settings.ORRERY_SCHEDULER_PROFILE = profile
    monkeypatch.setattr(policies, "_profile", None)
    cluster = make_cluster("sim-a")
    nodes = {"hot": make_node(cluster, gpus=8, name="hot"), "cool": make_node(cluster, gpus=8, name="cool")}
    read_at = timezone.now() - timedelta(seconds=reading_age_s)
    GpuDevice.objects.filter(node=nodes["hot"]).update(
        utilization_avg=95, memory_used_avg_mb=60_000, temperature_avg_c=91, telemetry_at=read_at
    )
    GpuDevice.objects.filter(node=nodes["cool"]).update(
        utilization_avg=20, memory_used_avg_mb=8_000, temperature_avg_c=55, telemetry_at=read_at
    )
    placed = make_job(alice, queue, gpus=1)
    report = run_cycle(SchedulerCache())
    placed.refresh_from_db()
    assert report.placed == 1 and placed.state == JobState.SCHEDULED
    held = set(Allocation.objects.filter(job=placed, active=True).values_list("node__name", flat=True))
    assert held == {lands_on}
