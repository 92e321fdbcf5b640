"""Abort messages on the real cluster (two ranks on two nodes, `make setup NODES=3`): a PREPARE that outlasts
its timeout is reported in the job's stderr naming every rank that had not answered, its node and the phase;
an abort the ranks confirm only after the coordinator's wait is reported naming each rank and why; the ranks
still undo their part when they get to it (nothing stays frozen), and the job ends with the uninterrupted
result."""
from __future__ import annotations

import re

import pytest

from tests.integration.slurmjob import submit, workdir
from tests.integration.test_failures import CONFIG, RING, USER, check_ring, frozen_trees, manual_checkpoint

STALL_S = 45       # every rank pauses this long after its freeze: past PREPARE's 5 s and the abort's 30 s wait


@pytest.fixture
def slow_prepare():
    """Agents and coordinators started while active: PREPARE times out after 5 s; ranks stall after freeze."""
    original = CONFIG.read_text()
    CONFIG.write_text(re.sub(r"(?m)^prepare_timeout_s:.*$", "prepare_timeout_s: 5", original)
                      + f"\ndebug_stall_after: \"freeze:{STALL_S}\"\n")
    yield
    CONFIG.write_text(original)


def test_a_prepare_timeout_names_the_silent_ranks_and_an_abort_confirmed_late(slow_prepare) -> None:
    wd = workdir(USER, "abort-messages")
    job = submit(USER, wd, RING.format(steps=600), "-N2", "--ntasks-per-node=1", "--checkpoint-interval=30m")
    job.wait_output(r"(?m)^r1 ", timeout=120)
    manual_checkpoint(job)
    job.wait_output(r"epoch \d+ \(manual\) ABORTED \(rank [\w.]+, node [^,]+, stage prepare\): no answer to prepare "
                    r"within 5\.0s from rank [\w.]+ \(node [^)]+\), rank [\w.]+ \(node [^)]+\), rank [\w.]+ \(node "
                    r"[^)]+\) \(0 of 3 rank\(s\) answered\); undoing it did not complete: rank [\w.]+ \(node [^)]+\) "
                    r"did not confirm within 30\.0s", timeout=120)
    line = next(l for l in job.text().splitlines() if "ABORTED" in l)
    for rank in ("batch.0", "0.0", "0.1"):
        assert f"rank {rank} (node " in line, line
    assert job.state() == "RUNNING"
    job.wait_for(lambda: not frozen_trees(job.id), "every tree thawed once its stall ended", STALL_S + 30)
    assert "committed (manual)" not in job.text()
    assert job.wait_done() == "COMPLETED"
    check_ring(job, 2, 600)
