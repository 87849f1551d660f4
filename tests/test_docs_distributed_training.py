"""docs/distributed-training.md: its ``torchrun`` examples work as written. Each ``run`` is
expanded by ``/bin/sh`` with the launch environment of every node of a 2 × 8 GPU gang
(clusters/adapters/launch.py), and the command line that results is parsed with torchrun's own
options. ``torchrun`` here is a stand-in (no PyTorch on the test machines): it parses the same
flags (both spellings, ``--node_rank`` and ``--node-rank``) and prints what it would use."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from clusters.adapters.launch import launch_env
from scheduling.spec import parse_job_spec

DOC = Path(__file__).resolve().parents[1] / "docs" / "distributed-training.md"
TORCHRUN = """#!{python}
import argparse, json
p = argparse.ArgumentParser()
for name in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port",
             "rdzv_backend", "rdzv_endpoint", "rdzv_id"):
    p.add_argument("--" + name, "--" + name.replace("_", "-"), dest=name)
p.add_argument("script")
print(json.dumps(vars(p.parse_args())))
"""


def examples() -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    return [yaml.safe_load(textwrap.dedent(b)) for b in blocks]


def run_on_each_node(run: str, tmp_path: Path, nodes: int = 2, gpus: int = 8) -> list[dict]:
    (tmp_path / "torchrun").write_text(TORCHRUN.format(python=sys.executable))
    (tmp_path / "torchrun").chmod(0o755)
    seen = []
    for rank in range(nodes):
        env = launch_env(
            nnodes=nodes, gpus_per_node=gpus, master_port=29501, node_rank=rank, head_addr="gpu-07"
        )
        env |= {"PATH": f"{tmp_path}:/usr/bin:/bin", "ORRERY_JOB_ID": "74"}
        done = subprocess.run(["/bin/sh", "-c", run], env=env, capture_output=True, text=True, check=True)
        seen.append(json.loads(done.stdout))
    return seen


def test_the_static_rendezvous_example_gives_each_node_its_rank_and_one_head(tmp_path):
    job = examples()[0]
    spec = parse_job_spec(job)  # a job spec the API accepts as it is
    assert (spec.nodes, spec.gpus.count, spec.gpus.model) == (2, 8, "h100")
    seen = run_on_each_node(job["spec"]["run"], tmp_path)
    assert [s["node_rank"] for s in seen] == ["0", "1"]
    assert {(s["nnodes"], s["nproc_per_node"], s["master_addr"], s["master_port"]) for s in seen} == {
        ("2", "8", "gpu-07", "29501")
    }
    assert {s["script"] for s in seen} == {"train.py"}


def test_the_dynamic_rendezvous_example_points_every_node_at_the_head(tmp_path):
    run = examples()[1]["run"]
    seen = run_on_each_node(run, tmp_path)
    assert seen[0] == seen[1]  # c10d: no node rank, every node alike
    assert (seen[0]["rdzv_endpoint"], seen[0]["rdzv_id"], seen[0]["nnodes"]) == ("gpu-07:29501", "74", "2")
