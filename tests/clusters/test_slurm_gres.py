"""Slurm's GRES in Orrery's terms (``clusters/adapters/slurm/gres.py``): a node's GRES read into
whole GPUs, MIG instances and shards, the GPUs the inventory describes from it, and what an
attempt asks Slurm for (``--gres``). Pure, but for the last tests (the inventory pass and a
refused dispatch, on the real database)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from clusters.adapters.base import Phase, Share, Work
from clusters.adapters.slurm.accounts import Account
from clusters.adapters.slurm.adapter import sbatch_argv, work_gres
from clusters.adapters.slurm.api import parse_nodes
from clusters.adapters.slurm.gres import GresRefused, MigEntry, NodeGres, gres_request, parse_node_gres
from clusters.adapters.slurm.inventory import slurm_gpus

RECORDINGS = Path(__file__).parent / "recordings"


@pytest.mark.parametrize(
    ("gres", "expected"),
    [
        ("gpu:a100:4", NodeGres({"a100": 4})),
        ("gpu:a100:4(S:0-1)", NodeGres({"a100": 4})),
        ("gpu:4", NodeGres({None: 4})),
        ("tmpdisk:100,gpu:l40s:2", NodeGres({"l40s": 2})),
        ("gpu:1g.10gb:7", NodeGres(mig={"1g.10gb": MigEntry("1g.10gb", 7, None)})),
        ("gpu:a100_1g.10gb:7(S:0)", NodeGres(mig={"1g.10gb": MigEntry("a100_1g.10gb", 7, "a100")})),
        (
            "gpu:nvidia_a100_3g.20gb:2",
            NodeGres(mig={"3g.20gb": MigEntry("nvidia_a100_3g.20gb", 2, "a100")}),
        ),
        (
            "gpu:a100:1,gpu:a100_3g.20gb:2",
            NodeGres({"a100": 1}, {"3g.20gb": MigEntry("a100_3g.20gb", 2, "a100")}),
        ),
        ("gpu:a100:2(S:0,1),shard:a100:64(S:0,1)", NodeGres({"a100": 2}, shards=64)),
        ("gpu:a100:2(S:0),gpu:a100:2(S:1)", NodeGres({"a100": 4})),
        ("gpu:9g.10gb:1", NodeGres({"9g.10gb": 1})),
        ("gpu:a100:99999999", NodeGres()),
        ("gpu:a100:0(IDX:N/A)", NodeGres()),
        ("gpu:a100;rm -rf /:4", NodeGres()),
        ("gpu::4", NodeGres()),
        ("gpu:a100:-1", NodeGres()),
        ("(((gpu:a100:4", NodeGres()),
        ("gpu:" + "a" * 65 + ":4", NodeGres()),
        ("gpu:a100:1," * 5000, NodeGres()),
        ("", NodeGres()),
        (None, NodeGres()),
        (["gpu:a100:4"], NodeGres()),
    ],
    ids=[
        "typed",
        "with-sockets",
        "untyped",
        "among-other-gres",
        "bare-mig-type",
        "autodetected-mig-type",
        "vendor-prefixed-mig-type",
        "slurm-docs-example-whole-and-mig",
        "shards-with-a-comma-in-sockets",
        "one-type-per-socket",
        "not-a-profile-is-a-gpu-type",
        "count-past-any-node",
        "gres-used-form",
        "shell-in-type",
        "empty-type",
        "negative",
        "unbalanced-parentheses",
        "type-too-long",
        "huge",
        "empty",
        "none",
        "not-a-string",
    ],
)
def test_node_gres(gres, expected):
    assert parse_node_gres(gres) == expected


@pytest.mark.parametrize(
    ("gres", "default", "whole", "mig", "mig_type"),
    [
        ("gpu:a100:4", None, ("a100", 4, "a100"), [], "a100"),
        ("gpu:4", "a100", ("a100", 4, ""), [], "a100"),
        ("gpu:4", None, (None, 4, ""), [], None),
        ("gpu:1g.10gb:14", "a100", ("a100", 0, ""), [["1g.10gb"] * 7] * 2, "a100"),
        ("gpu:a100_1g.10gb:7(S:0)", None, (None, 0, ""), [["1g.10gb"] * 7], "a100"),
        ("gpu:a100:1,gpu:a100_3g.20gb:2", None, ("a100", 1, "a100"), [["3g.20gb"] * 2], "a100"),
        ("gpu:a100:2,gpu:1g.10gb:7", None, ("a100", 2, "a100"), [["1g.10gb"] * 7], "a100"),
        (
            "gpu:a100:4,gpu:a100_1g.10gb:7,gpu:h100_2g.20gb:3",
            None,
            ("a100", 4, "a100"),
            [["1g.10gb"] * 7],
            "a100",
        ),
        ("gpu:a100:60,gpu:1g.10gb:70", None, ("a100", 60, "a100"), [["1g.10gb"] * 7] * 4, "a100"),
    ],
    ids=[
        "whole",
        "untyped-with-the-clusters-type",
        "untyped",
        "mig-of-the-clusters-type",
        "mig-of-its-own-type",
        "whole-then-mig",
        "bare-mig-of-the-whole-gpus-type",
        "mig-of-another-model-left-out",
        "cut-at-a-nodes-gpus",
    ],
)
def test_the_gpus_a_node_has(gres, default, whole, mig, mig_type):
    gpus = slurm_gpus(parse_node_gres(gres), default)
    assert (gpus.whole_type, gpus.whole, gpus.gres_type) == whole
    assert [[i["profile"] for i in gpu] for gpu in gpus.mig] == mig
    assert gpus.mig_type == mig_type
    assert gpus.whole + len(gpus.mig) <= 64


def test_cut_instances_are_counted():
    assert slurm_gpus(parse_node_gres("gpu:a100:60,gpu:1g.10gb:70")).dropped == 70 - 28


# --- what an attempt asks for ----------------------------------------------------------------
def share(gpus: int = 2, **fields) -> Share:
    return Share(1, "n1", tuple(range(gpus)), **fields)


MIG = dict(mig_profile="1g.10gb", mig_uuids=("MIG-a", "MIG-b"))


@pytest.mark.parametrize(
    ("the_share", "gpu_type", "node_types", "config", "expected"),
    [
        (share(), "a100", {}, {}, "gpu:a100:2"),
        (share(), "", {}, {}, "gpu:2"),
        (share(0), "a100", {}, {}, ""),
        (share(**MIG), "", {"1g.10gb": "a100_1g.10gb"}, {}, "gpu:a100_1g.10gb:2"),
        (share(**MIG), "a100", {}, {}, "gpu:1g.10gb:2"),
        (
            share(**MIG),
            "",
            {"1g.10gb": "a100_1g.10gb"},
            {"mig_gres_types": {"1g.10gb": "mig1g"}},
            "gpu:mig1g:2",
        ),
        (share(1, gpu_memory_mb=20480, gpu_share=0.25), "a100", {}, {"shards_per_gpu": 8}, "shard:2"),
        (share(1, gpu_memory_mb=24576, gpu_share=0.3), "", {}, {"shards_per_gpu": 10}, "shard:3"),
        (share(1, gpu_memory_mb=100, gpu_share=0.001), "", {}, {"shards_per_gpu": 4}, "shard:1"),
        (share(1, gpu_memory_mb=100, gpu_share=0.0), "", {}, {"shards_per_gpu": 4}, "shard:4"),
        (share(1, gpu_memory_mb=81920, gpu_share=1.0), "", {}, {"shards_per_gpu": 64}, "shard:64"),
    ],
    ids=[
        "whole-typed",
        "whole-untyped",
        "cpu-only",
        "mig-as-the-node-names-it",
        "mig-bare-profile",
        "mig-as-the-site-names-it",
        "a-quarter-of-8-shards",
        "three-tenths-is-3-not-4",
        "a-sliver-is-one-shard",
        "unknown-fraction-is-the-whole-gpu",
        "all-of-it",
    ],
)
def test_what_an_attempt_asks_slurm_for(the_share, gpu_type, node_types, config, expected):
    assert gres_request(the_share, gpu_type=gpu_type, node_mig_types=node_types, config=config) == expected


@pytest.mark.parametrize(
    ("the_share", "gpu_type", "config", "why"),
    [
        (share(1, gpu_memory_mb=20480, gpu_share=0.25), "", {}, "no shards configured"),
        (share(1, gpu_memory_mb=20480, gpu_share=0.25), "", {"shards_per_gpu": 0}, "no shards configured"),
        (share(1, gpu_memory_mb=20480, gpu_share=0.25), "", {"shards_per_gpu": "8"}, "no shards configured"),
        (share(1, gpu_memory_mb=20480, gpu_share=0.25), "", {"shards_per_gpu": True}, "no shards configured"),
        (share(mig_profile="1g.10gb,gpu:8"), "", {}, "not a MIG profile"),
        (share(**MIG), "", {"mig_gres_types": {"1g.10gb": "x:1,gpu:8"}}, "not a Slurm GRES type name"),
        (share(), "a100,shard:99", {}, "not a Slurm GRES type name"),
    ],
    ids=[
        "shared-without-shards",
        "zero-shards",
        "shards-as-text",
        "shards-as-a-boolean",
        "a-profile-asking-for-more",
        "a-site-type-asking-for-more",
        "a-node-type-asking-for-more",
    ],
)
def test_what_slurm_cannot_be_asked_is_refused(the_share, gpu_type, config, why):
    with pytest.raises(GresRefused, match=why):
        gres_request(the_share, gpu_type=gpu_type, config=config)


def work(*shares: Share) -> Work:
    return Work("0b7c", 5, 1, 1, "true", {}, shares, run_as="nobody")


@pytest.mark.parametrize(
    ("labels", "the_share", "config", "expected"),
    [
        ({"slurm.io/gres": "gpu:a100:4", "slurm.io/gres-type": "a100"}, share(), {}, "--gres=gpu:a100:2"),
        (
            {"slurm.io/gres": "gpu:a100:1,gpu:a100_3g.20gb:2", "slurm.io/gres-type": "a100"},
            share(mig_profile="3g.20gb"),
            {},
            "--gres=gpu:a100_3g.20gb:2",
        ),
        (
            {"slurm.io/gres": "gpu:a100:2,shard:64"},
            share(1, gpu_memory_mb=40960, gpu_share=0.5),
            {"shards_per_gpu": 32},
            "--gres=shard:16",
        ),
        ({}, share(0), {}, None),
    ],
    ids=["whole", "mig-by-the-nodes-type", "shards", "no-gpus"],
)
def test_the_sbatch_command_line_asks_for_the_nodes_share(labels, the_share, config, expected):
    account = Account("u", 1001, 1001, "/home/u")
    w = work(the_share, dataclasses.replace(the_share, node_id=2, node="n2"))
    argv = sbatch_argv(w, work_gres(w, labels, config), account=account, output="/x/o.out", tag="t")
    asked = [a for a in argv if a.startswith("--gres")]
    assert asked == ([expected] if expected else [])
    assert "--nodes=2" in argv


# --- on the database: the inventory pass, a refused dispatch -----------------------------------
class RecordedSlurm:
    """Stands in for slurmrestd (no Slurm runs where these tests do; tests/clusters/test_slurm_live.py
    reads a real one): answers ``nodes()`` with the recorded node list, each node's GRES as given."""

    def __init__(self, gres: dict[str, str]) -> None:
        self.gres = gres

    def nodes(self):
        payload = json.loads((RECORDINGS / "slurm-22.05-nodes.json").read_text())
        for node in payload["nodes"]:
            node["gres"] = self.gres.get(node["name"], node["gres"])
        return parse_nodes(payload)


@pytest.fixture
def hpc(db):
    from tests.factories import ensure_catalog, make_cluster

    ensure_catalog()
    return make_cluster("hpc", kind="slurm", config={"gpu_type": "a100"})


def collect_now(cluster, gres: dict[str, str]):
    from clusters.adapters.slurm.inventory import collect

    return collect(cluster, RecordedSlurm(gres))


def test_a_nodes_gres_becomes_its_labels_and_a_changed_gres_describes_it_again(hpc):
    seen = collect_now(hpc, {"n1": "gpu:a100:4(S:0)", "n2": "gpu:2"})
    n1, n2 = hpc.nodes.get(name="n1"), hpc.nodes.get(name="n2")
    assert (n1.labels["slurm.io/gres"], n1.labels["slurm.io/gres-type"], n1.gpu_capacity) == (
        "gpu:a100:4(S:0)",
        "a100",
        4,
    )
    assert "slurm.io/gres-type" not in n2.labels and n2.gpu_capacity == 2  # untyped: the cluster's gpu_type
    assert {g.model.slug for g in n2.gpus.all()} == {"a100-80g"}
    assert seen.unknown_gpu_types == ()
    collect_now(hpc, {"n1": "gpu:a100:2(S:0)", "n2": "gpu:2"})
    assert hpc.nodes.get(name="n1").gpu_capacity == 2
    assert list(hpc.nodes.get(name="n1").gpus.values_list("index", flat=True)) == [0, 1]


def test_hostile_gres_never_stops_a_pass(hpc):
    seen = collect_now(hpc, {"n1": "gpu:a100;reboot:4", "n2": "gpu:b200:4", "n3": "x" * 100_000})
    assert seen.nodes == 4 and seen.unknown_gpu_types == ("b200",)
    assert hpc.nodes.get(name="n1").gpu_capacity == 0
    assert "slurm.io/gres" not in hpc.nodes.get(name="n3").labels  # past what is kept: not kept


def test_mig_instances_of_another_model_or_an_unknown_one_are_left_out(hpc):
    seen = collect_now(hpc, {"n1": "gpu:h100:2,gpu:a100_1g.10gb:7", "n2": "gpu:b200_1g.10gb:7"})
    assert hpc.nodes.get(name="n1").gpu_capacity == 2  # one model a node: the whole H100s
    assert not hpc.nodes.get(name="n1").gpus.filter(mig_enabled=True).exists()
    assert hpc.nodes.get(name="n2").gpu_capacity == 0
    assert seen.unknown_gpu_types == ("b200",)


def test_a_mig_node_has_gpus_in_mig_mode_with_their_instances(hpc):
    collect_now(hpc, {"n1": "gpu:a100:1(S:0),gpu:a100_3g.20gb:2(S:0)", "n2": "gpu:1g.10gb:14"})
    n1 = hpc.nodes.get(name="n1")
    assert [(g.index, g.mig_enabled) for g in n1.gpus.order_by("index")] == [(0, False), (1, True)]
    assert list(n1.gpus.get(index=1).mig_instances.values_list("profile", "slices")) == [("3g.20gb", 3)] * 2
    n2 = hpc.nodes.get(name="n2")
    assert [g.mig_instances.count() for g in n2.gpus.order_by("index")] == [7, 7]


def test_a_shared_gpu_on_a_cluster_without_shards_fails_at_once_saying_why(hpc):
    from clusters.adapters.slurm.adapter import SlurmAdapter

    collect_now(hpc, {})
    shared = Share(1, "n1", (0,), gpu_memory_mb=20480, gpu_share=0.25)
    (sent,) = SlurmAdapter().dispatch(hpc, [work(shared)])
    assert (sent.phase, sent.error) == (Phase.FAILED, "")
    assert "no shards configured" in sent.message and "shards_per_gpu" in sent.message


# --- the cluster's GPU settings -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"gpu_type": "a100", "shards_per_gpu": 8}, {"gpu_type": "a100", "shards_per_gpu": 8}),
        ({"mig_gres_types": {"1G.10GB": "a100_1g.10gb"}}, {"mig_gres_types": {"1g.10gb": "a100_1g.10gb"}}),
        ({"gpu_type": None, "shards_per_gpu": 0, "mig_gres_types": {}}, {}),
    ],
    ids=["type-and-shards", "profiles-as-written-by-nvidia", "empty-drops"],
)
def test_gpu_settings(settings, expected):
    from clusters.adapters.slurm.gres import check_settings

    assert check_settings(settings) == expected


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"shards_per_gpu": -1}, "shards_per_gpu must be a whole number"),
        ({"shards_per_gpu": 10**9}, "shards_per_gpu must be a whole number"),
        ({"shards_per_gpu": True}, "shards_per_gpu must be a whole number"),
        ({"shards_per_gpu": "8"}, "shards_per_gpu must be a whole number"),
        ({"gpu_type": "a100,gpu:8"}, "gpu_type must be a GRES type name"),
        ({"mig_gres_types": {"1g.10gb": "x;y"}}, r"mig_gres_types\[1g.10gb\] must be a GRES type name"),
        ({"mig_gres_types": {"big": "x"}}, "not a MIG profile"),
        ({"mig_gres_types": ["1g.10gb"]}, "maps MIG profiles to GRES types"),
        ({"mig_gres_types": {f"1g.{i}gb": "x" for i in range(1, 100)}}, "at most 64"),
        ({"partition": "gpu"}, "not a GPU setting"),
    ],
    ids=[
        "negative-shards",
        "huge-shards",
        "boolean-shards",
        "text-shards",
        "a-type-asking-for-more",
        "a-mig-type-with-a-semicolon",
        "not-a-profile",
        "not-a-mapping",
        "too-many",
        "unknown-setting",
    ],
)
def test_gpu_settings_that_are_refused(settings, why):
    from clusters.adapters.slurm.api import SlurmError
    from clusters.adapters.slurm.gres import check_settings

    with pytest.raises(SlurmError, match=why) as caught:
        check_settings(settings)
    assert caught.value.field == "gres"


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--shards-per-gpu", "0"], "connection test failed"),
        (["--shards-per-gpu", "-4"], "shards_per_gpu must be a whole number"),
        (["--mig-gres-type", "1g.10gb"], "takes PROFILE=TYPE"),
        (["--mig-gres-type", "1g.10gb=a100,shard:9"], "must be a GRES type name"),
        (["--gpu-type", "a100", "--mig-gres-type", "3g.40gb=big_3g"], "connection test failed"),
    ],
    ids=["zero-is-none", "negative", "no-type", "a-type-asking-for-more", "valid-then-connects"],
)
def test_add_cluster_checks_the_gpu_settings_before_connecting(db, tmp_path, options, said):
    """Refused settings never reach slurmrestd; valid ones go on to the connection test (which
    fails here: nothing listens at the URL)."""
    from django.core.management import CommandError, call_command

    token = tmp_path / "jwt"
    token.write_text("jwt")
    with pytest.raises(CommandError, match=said):
        call_command(
            "add_cluster",
            "--kind=slurm",
            "--name=hpc",
            "--url=http://127.0.0.1:9",
            f"--token-file={token}",
            *options,
        )


@pytest.fixture
def slurmrestd():
    """A stand-in for slurmrestd that replays the recorded answers over real HTTP (onboarding
    needs one answering; the real one runs only under the ``slurm`` fixture)."""
    import http.server
    import threading

    nodes = (RECORDINGS / "slurm-22.05-nodes.json").read_bytes()

    class Replay(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path.startswith("/slurm/v0.0.38/")
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(
                (nodes if self.path.endswith("/nodes") else b'{"errors": []}') if found else b"{}"
            )

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_onboarding_keeps_the_gpu_settings_until_told_otherwise(db, slurmrestd):
    from clusters.services.onboarding import onboard_slurm
    from tests.factories import ensure_catalog

    ensure_catalog()
    settings = {"gpu_type": "a100", "shards_per_gpu": 8, "mig_gres_types": {"1g.10gb": "small"}}
    cluster, _ = onboard_slurm("hpc", slurmrestd, "jwt", gres=settings)
    assert {k: cluster.config[k] for k in settings} == settings
    cluster, _ = onboard_slurm("hpc", slurmrestd, "jwt-rotated")  # a new token: the rest stays
    assert {k: cluster.config[k] for k in settings} == settings
    cluster, _ = onboard_slurm("hpc", slurmrestd, "jwt", gres={"shards_per_gpu": None})
    assert "shards_per_gpu" not in cluster.config and cluster.config["gpu_type"] == "a100"
