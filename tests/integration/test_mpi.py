"""MPI programs built against Debian's OpenMPI and MPICH (workloads/mpi_ring.c, compiled in the job's work dir),
run under slurmckpt, requeued mid-run and compared with an uninterrupted run of the same program (docs/mpi.md)."""
from __future__ import annotations

import re

import pytest

from tests.integration.slurmjob import Job, run, submit, workdir

USER = "ckptuser1"
# mpirun starting its ranks itself on the batch node (what it does wherever the node's hostname is its Slurm
# name; the test nodes are network namespaces that all answer "vm", so it is said explicitly here)
LOCAL_MPIRUN = "mpirun.openmpi --mca plm ^slurm --mca ras ^slurm -np 2"


def build(name: str, mpicc: str = "mpicc.openmpi"):
    wd = workdir(USER, name)
    run(mpicc, "-O2", "-o", "mpi_ring", "mpi_ring.c", user=USER, cwd=wd)
    return wd


def reference(wd, args: str) -> list[str]:
    """The result lines of an uninterrupted run of the same program, outside Slurm."""
    out = run("bash", "-c", f"{LOCAL_MPIRUN} ./mpi_ring {args}", user=USER, cwd=wd, timeout=300).stdout
    return [l for l in out.splitlines() if l.startswith(("final ", "ghost "))]


def ring_lines(job: Job) -> tuple[list[int], list[str]]:
    steps = [int(m.group(1)) for l in job.app_lines() if (m := re.match(r"step (\d+) sum", l))]
    return steps, [l for l in job.app_lines() if l.startswith(("final ", "ghost "))]


def test_openmpi_mpirun_on_one_node_requeued_twice_equals_an_uninterrupted_run() -> None:
    """mpirun -np 2 in a batch script, rank 0 holding an 8 MiB deleted shared mapping (a ghost file above
    criu's 1 MiB default, sized from the tree): requeued twice mid-run, every step is printed exactly once
    (no restart from step 0), and the ring's checksum and the mapping's contents equal an uninterrupted
    run's."""
    wd = build("mpi-local")
    args = "500 100 8"
    ref = reference(wd, "500 0 8")
    job = submit(USER, wd, f"#!/bin/bash\n{LOCAL_MPIRUN} ./mpi_ring {args}\necho mpirun exit $?\n",
                 "-J", "mpi-local", "-n2", "-N1", "-w", "node1", "--checkpoint-interval=10s")
    for restart in (1, 2):
        job.wait_output(r"committed \(interval\)", restart, timeout=180)
        assert "final " not in job.text(), "the ring ended before the requeue"
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", restart, timeout=240)
    assert job.wait_done(timeout=400) == "COMPLETED", job.text()[-3000:]
    steps, result = ring_lines(job)
    assert steps == list(range(1, 501)), f"steps not printed exactly once in order: {steps[:5]}...{steps[-5:]}"
    assert result == ref, (result, ref)
    assert "mpirun exit 0" in job.text()
    assert job.restarts() == 2


@pytest.mark.parametrize("nodes,why", [
    (["-N1", "-w", "node1"], r"to the batch step, which is running srun"),
    (["-N2"], r"TCP connection\(s\) to another host: .*an MPI job across nodes is not checkpointable yet"),
], ids=["one-node", "two-nodes"])
def test_mpirun_starting_orted_through_srun_is_refused_before_freezing_and_runs_on(nodes, why) -> None:
    """mpirun in the batch step launches orted with srun (a second step) and talks to it over TCP. On one
    node (the node's own address) the connection is inside the job, but the batch step running srun would
    be replayed, not restored; across nodes the other end is on another host. Either way every capture is
    refused in PREPARE naming the cause, and the job completes with the uninterrupted result (never
    restarted)."""
    wd = build("mpi-orted")
    ref = reference(wd, "150 0")
    job = submit(USER, wd, "#!/bin/bash\nmpirun.openmpi -np 2 ./mpi_ring 150 100\necho mpirun exit $?\n",
                 "-J", "mpi-orted", "-n2", *nodes, "--checkpoint-interval=10s")
    job.wait_output(r"ABORTED \(rank [\w.]+, node [^,]+, stage check\): .*" + why, timeout=120)
    assert job.wait_done(timeout=300) == "COMPLETED", job.text()[-3000:]
    steps, result = ring_lines(job)
    assert steps == list(range(1, 151)) and result == ref, (steps[-3:], result, ref)
    if nodes[0] == "-N1":     # the node's own address is the job's
        assert "TCP connection(s) to another host" not in job.text()
    assert "restored from checkpoint" not in job.text() and job.restarts() == 0


def test_mpich_srun_pmi2_on_one_node_requeued_twice_equals_an_uninterrupted_run() -> None:
    """MPICH (Debian's, ch4:ucx) ranks started by `srun --mpi=pmi2 -n2`, each its own task with its own agent
    and PID namespace, captured at one cut with the batch step: each rank holds its PMI socket to
    slurmstepd (handed into the tree, dumped as external, replaced by the new step's at the restore) and
    talks to the other rank over TCP on the node's address. Requeued twice mid-run: every step is printed
    exactly once (no restart from step 0), MPI_Finalize's PMI barrier and finalize succeed against the new
    slurmstepd (srun exits 0), and the ring's checksum equals an uninterrupted run's (mpiexec, outside
    Slurm)."""
    wd = build("mpich-srun", "mpicc.mpich")
    out = run("mpiexec.mpich", "-n", "2", "./mpi_ring", "300", "0", user=USER, cwd=wd, timeout=300).stdout
    ref = [l for l in out.splitlines() if l.startswith("final ")]
    assert ref, out
    job = submit(USER, wd, "#!/bin/bash\nsrun --mpi=pmi2 -n2 ./mpi_ring 300 100\necho srun exit $?\n",
                 "-J", "mpich-srun", "-n2", "-N1", "-w", "node1", "--checkpoint-interval=10s")
    for restart in (1, 2):      # each requeue after a periodic capture of this start (batch + 2 ranks)
        commits = len(re.findall(r"committed \(interval\): 3 rank", job.text())) + 1
        job.wait_output(r"committed \(interval\): 3 rank", commits, timeout=180)
        assert "final " not in job.text(), "the ring ended before the requeue"
        job.requeue()
        job.wait_output(r"0\.1\]: restored from checkpoint epoch", restart, timeout=240)
        job.wait_output(r"0\.0\]: restored from checkpoint epoch", restart, timeout=60)
    assert job.wait_done(timeout=400) == "COMPLETED", job.text()[-3000:]
    steps, result = ring_lines(job)
    assert steps == list(range(1, 301)), f"steps not printed exactly once in order: {steps[:5]}...{steps[-5:]}"
    assert result == ref, (result, ref)
    assert job.text().count("srun exit 0") == 1 and "PMI" not in job.text(), job.text()[-3000:]
    assert job.restarts() == 2
