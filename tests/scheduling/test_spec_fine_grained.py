"""The spec's requests smaller than whole GPUs — MIG instances, fractions of shareable GPUs — and
a gang's topology: what is accepted, and every refusal with the path of the field at fault."""

from __future__ import annotations

import pytest

from scheduling.spec import SpecError, parse_job_spec


def document(resources: dict, placement: dict | None = None, nodes: int = 1) -> dict:
    spec = {"resources": {"nodes": nodes, **resources}, "run": "true"}
    if placement is not None:
        spec["placement"] = placement
    return {"apiVersion": "orrery/v1", "metadata": {"name": "t"}, "spec": spec}


@pytest.mark.parametrize(
    ("gpus", "model", "count", "mig"),
    [
        ("a100:1g.10gb", "a100", 1, "1g.10gb"),
        ("a100:3g.40gb:2", "a100", 2, "3g.40gb"),
        ("gpu:h100:1g.20gb", "h100", 1, "1g.20gb"),
        ("A100:1G.10GB", "a100", 1, "1g.10gb"),
        ({"model": "a100", "mig": "2g.20gb", "count": 3}, "a100", 3, "2g.20gb"),
        ("h100:1g.10gb+me", "h100", 1, "1g.10gb+me"),
    ],
    ids=["one", "two", "gpu-prefix", "upper-case", "mapping", "media-extension"],
)
def test_mig_requests(gpus, model, count, mig):
    spec = parse_job_spec(document({"gpus": gpus}))
    assert (spec.gpus.model, spec.gpus.count, spec.gpus.mig) == (model, count, mig)


@pytest.mark.parametrize(
    ("resources", "path", "words"),
    [
        ({"gpus": "a100:9g.10gb"}, "spec.resources.gpus", "is not a GPU request"),
        ({"gpus": "a100:1g.10gb:0"}, "spec.resources.gpus", "at least one instance"),
        ({"gpus": "a100:1g.10gb:x"}, "spec.resources.gpus", "is not a GPU request"),
        ({"gpus": {"mig": "1g.10gb", "count": 1}}, "spec.resources.gpus.model", "names its GPU model"),
        ({"gpus": {"model": "a100", "mig": "1g"}}, "spec.resources.gpus.mig", "MIG profile"),
        ({"gpus": {"model": "a100", "mig": 7}}, "spec.resources.gpus.mig", "MIG profile"),
        ({"gpus": "a100:1g.10gb:65"}, "spec.resources.gpus", "more than 64"),
    ],
    ids=["profile", "zero", "count", "no-model", "short-profile", "number", "too-many"],
)
def test_bad_mig_requests_name_the_field(resources, path, words):
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document(resources))
    assert any(p == path and words in m for p, m in refused.value.errors), refused.value.errors


@pytest.mark.parametrize(
    ("resources", "memory_mb", "share"),
    [
        ({"gpus": "h100", "gpuMemory": "20Gi"}, 20 * 1024, None),
        ({"gpus": "h100:1", "gpuMemory": 512}, 512, None),
        ({"gpus": 1, "gpuShare": 0.25}, 0, 0.25),
        ({"gpus": "h100", "gpuShare": "25%"}, 0, 0.25),
        ({"gpus": "h100", "gpuShare": 1}, 0, 1.0),
    ],
    ids=["memory", "bare-mib", "share", "percent", "whole-share"],
)
def test_fractions_of_a_shared_gpu(resources, memory_mb, share):
    spec = parse_job_spec(document(resources))
    assert (spec.gpu_memory_mb, spec.gpu_share, spec.gpus.count) == (memory_mb, share, 1)


@pytest.mark.parametrize(
    ("resources", "path", "words"),
    [
        ({"gpus": "h100", "gpuMemory": "20Gi", "gpuShare": 0.5}, "spec.resources.gpuShare", "not both"),
        ({"gpus": "h100:2", "gpuMemory": "20Gi"}, "spec.resources.gpuMemory", "one GPU per node"),
        ({"gpus": 0, "gpuShare": 0.5}, "spec.resources.gpuShare", "one GPU per node"),
        ({"gpus": "a100:1g.10gb", "gpuShare": 0.5}, "spec.resources.gpuShare", "not MIG"),
        ({"gpus": "h100", "gpuShare": 0}, "spec.resources.gpuShare", "above 0"),
        ({"gpus": "h100", "gpuShare": 1.5}, "spec.resources.gpuShare", "at most 1"),
        ({"gpus": "h100", "gpuShare": "lots"}, "spec.resources.gpuShare", "fraction"),
        ({"gpus": "h100", "gpuShare": True}, "spec.resources.gpuShare", "fraction"),
        ({"gpus": "h100", "gpuShare": "1" * 5000}, "spec.resources.gpuShare", "fraction"),
        ({"gpus": "h100", "gpuShare": float("nan")}, "spec.resources.gpuShare", "fraction"),
        ({"gpus": "h100", "gpuMemory": "20Pi"}, "spec.resources.gpuMemory", "more memory"),
        ({"gpus": "h100", "gpuMemory": "20Ti"}, "spec.resources.gpuMemory", "between"),
        ({"gpus": "h100", "gpuMemory": "-1Gi"}, "spec.resources.gpuMemory", ""),
    ],
    ids=[
        "both",
        "two-gpus",
        "no-gpu",
        "mig",
        "zero",
        "above-one",
        "words",
        "boolean",
        "huge-text",
        "nan",
        "huge-memory",
        "larger-than-any-gpu",
        "negative",
    ],
)
def test_bad_fractions_name_the_field(resources, path, words):
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document(resources))
    assert any(p == path and words in m for p, m in refused.value.errors), refused.value.errors


@pytest.mark.parametrize("topology", ["required", "preferred"])
def test_a_gang_may_ask_for_topology(topology):
    spec = parse_job_spec(document({"gpus": "h100:8"}, {"topology": topology}, nodes=4))
    assert spec.topology == topology


@pytest.mark.parametrize("topology", ["rack", 1, ["required"], "REQUIRED"])
def test_an_unknown_topology_is_refused(topology):
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document({"gpus": "h100:8"}, {"topology": topology}, nodes=4))
    assert [p for p, _ in refused.value.errors] == ["spec.placement.topology"]
