"""Cross-rank consistency as the coordinator runs it: the lock rounds that give every GPU rank of a job one
consistent cut (rounds.py)."""
from __future__ import annotations
