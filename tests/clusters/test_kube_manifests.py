"""Attempts → Kubernetes Jobs (``clusters/adapters/kubernetes/manifests.py``): pure, checked
against the Jobs a real kube-apiserver accepted (tests/kubefake/recordings/041, 045)."""

from __future__ import annotations

import pytest

from clusters.adapters.base import Share, Work
from clusters.adapters.kubernetes.manifests import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_TAG,
    ManifestError,
    gpu_request,
    job_manifest,
    job_name,
    secret_manifest,
    service_manifest,
)

ATTEMPT = "4f2c9e0a-1b2c-4d3e-8f90-0123456789ab"


def work(nodes: int = 1, **fields) -> Work:
    shares = tuple(Share(i + 1, f"dgx-{i + 1:03d}", (0, 1)) for i in range(nodes))
    base = dict(
        attempt_id=ATTEMPT,
        job_id=42,
        number=1,
        epoch=1,
        script="python train.py",
        env={"LR": "0.1"},
        shares=shares,
        time_limit_s=3600,
        image="nvcr.io/nvidia/pytorch:24.05-py3",
        cpu_millicores=16000,
        memory_bytes=128 * 2**30,
    )
    return Work(**(base | fields))


def env_of(job: dict) -> dict:
    return {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }


def test_one_node_job_is_pinned_by_node_affinity_with_limits_deadline_and_no_retries():
    job = job_manifest(work(), "t0", uid=1000, gid=1000)
    name = job["metadata"]["name"]
    assert name == job_name(ATTEMPT) == f"orrery-{ATTEMPT}" and len(name) <= 63
    assert job["metadata"]["labels"] == {
        LABEL_JOB: "42",
        LABEL_ATTEMPT: ATTEMPT,
        LABEL_TAG: "t0",
        "app.kubernetes.io/managed-by": "orrery",
    }
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (0, 3600)
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"][LABEL_ATTEMPT] == ATTEMPT
    assert "nodeName" not in pod
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["dgx-001"]}]}]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["command"] == ["/bin/sh", "-c", "python train.py"]
    assert container["resources"] == {
        "requests": {"cpu": "16000m", "memory": str(128 * 2**30)},
        "limits": {"memory": str(128 * 2**30), "nvidia.com/gpu": "2"},
    }
    assert env_of(job) | {"LR": "0.1"} == env_of(job)
    assert env_of(job)["ORRERY_ATTEMPT_ID"] == ATTEMPT


def test_the_pod_runs_as_the_given_non_root_uid_without_privileges():
    pod = job_manifest(work(), "t0", uid=1234, gid=2345)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (1234, 2345)
    context = pod["containers"][0]["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    with pytest.raises(ManifestError, match="root"):
        job_manifest(work(), "t0", uid=0, gid=0)


def test_nothing_of_the_control_planes_environment_reaches_the_pod(monkeypatch):
    monkeypatch.setenv("ORRERY_SECRET_KEY", "control-plane-only")
    assert "control-plane-only" not in repr(job_manifest(work(), "t0", uid=1000, gid=1000))


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"image": ""}, "container images only"),
        ({"env": {"BAD-NAME": "x"}}, "not an environment variable name"),
    ],
    ids=["no-image", "bad-env-name"],
)
def test_what_can_never_run_is_refused(fields, why):
    with pytest.raises(ManifestError, match=why):
        job_manifest(work(**fields), "t0", uid=1000, gid=1000)


def test_a_mig_node_is_asked_for_its_own_resource_and_the_clusters_tolerated_taints_are_tolerated():
    job = job_manifest(
        work(), "t0", uid=1000, gid=1000, gpu_resource="nvidia.com/mig-1g.10gb", tolerated=["dedicated"]
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "2"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]


def test_an_image_without_a_script_runs_its_own_command():
    container = job_manifest(work(script=""), "t0", uid=1000, gid=1000)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "command" not in container


def test_a_gang_is_an_indexed_job_on_exactly_its_nodes_one_pod_each_with_rendezvous_env():
    job = job_manifest(work(nodes=3, env={"RANK": "7"}), "t0", uid=1000, gid=1000)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    name = job["metadata"]["name"]
    assert pod["subdomain"] == name
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms[0]["matchFields"][0]["values"] == ["dgx-001", "dgx-002", "dgx-003"]
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == {
        "labelSelector": {"matchLabels": {LABEL_ATTEMPT: ATTEMPT}},
        "topologyKey": "kubernetes.io/hostname",
    }
    env = env_of(job)
    assert env["MASTER_ADDR"] == env["ORRERY_HEAD_ADDR"] == f"{name}-0.{name}"  # pod 0 of the Service
    index = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["NODE_RANK"] == index == env["ORRERY_NODE_RANK"]
    # 2 GPUs a node: RANK is the index times 2, which an env entry cannot compute; the script does
    assert "RANK" not in env  # and the job's own RANK is dropped
    assert pod["containers"][0]["command"][-1] == 'export RANK="$((NODE_RANK * 2))"; python train.py'
    service = service_manifest(work(nodes=3), "t0")
    assert service["metadata"]["name"] == name and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}


def test_secret_values_are_referred_to_never_written_into_the_job():
    w = work(env={"LR": "0.1", "WANDB_KEY": "s3cr3t"}, secret_names=frozenset({"WANDB_KEY"}))
    job = job_manifest(w, "t0", uid=1000, gid=1000)
    assert "s3cr3t" not in str(job)
    name = job["metadata"]["name"]
    assert env_of(job)["WANDB_KEY"] == {"secretKeyRef": {"name": name, "key": "WANDB_KEY"}}
    assert env_of(job)["LR"] == "0.1"
    secret = secret_manifest(w, "t0")
    assert secret["metadata"]["name"] == name and set(secret["data"]) == {"WANDB_KEY"}
    assert secret_manifest(work(), "t0") is None  # nothing secret: no Secret


def test_which_gpus_a_container_sees_is_never_the_jobs_to_say():
    greedy = {
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "all",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    with_gpus = env_of(job_manifest(work(env=greedy), "t0", uid=1000, gid=1000))
    assert "NVIDIA_VISIBLE_DEVICES" not in with_gpus and "NVIDIA_DRIVER_CAPABILITIES" not in with_gpus
    assert with_gpus["CUDA_VISIBLE_DEVICES"] == "0"  # narrowing what the device plugin gave is fine
    cpu_only = work(env=greedy, shares=(Share(1, "dgx-001", ()),))
    assert env_of(job_manifest(cpu_only, "t0", uid=1000, gid=1000))["NVIDIA_VISIBLE_DEVICES"] == "void"


PORT_ANY = {"MASTER_PORT": "29500", "ORRERY_MASTER_PORT": "29500"}
INDEX = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
POD_IP = {"fieldRef": {"fieldPath": "status.podIP"}}


@pytest.mark.parametrize(
    ("nodes", "gpus", "expected", "script"),
    [
        (
            1,
            (0, 1, 2, 3),
            {"NNODES": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "0", "RANK": "0"}
            | {"MASTER_ADDR": POD_IP, "ORRERY_HEAD_ADDR": POD_IP, "ORRERY_WORLD_SIZE": "4"},
            "python train.py",
        ),
        (
            1,
            (),
            {"NNODES": "1", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0", "RANK": "0"},
            "python train.py",
        ),
        (
            2,
            (0,),
            {"NNODES": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": INDEX, "RANK": INDEX}
            | {"ORRERY_LOCAL_WORLD_SIZE": "1", "ORRERY_NNODES": "2"},
            "python train.py",
        ),
        (
            4,
            tuple(range(8)),
            {"NNODES": "4", "WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": INDEX}
            | {"ORRERY_WORLD_SIZE": "32", "ORRERY_NODE_RANK": INDEX},
            'export RANK="$((NODE_RANK * 8))"; python train.py',
        ),
    ],
    ids=["one-node-4-gpus", "one-node-cpu", "gang-1-gpu-each", "gang-4x8"],
)
def test_every_pod_gets_the_launch_environment_and_the_job_cannot_override_it(nodes, gpus, expected, script):
    mine = {"MASTER_PORT": "1234", "WORLD_SIZE": "99", "ORRERY_NODE_RANK": "5", "NNODES": "7", "LR": "0.1"}
    w = work(env=mine, shares=tuple(Share(i + 1, f"dgx-{i + 1:03d}", gpus) for i in range(nodes)))
    job = job_manifest(w, "t0", uid=1000, gid=1000)
    env = env_of(job)
    assert {k: env.get(k) for k in expected | PORT_ANY} == expected | PORT_ANY
    assert (
        env["LR"] == "0.1"
        and [e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]].count("MASTER_PORT")
        == 1
    )
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["/bin/sh", "-c", script]


def test_the_agreed_port_is_every_pods_port():
    env = env_of(job_manifest(work(nodes=2, master_port=29517), "t0", uid=1000, gid=1000))
    assert env["MASTER_PORT"] == env["ORRERY_MASTER_PORT"] == "29517"


# --- which resource a node's share is asked by (``gpu_request``) --------------------------------
MIG_NODE = {"orrery.io/gpu-resource": "nvidia.com/gpu", "nvidia.com/mig.strategy": "mixed"}
SINGLE_NODE = {"orrery.io/gpu-resource": "nvidia.com/gpu", "nvidia.com/mig.strategy": "single"}
TIME_SLICED = {"orrery.io/gpu-resource": "nvidia.com/gpu", "nvidia.com/gpu.replicas": "4"}
RENAMED = {"orrery.io/gpu-resource": "nvidia.com/gpu.shared", "nvidia.com/gpu.replicas": "4"}


@pytest.mark.parametrize(
    ("share", "node_labels", "resource"),
    [
        (Share(1, "n", (0, 1)), {}, "nvidia.com/gpu"),
        (Share(1, "n", (0, 1)), MIG_NODE, "nvidia.com/gpu"),
        (Share(1, "n", (3, 3), mig_profile="1g.10gb"), MIG_NODE, "nvidia.com/mig-1g.10gb"),
        (Share(1, "n", (3,), mig_profile="3g.40gb"), {}, "nvidia.com/mig-3g.40gb"),
        (Share(1, "n", (3,), mig_profile="1g.10gb"), SINGLE_NODE, "nvidia.com/gpu"),
        (Share(1, "n", (0,), gpu_memory_mb=20480, gpu_share=0.25), TIME_SLICED, "nvidia.com/gpu"),
        (Share(1, "n", (0,), gpu_memory_mb=20480, gpu_share=0.25), RENAMED, "nvidia.com/gpu.shared"),
        (Share(1, "n", (0, 1)), RENAMED, "nvidia.com/gpu.shared"),
    ],
    ids=[
        "whole-on-a-node-without-labels",
        "whole",
        "mig-instances",
        "mig-profile-named-as-the-plugin-names-it",
        "mig-under-the-single-strategy",
        "shared-on-a-time-sliced-node",
        "shared-where-the-plugin-renamed-replicas",
        "whole-on-a-renamed-node",
    ],
)
def test_a_share_is_asked_by_the_resource_its_node_offers_it_as(share, node_labels, resource):
    assert gpu_request(share, node_labels) == resource


@pytest.mark.parametrize(
    "profile",
    ["1g.10gb,nvidia.com/gpu", "../../x", "nvidia.com/gpu", "9g.10gb", "1g.10gb: 8"],
    ids=["a-list", "a-path", "a-resource", "not-a-profile", "yaml-ish"],
)
def test_a_mig_profile_that_is_not_one_is_refused(profile):
    with pytest.raises(ManifestError, match="not a MIG profile"):
        gpu_request(Share(1, "n", (0,), mig_profile=profile), MIG_NODE)


@pytest.mark.parametrize(
    ("shares", "resource", "limit", "gpus_env"),
    [
        (
            (Share(1, "a", (2, 2), mig_profile="1g.10gb", mig_uuids=("MIG-x", "MIG-y")),),
            "nvidia.com/mig-1g.10gb",
            "2",
            "2",
        ),
        ((Share(1, "a", (0,), gpu_memory_mb=20480, gpu_share=0.25),), "nvidia.com/gpu", "1", "1"),
        (
            tuple(Share(i, f"n{i}", (1, 1, 1), mig_profile="2g.20gb") for i in (1, 2)),
            "nvidia.com/mig-2g.20gb",
            "3",
            "3",
        ),
    ],
    ids=["two-mig-instances", "a-quarter-of-a-shared-gpu", "a-gang-of-mig-instances"],
)
def test_a_pod_asks_for_its_instances_or_one_unit_of_a_shared_gpu(shares, resource, limit, gpus_env):
    w = work(shares=shares)
    job = job_manifest(w, "t0", uid=1000, gid=1000, gpu_resource=gpu_request(shares[0], MIG_NODE))
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert {k: v for k, v in limits.items() if k.startswith("nvidia.com/")} == {resource: limit}
    assert env_of(job)["ORRERY_GPUS_PER_NODE"] == gpus_env
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(job)  # the device plugin says which instance, not Orrery
