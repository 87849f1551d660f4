"""The replayer's energy and hot-spot model, on traces small enough to work out by hand."""

from __future__ import annotations

import pytest

from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.engine.replay import Fleet, QueueSpec, Replay, TraceJob

DEFAULT = build_profile(DEFAULT_PROFILE)
LOAD_AWARE = build_profile(
    DEFAULT_PROFILE
    | {"plugins": [*DEFAULT_PROFILE["plugins"], "load_aware"], "weights": {"binpack": 1.0, "load_aware": 1.0}}
)
# Two nodes of two 400 W GPUs that run twice as fast as the trace's reference; an idle GPU draws
# a quarter of its TDP; energy costs 0.20 per kWh and 300 g CO₂ per kWh.
TINY = Fleet(
    clusters=("sim-a",),
    nodes=2,
    gpus=2,
    models=("h100-80g",),
    tdp_watts=(400.0,),
    throughput=(2.0,),
    idle_power=0.25,
    price=(0.20,),
    carbon=(300.0,),
)
# One job of both GPUs of one node, 7,200 s of reference work: 3,600 s at twice the speed.
ONE_JOB = [TraceJob(1, 100.0, 1, 1, 2, 0, runtime=7200.0, limit=10_000.0)]


def replay(fleet: Fleet, trace: list[TraceJob], profile=DEFAULT, window=(0.0, 7200.0)) -> tuple[Replay, dict]:
    r = Replay(fleet, profile, [QueueSpec(id=1)])
    return r, r.run(trace, window=window)


def test_the_run_time_scales_with_the_models_throughput():
    r, figures = replay(TINY, ONE_JOB)
    assert r.lives[1].done == 100.0 + 3600.0
    assert figures["completed_gpu_h"] == 2 * 2.0 * 3600 / 3600  # 2 GPUs × twice the speed × 1 h


@pytest.mark.parametrize(
    "sleep, energy_wh",
    [
        # 0–100 s: 4 idle GPUs × 100 W; 100–3,700 s: 2 busy × 400 W + 2 idle × 100 W;
        # 3,700–7,200 s: 4 idle × 100 W.
        (False, 400 * 100 / 3600 + 1000 * 3600 / 3600 + 400 * 3500 / 3600),
        # Idle nodes asleep: only the busy node draws, 800 W for the hour it runs.
        (True, 800.0),
    ],
    ids=["idle-gpus-draw-a-quarter", "idle-nodes-sleep"],
)
def test_energy_adds_up(sleep, energy_wh):
    _, figures = replay(Fleet(**{**TINY.__dict__, "sleep_idle_nodes": sleep}), ONE_JOB)
    work_h = 4.0
    assert figures["energy_kwh"] == round(energy_wh / 1000, 1)
    assert figures["energy_wh_per_gpu_h"] == round(energy_wh / work_h, 1)
    assert figures["cost_per_gpu_h"] == round(energy_wh / 1000 * 0.20 / work_h, 5)
    assert figures["co2_g_per_gpu_h"] == round(energy_wh / 1000 * 300 / work_h, 1)
    # the second node idles for the two hours, the first for the 100 s before and 3,500 s after
    assert figures["idle_node_h"] == round((7200 + 100 + 3500) / 3600, 1)


def test_without_energy_facts_no_energy_is_reported_and_run_times_are_the_traces():
    r, figures = replay(Fleet(clusters=("sim-a",), nodes=2, gpus=2, models=("h100-80g",)), ONE_JOB)
    assert r.lives[1].done == 100.0 + 7200.0
    assert "energy_kwh" not in figures and figures["completed_gpu_h"] == round(2 * (7200 - 100) / 3600, 1)


def hot_fleet(slowdown: float = 1.5) -> Fleet:
    return Fleet(clusters=("sim-a",), nodes=2, gpus=2, models=("h100-80g",), hot=0.5, hot_slowdown=slowdown)


def test_a_job_on_a_hot_spot_runs_slower_and_load_aware_keeps_it_off():
    fleet = hot_fleet()
    assert fleet.hot_rows().tolist() == [True, False]  # the first node: where binpack's tie goes
    trace = [TraceJob(1, 100.0, 1, 1, 1, 0, runtime=1000.0, limit=3600.0)]
    default, _ = replay(fleet, trace)
    aware, _ = replay(fleet, trace, LOAD_AWARE)
    assert default.lives[1].done == 100.0 + 1.5 * 1000.0
    assert aware.lives[1].done == 100.0 + 1000.0


def test_a_run_slowed_past_its_limit_is_cut_there_and_its_work_is_lost():
    fleet = hot_fleet(slowdown=4.0)
    # Fill both nodes, so one of the jobs lands on the hot spot whatever the profile.
    trace = [TraceJob(i, 100.0, 1, 1, 2, 0, runtime=1000.0, limit=3600.0) for i in (1, 2)]
    r, figures = replay(fleet, trace)
    done = sorted(life.done - 100.0 for life in r.lives.values())
    assert done == [1000.0, 3600.0]  # 4 × 1,000 s is past the 3,600 s limit: cut at the limit
    assert figures["timed_out"] == 1 and sum(life.timed_out for life in r.lives.values()) == 1
    assert figures["completed_gpu_h"] == round(2 * 1000 / 3600, 1)
