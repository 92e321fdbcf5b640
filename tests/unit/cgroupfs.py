"""rmdir as on a cgroup file system, for fake cgroups made of plain directories and files."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmckpt.node import task_cgroup


def fake_rmdir(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A cgroup's control files go with it, and one that holds a process is busy. Returns the removed
    names, each with its freezer state at removal (v1 `freezer.state`, v2 `cgroup.freeze`)."""
    removed: list[str] = []
    real_rmdir = os.rmdir

    def rmdir(path) -> None:
        if Path(path, "cgroup.procs").read_text().strip():
            raise OSError(16, "Device or resource busy")
        state = next((Path(path, f).read_text() for f in ("freezer.state", "cgroup.freeze")
                      if Path(path, f).exists()), "")
        for control in Path(path).iterdir():
            control.unlink()
        real_rmdir(path)
        removed.append(f"{Path(path).name} {state}".strip())
    monkeypatch.setattr(task_cgroup.os, "rmdir", rmdir)
    return removed
