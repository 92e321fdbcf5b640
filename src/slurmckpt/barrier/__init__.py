"""Cross-rank consistency: the lock rounds that give every GPU rank of a job one consistent cut."""
from __future__ import annotations
