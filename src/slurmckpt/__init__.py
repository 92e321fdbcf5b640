"""slurmckpt: transparent checkpoint/restore for Slurm jobs."""
from __future__ import annotations

__version__ = "0.2.0"
