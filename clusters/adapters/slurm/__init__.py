"""Slurm clusters: ``api`` talks to slurmrestd and maps its answers (pure functions tested on
recorded output), ``inventory`` keeps nodes and GPUs current, ``adapter`` runs attempts."""

from clusters.adapters.slurm.adapter import SlurmAdapter

__all__ = ["SlurmAdapter"]
