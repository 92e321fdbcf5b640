"""Two ranks of one step on one node talking through IPC (workloads/ipc_pair.py): restored exactly where
separate per-rank restores can bring the channel back, refused before anything is frozen where not."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.slurmjob import submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from ipc_pair import expected_lines  # noqa: E402

USER = "ckptuser1"
STEPS = 150


def rank_lines(job, rank: int) -> list[str]:
    return [l for l in job.app_lines() if l.startswith(f"r{rank} ")]


@pytest.mark.parametrize("mech,where", [("tcp", ["-N1"]), ("shm", ["-w", "node1"])])
def test_ranks_talking_over_ipc_resume_exactly_after_requeue(mech: str, where: list[str]) -> None:
    """tcp: the first rank back holds the connection until the other is (netlock); shm: the segment is
    written back once per restore of the node (sharing/shm_files.py) and mapped again in place."""
    wd = workdir(USER, f"ipc-{mech}")
    job = submit(USER, wd, "#!/bin/bash\n"
                 f"srun -n2 python3 ipc_pair.py --mech {mech} --steps {STEPS} --sleep 0.2\n",
                 "-n2", *where, "--checkpoint-interval=15s")
    job.wait_output(r"committed \(interval\)")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    for rank in (0, 1):
        assert rank_lines(job, rank) == expected_lines(rank, STEPS)
    assert job.restarts() == 1


@pytest.mark.parametrize("mech,named", [("ustream", "stream socket"), ("udgram", "datagram socket"),
                                        ("fifo", "named pipe")])
def test_ipc_that_separate_restores_cannot_bring_back_is_refused_and_the_job_runs_on(mech: str, named: str) -> None:
    wd = workdir(USER, f"ipc-{mech}")
    job = submit(USER, wd, "#!/bin/bash\n"
                 f"srun -n2 python3 ipc_pair.py --mech {mech} --steps 100 --sleep 0.2\n",
                 "-n2", "-N1", "--checkpoint-interval=10s")
    job.wait_output(r"ABORTED \(rank \d+\.\d, node [^,]+, stage check\): .*state shared outside this rank's process "
                    r"tree cannot be restored: .*" + named, timeout=120)
    assert job.wait_done() == "COMPLETED"
    for rank in (0, 1):
        assert rank_lines(job, rank) == expected_lines(rank, 100)
