"""Slurm integration: the environment map of a task and job control behind a small interface."""
from __future__ import annotations
