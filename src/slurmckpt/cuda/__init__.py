"""GPU state of a checkpoint: the CUDA driver's process checkpoint API, its fake, the per-rank GPU stage and
GPU remapping on restore.

Importing this package (or any module in it) never loads libcuda: `driver.load_driver()` does, and only the
GPU stage of a tree that holds CUDA state calls it.
"""
from __future__ import annotations
