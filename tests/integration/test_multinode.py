"""The multi-node cluster (`make setup NODES=3`, one slurmd per network namespace): every rank of
a job across nodes is captured at one consistent cut, restored after requeues, and on other nodes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.slurmjob import run, submit, workdir, PGREP_HERE

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from exchange import expected_lines  # noqa: E402

USER = "ckptuser1"
REPO = Path(__file__).resolve().parents[2]
RING = "#!/bin/bash\necho \"preamble on $(hostname)\" >> preamble.log\nsrun python3 exchange.py --steps {steps} " \
       "--sleep 0.1 --dir .\necho \"epilogue rc=$?\"\n"


def nodes() -> list[str]:
    return run("sinfo", "-h", "-N", "-o", "%N").stdout.split()


def test_cluster_has_several_nodes() -> None:
    assert len(set(nodes())) >= 3, "the multi-node tests need `make setup NODES=3`"


def check_ring(job, ranks: int, steps: int) -> None:
    lines = job.app_lines()
    for r in range(ranks):
        assert [l for l in lines if l.startswith(f"r{r} ")] == expected_lines(r, ranks, steps), f"rank {r}"
    assert not [l for l in lines if "BAD" in l]
    assert lines[-1] == "epilogue rc=0"


def test_two_nodes_two_tasks_ring_survives_two_requeues() -> None:
    """(a) 2 nodes x 2 tasks exchange sequence-numbered messages; captured and requeued twice: none lost,
    none duplicated, the output equals an uninterrupted run's."""
    wd = workdir(USER, "mn-ring")
    job = submit(USER, wd, RING.format(steps=300), "-N2", "--ntasks-per-node=2", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\): 5 rank")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 4)
    job.wait_output(r"committed \(interval\): 5 rank", 2)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 8)
    assert job.wait_done() == "COMPLETED"
    check_ring(job, 4, 300)
    assert job.restarts() == 2


def test_node_lost_after_commit_restores_on_remaining_nodes() -> None:
    """(c) a node is powered off after a commit: Slurm requeues the job, which restores on other nodes."""
    wd = workdir(USER, "mn-nodeloss")
    job = submit(USER, wd, RING.format(steps=400), "-N2", "--ntasks-per-node=1", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\): 3 rank")
    first = run("squeue", "-h", "-j", str(job.id), "-o", "%N").stdout.strip()
    victim = run("scontrol", "show", "hostnames", first).stdout.split()[-1]
    subprocess.run(["bash", str(REPO / "scripts/cluster.sh"), "stop-node", victim], check=True)
    try:
        job.wait_output(r"restored from checkpoint epoch", 2, timeout=300)
        now = run("squeue", "-h", "-j", str(job.id), "-o", "%N").stdout.strip()
        assert victim not in run("scontrol", "show", "hostnames", now).stdout.split()
        assert job.wait_done() == "COMPLETED"
    finally:
        subprocess.run(["bash", str(REPO / "scripts/cluster.sh"), "start-node", victim], check=True)
    check_ring(job, 2, 400)


def test_killed_agent_aborts_epochs_job_runs_on_and_previous_commit_restores() -> None:
    """(b) kill -9 of one rank's root agent: the next epochs abort (the job runs on), and after a requeue
    every rank restores the last epoch committed before the kill, consistently."""
    wd = workdir(USER, "mn-agentkill")
    job = submit(USER, wd, RING.format(steps=400), "-N2", "--ntasks-per-node=1", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\): 3 rank")
    agent = run(*PGREP_HERE, "-f", f"slurmckpt agent .*--job {job.id} --step 0 --rank 1 ").stdout.split()
    assert agent, "no agent found for rank 0.1"
    run("kill", "-9", *agent)
    job.wait_output(r"ABORTED", timeout=60)
    assert job.state() == "RUNNING"
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    check_ring(job, 2, 400)
