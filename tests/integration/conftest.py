"""Integration tests run against the real local cluster started by `make setup` (slurmctld, slurmd, munge,
slurmdbd, the SPANK plugin, CRIU). A missing piece is a failure here, never a skip."""
from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture(scope="session", autouse=True)
def cluster() -> None:
    assert os.geteuid() == 0, "integration tests run as root (they submit as the test users)"
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    assert sinfo.returncode == 0, f"Slurm is not running (run `make setup`): {sinfo.stderr}"
    assert any(s.startswith(("idle", "mixed", "allocated")) for s in sinfo.stdout.split()), \
        f"no usable node: {sinfo.stdout}"
    plug = open("/etc/slurm/plugstack.conf").read()
    assert "slurmckpt_spank.so" in plug, "the SPANK plugin is not in plugstack.conf"
