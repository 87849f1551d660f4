"""The launch environment of distributed training: the variables every kind gives each node of
an attempt, single-node jobs included (one node, rank 0), so that ``torchrun`` and the launchers
that read PyTorch's names start a gang as written.

The convention (docs/distributed-training.md):

* ``NNODES`` — nodes of the attempt; ``NODE_RANK`` — this node's rank, 0 on the head;
* ``LOCAL_WORLD_SIZE`` — processes per node for a launcher that starts one per GPU: the GPUs
  of each node (1 for a CPU job); ``WORLD_SIZE`` — ``NNODES × LOCAL_WORLD_SIZE``;
* ``RANK`` — ``NODE_RANK × LOCAL_WORLD_SIZE``, the global rank of the node's first process.
  ``torchrun`` computes ``WORLD_SIZE`` and each process's ``RANK`` itself and overrides both in
  the processes it starts: it is given ``--node_rank=$NODE_RANK``;
* ``MASTER_ADDR`` — the head's address; ``MASTER_PORT`` — the port agreed for the attempt
  (``JobAttempt.master_port``, the same on every node and for every delivery of the attempt);
* the same under ``ORRERY_`` names: ``ORRERY_NNODES``, ``ORRERY_NODE_RANK``,
  ``ORRERY_WORLD_SIZE``, ``ORRERY_LOCAL_WORLD_SIZE``, ``ORRERY_HEAD_ADDR``,
  ``ORRERY_MASTER_PORT``.

Every name here is the platform's: the job's own ``env`` cannot override one (a rank or port of
its own would split the gang). Pure: no Django, so the agent side could use it as well.
"""

from __future__ import annotations

DEFAULT_MASTER_PORT = 29500  # PyTorch's own default; the start of the range agreed ports come from

#: Every name the launch environment sets, on any kind.
LAUNCH_NAMES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "RANK",
        "NODE_RANK",
        "NNODES",
        "ORRERY_NNODES",
        "ORRERY_NODE_RANK",
        "ORRERY_WORLD_SIZE",
        "ORRERY_LOCAL_WORLD_SIZE",
        "ORRERY_HEAD_ADDR",
        "ORRERY_MASTER_PORT",
    }
)
#: The names that depend on the node (its rank) and on where the head is.
RANK_NAMES = ("NODE_RANK", "ORRERY_NODE_RANK", "RANK")
HEAD_NAMES = ("MASTER_ADDR", "ORRERY_HEAD_ADDR")


def local_world_size(gpus_per_node: int) -> int:
    """Processes per node for a one-process-per-GPU launcher: the node's GPUs, 1 without any."""
    return max(gpus_per_node, 1)


def launch_env(
    *,
    nnodes: int,
    gpus_per_node: int,
    master_port: int | None,
    node_rank: int | None = None,
    head_addr: str | None = None,
) -> dict[str, str]:
    """The launch variables of one node. ``node_rank`` None leaves out ``RANK_NAMES`` and
    ``head_addr`` None ``HEAD_NAMES``: a kind that only knows them where the job runs (Slurm's
    allocation, a Kubernetes pod's index) sets those itself, by the same rules."""
    nnodes = max(nnodes, 1)
    local = local_world_size(gpus_per_node)
    port = str(master_port or DEFAULT_MASTER_PORT)
    env = {
        "NNODES": str(nnodes),
        "WORLD_SIZE": str(nnodes * local),
        "LOCAL_WORLD_SIZE": str(local),
        "MASTER_PORT": port,
        "ORRERY_NNODES": str(nnodes),
        "ORRERY_WORLD_SIZE": str(nnodes * local),
        "ORRERY_LOCAL_WORLD_SIZE": str(local),
        "ORRERY_MASTER_PORT": port,
    }
    if node_rank is not None:
        rank = str(node_rank)
        env |= {"NODE_RANK": rank, "ORRERY_NODE_RANK": rank, "RANK": str(node_rank * local)}
    if head_addr is not None:
        env |= {"MASTER_ADDR": head_addr, "ORRERY_HEAD_ADDR": head_addr}
    return env
