"""A stand-in for the agent's rank runner (rank/runner.py) where a test needs only a few of its parts: the
failed stage it keeps, set through `stage_failed` as the real one is, and whatever else the test gives it."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def fake_runner(failed_stage: str = "", **parts: Any) -> SimpleNamespace:
    fake = SimpleNamespace(failed_stage=failed_stage, **parts)
    fake.stage_failed = lambda stage: setattr(fake, "failed_stage", stage)
    return fake
