"""Integration tests run against the real local cluster started by `make setup` (slurmctld, slurmd, munge,
slurmdbd, the SPANK plugin, CRIU). A missing piece is a failure here, never a skip."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.integration.coverage_matrix import Matrix


@pytest.fixture(scope="session", autouse=True)
def cluster() -> None:
    assert os.geteuid() == 0, "integration tests run as root (they submit as the test users)"
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    assert sinfo.returncode == 0, f"Slurm is not running (run `make setup`): {sinfo.stderr}"
    assert any(s.startswith(("idle", "mixed", "allocated")) for s in sinfo.stdout.split()), \
        f"no usable node: {sinfo.stdout}"
    plug = open("/etc/slurm/plugstack.conf").read()
    assert "slurmckpt_spank.so" in plug, "the SPANK plugin is not in plugstack.conf"


TEST_USERS = ("ckptuser1", "ckptuser2")


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """Each test starts on an empty queue: a job a failed test left running (a hung workload, a held job)
    would hold the nodes the next tests wait for and fail them too."""
    yield
    left = subprocess.run(["squeue", "-h", "-o", "%i", "-u", ",".join(TEST_USERS)], capture_output=True,
                          text=True).stdout.split()
    if not left:
        return
    for user in TEST_USERS:
        subprocess.run(["scancel", f"--user={user}"], capture_output=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and subprocess.run(
            ["squeue", "-h", "-o", "%i", "-u", ",".join(TEST_USERS)], capture_output=True, text=True).stdout.strip():
        time.sleep(1)


_matrix = Matrix()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "coverage(program, package, launcher, nodes, proctrack): a row of the "
                                       "coverage matrix (tests/integration/coverage_matrix.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _matrix.add(item, report)


def pytest_terminal_summary(terminalreporter) -> None:
    if _matrix.rows:
        terminalreporter.write_sep("=", "coverage matrix (build/coverage.md)")
        terminalreporter.write(_matrix.write())
