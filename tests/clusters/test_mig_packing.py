"""MIG profiles read, and instances that a cluster only counts grouped into GPUs
(``clusters/adapters/mig.py``): pure, shared by the Slurm and Kubernetes inventories."""

from __future__ import annotations

import pytest

from clusters.adapters.mig import Profile, layout_label, pack, parse_profile


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("1g.10gb", Profile("1g.10gb", 1, 10240)),
        ("3g.40gb", Profile("3g.40gb", 3, 40960)),
        ("7g.80gb", Profile("7g.80gb", 7, 81920)),
        ("1c.3g.40gb", Profile("1c.3g.40gb", 3, 40960)),
        ("1g.10gb+me", Profile("1g.10gb+me", 1, 10240)),
        ("1g.10gb+gfx", Profile("1g.10gb+gfx", 1, 10240)),
        ("1g.10gb+me;x", None),
        ("1G.10GB", Profile("1g.10gb", 1, 10240)),
        ("8g.80gb", None),
        ("0g.10gb", None),
        ("1g.0gb", None),
        ("a100", None),
        ("1g.10gb,gpu:8", None),
        ("1g.10gb\n", Profile("1g.10gb", 1, 10240)),
        ("1g." + "9" * 40 + "gb", None),
        ("", None),
        (None, None),
        (7, None),
    ],
    ids=[
        "1g",
        "3g",
        "7g",
        "compute-instance",
        "media-extensions",
        "another-suffix",
        "a-suffix-with-more",
        "upper-case",
        "more-slices-than-a-gpu",
        "no-slices",
        "no-memory",
        "a-gpu-type",
        "a-comma-asking-for-more",
        "trailing-newline",
        "huge",
        "empty",
        "none",
        "not-a-string",
    ],
)
def test_profiles(name, expected):
    assert parse_profile(name) == expected


def shapes(gpus: list[list[dict]]) -> list[list[str]]:
    return [[instance["profile"] for instance in gpu] for gpu in gpus]


@pytest.mark.parametrize(
    ("counts", "max_gpus", "expected", "dropped"),
    [
        ({"1g.10gb": 7}, 64, [["1g.10gb"] * 7], 0),
        ({"1g.10gb": 14}, 64, [["1g.10gb"] * 7] * 2, 0),
        ({"3g.40gb": 2}, 64, [["3g.40gb"] * 2], 0),
        ({"4g.40gb": 2}, 64, [["4g.40gb"], ["4g.40gb"]], 0),
        (
            {"1g.10gb": 1, "2g.20gb": 3, "4g.40gb": 2},
            64,
            [["4g.40gb", "2g.20gb", "1g.10gb"], ["4g.40gb", "2g.20gb"], ["2g.20gb"]],
            0,
        ),
        ({"7g.80gb": 1, "1g.10gb": 3}, 1, [["7g.80gb"]], 3),
        ({"1g.10gb": 10**9}, 2, [["1g.10gb"] * 7] * 2, 10**9 - 14),
        ({"bogus": 3, "1g.10gb": 2, "1G.10GB": 1}, 64, [["1g.10gb"] * 3], 0),
        ({"1g.10gb": 0, "3g.40gb": -2}, 64, [], 0),
        ({}, 64, [], 0),
    ],
    ids=[
        "all-1g",
        "two-gpus-of-1g",
        "two-3g-share-a-gpu",
        "two-4g-need-two",
        "largest-first-first-fit",
        "past-the-node",
        "huge-count-cut",
        "odd-names",
        "nothing-counted",
        "none",
    ],
)
def test_instances_are_packed_largest_first_into_gpus_of_seven_slices(counts, max_gpus, expected, dropped):
    gpus, left_out = pack(counts, max_gpus=max_gpus)
    assert (shapes(gpus), left_out) == (expected, dropped)
    for gpu in gpus:
        assert sum(i["slices"] for i in gpu) <= 7
        assert [i["slot"] for i in gpu] == list(range(len(gpu)))


@pytest.mark.parametrize(
    ("counts", "gpu_memory_mb", "expected"),
    [
        ({"3g.40gb": 2, "1g.10gb": 1}, 0, [["3g.40gb"] * 2, ["1g.10gb"]]),
        ({"3g.40gb": 2, "1g.10gb": 1}, 81920, [["3g.40gb"] * 2, ["1g.10gb"]]),
        ({"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}, 81920, [["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]]),
        ({"1g.10gb": 7}, 40960, [["1g.10gb"] * 4, ["1g.10gb"] * 3]),
        ({"1g.20gb": 7}, 81920, [["1g.20gb"] * 4, ["1g.20gb"] * 3]),
        (
            {"1g.18gb": 7, "3g.71gb": 1},
            143771,
            [["3g.71gb"] + ["1g.18gb"] * 4, ["1g.18gb"] * 3],
        ),
    ],
    ids=[
        "two-halves-spend-the-memory",
        "the-same-knowing-the-gpu",
        "balanced-a100-layout",
        "1g-on-a-40gb-gpu-takes-two-eighths",
        "double-memory-1g",
        "h200",
    ],
)
def test_instances_never_share_more_memory_than_a_gpu_has(counts, gpu_memory_mb, expected):
    gpus, _ = pack(counts, max_gpus=8, gpu_memory_mb=gpu_memory_mb)
    assert shapes(gpus) == expected


def test_instances_are_reported_in_the_agents_shape_with_the_memory_the_cluster_gives():
    (gpu,), _ = pack({"1g.10gb": 1, "3g.40gb": 1}, max_gpus=8, memory_mb={"1g.10gb": 9728})
    assert gpu == [
        {"slot": 0, "profile": "3g.40gb", "uuid": "", "memory_mb": 40960, "slices": 3},
        {"slot": 1, "profile": "1g.10gb", "uuid": "", "memory_mb": 9728, "slices": 1},
    ]
    assert pack({"1g.10gb": 9, "2g.20gb": 1}, max_gpus=8) == pack({"2g.20gb": 1, "1g.10gb": 9}, max_gpus=8)


def test_the_layout_label_names_each_profile_once_in_order():
    assert layout_label({"3g.40gb": 2, "1g.10gb": 1, "bogus": 4, "2g.20gb": 0}) == "1g.10gb:1,3g.40gb:2"
