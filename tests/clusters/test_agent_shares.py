"""A job's environment on MIG instances or on a fraction of a shared GPU: what CUDA and an MPS
client read, what the job cannot change, and which GPUs its attempt holds, across a restart of
the agent (what decides whether a GPU is idle enough to change its MIG layout)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from clusters.agent.runner import Account, Refused, Runner, share_environment


def entry(**share: Any) -> dict[str, Any]:
    return {"attempt": str(uuid.uuid4()), "job": 7, "gpus": [0], "env": {}, **share}


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        ({}, {}),
        (
            {"gpus": [0, 0], "mig_profile": "1g.10gb", "mig_uuids": ["MIG-aaaa", "MIG-bbbb"]},
            {"CUDA_VISIBLE_DEVICES": "MIG-aaaa,MIG-bbbb", "ORRERY_MIG_PROFILE": "1g.10gb"},
        ),
        (
            {"gpus": [3], "gpu_memory_mb": 20480, "gpu_share": 0.25},
            {
                "CUDA_VISIBLE_DEVICES": "3",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "3=20480M",
                "ORRERY_GPU_MEMORY_MB": "20480",
            },
        ),
    ],
    ids=["whole", "mig", "shared"],
)
def test_a_share_sets_what_cuda_and_mps_read(share, expected):
    assert share_environment(entry(**share)) == expected


@pytest.mark.parametrize(
    ("share", "percent"),
    [(0.3333, "34"), (0.0001, "1"), (0.29, "29"), (1.0, "100")],
    ids=["rounded-up", "at-least-1", "no-float-noise", "whole-share"],
)
def test_the_compute_share_is_a_whole_percentage(share, percent):
    env = share_environment(entry(gpu_memory_mb=1000, gpu_share=share))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == percent


@pytest.mark.parametrize(
    "share",
    [
        {"mig_uuids": ["GPU-aaaa"]},
        {"mig_uuids": ["MIG-a,MIG-b"]},
        {"mig_uuids": "MIG-aaaa"},
        {"gpu_memory_mb": 100, "gpu_share": 1.5},
        {"gpu_memory_mb": -5, "gpu_share": 0.5},
        {"gpu_memory_mb": 100, "gpu_share": "half"},
        {"gpus": [0, 1], "gpu_memory_mb": 100, "gpu_share": 0.5},
    ],
    ids=[
        "not-mig",
        "comma",
        "not-a-list",
        "share-above-1",
        "negative-memory",
        "share-not-number",
        "two-gpus",
    ],
)
def test_a_share_that_makes_no_sense_is_refused(share):
    with pytest.raises(Refused):
        share_environment(entry(**share))


def test_a_job_cannot_set_its_own_gpus_or_mps_limits(tmp_path):
    runner = Runner(tmp_path)
    mine = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "OWN": "kept"}
    env = runner._environment(
        entry(gpus=[2], gpu_memory_mb=8192, gpu_share=0.1) | {"env": mine},
        Account("nobody", 65534, 65534, (65534,), "/nonexistent"),
    )
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["OWN"]) == (
        "2",
        "10",
        "kept",
    )
    assert env["ORRERY_GPUS_PER_NODE"] == "1"


def test_the_gpus_an_attempt_holds_are_known_after_a_restart(tmp_path):
    runner = Runner(tmp_path, grace=0.5)
    started = entry(gpus=[1, 1], mig_profile="1g.10gb", mig_uuids=["MIG-a", "MIG-b"]) | {
        "script": "sleep 30",
        "user": "",
    }
    runner.start(started)
    try:
        assert runner.held_gpus() == {1}
        assert Runner(tmp_path, grace=0.5).held_gpus() == {1}  # adopted from meta.json
    finally:
        runner.stop(started["attempt"])
        deadline = time.monotonic() + 10
        while runner.attempts and time.monotonic() < deadline:
            runner.poll()
            time.sleep(0.05)
    assert runner.held_gpus() == set()
