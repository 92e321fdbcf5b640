"""MPI programs built against Debian's OpenMPI and MPICH (workloads/mpi_ring.c, compiled in the job's work dir),
run under slurmckpt, requeued mid-run and compared with an uninterrupted run of the same program (docs/mpi.md)."""
from __future__ import annotations

import re
import time

import pytest

from tests.integration.slurmjob import AGENT_LOGS, Job, run, submit, workdir

USER = "ckptuser1"
# A one-node allocation: mpirun finds its own host name (the node's NodeHostname) in it and starts the ranks
# itself, without orted or srun, as on any real cluster
LOCAL_MPIRUN = "mpirun.openmpi -np 2"


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


@pytest.mark.coverage(program="MPI ring (C, 2 ranks, 8 MiB deleted shared mapping)", package="openmpi-bin",
                      launcher="mpirun in sbatch", nodes=1)
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
        assert not ring_lines(job)[1], "the ring ended before the requeue"   # its own "final" line
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", restart, timeout=240)
    assert job.wait_done(timeout=400) == "COMPLETED", job.text()[-3000:]
    steps, result = ring_lines(job)
    assert steps == list(range(1, 501)), f"steps not printed exactly once in order: {steps[:5]}...{steps[-5:]}"
    assert result == ref, (result, ref)
    assert "mpirun exit 0" in job.text()
    assert job.restarts() == 2


@pytest.mark.coverage(program="MPI ring (C, 2 ranks)", package="openmpi-bin", launcher="mpirun in sbatch (orted via srun)",
                      nodes=2)
def test_mpirun_starting_orted_through_srun_across_two_nodes_requeued_twice_equals_an_uninterrupted_run() -> None:
    """Across two nodes mpirun in the batch step launches orted on the other node with srun (a step of its
    own) and talks to it over TCP: mpirun's srun is the stand-in (the real srun runs in the wrapper, outside
    the tree), so the batch step is imaged with mpirun and its local rank, captured at one cut with the
    orted step. The script runs a plain srun first, so mpirun's srun is step 1 while the srun run again
    after a requeue is step 0: it restores step 1's images by its token. Requeued twice mid-run (Slurm
    places it on the same nodes): the restored stand-in has its srun run again, whose step restores orted
    and its rank; every step is printed exactly once, the ring's checksum equals an uninterrupted run's,
    and mpirun exits 0."""
    wd = build("mpi-orted")
    args = "300 100"
    ref = reference(wd, "300 0")
    job = submit(USER, wd, f"#!/bin/bash\nsrun -N1 -n1 true\nmpirun.openmpi -np 2 ./mpi_ring {args}\n"
                           "echo mpirun exit $?\n",
                 "-J", "mpi-orted", "-n2", "-N2", "-w", "node1,node2", "--checkpoint-interval=10s")
    for restart in (1, 2):
        requeue_after_a_commit(job, 2)
        job.wait_output(r"batch\.0\]: restored from checkpoint epoch", restart, timeout=240)
        job.wait_output(r"srun of the restored MPI launcher started again", restart, timeout=60)
        # orted's step writes to mpirun's /dev/null: its agent's log says what it did
        wait_for(lambda: orted_restores(job) >= restart, 120, f"orted's step restored ({restart})", job)
    assert job.wait_done(timeout=400) == "COMPLETED", job.text()[-3000:]
    steps, result = ring_lines(job)
    assert steps == list(range(1, 301)), f"steps not printed exactly once in order: {steps[:5]}...{steps[-5:]}"
    assert result == ref, (result, ref)
    assert job.text().count("mpirun exit 0") == 1 and "ABORTED" not in job.text(), job.text()[-3000:]
    assert job.restarts() == 2 and orted_restores(job) == 2 and "launched orted" in orted_log(job)
    assert orted_log(job).count("step 0 takes the name 1") == 2, job.agent_log_tails()


@pytest.mark.coverage(program="MPI ring (C, 2 ranks)", package="mpich",
                      launcher="mpiexec.hydra in sbatch (proxies via srun)", nodes=2)
def test_mpich_mpiexec_starting_its_proxies_through_srun_across_two_nodes_requeued_twice() -> None:
    """MPICH's mpiexec (hydra) in a two-node batch step starts its hydra_pmi_proxy daemons with srun (its
    Slurm bootstrap), and the ranks under them: that srun is the stand-in, so the batch step (mpiexec)
    and the proxies' step are captured at one cut. Requeued twice mid-run: the restored stand-in has its
    srun run again, whose step restores the proxies and ranks; every step is printed exactly once, the
    ring's checksum equals an uninterrupted run's and mpiexec exits 0."""
    # UCX_TLS: the test cluster's nodes share one kernel, which UCX takes for one host (shared memory)
    job = mpich_ring_requeued_twice(
        "mpich-hydra", "export UCX_TLS=tcp,self\nmpiexec.hydra -n 2 ./mpi_ring 300 100\necho mpiexec exit $?\n",
        (r"batch\.0\]: restored from checkpoint epoch", r"srun of the restored MPI launcher started again"),
        "-n2", "-N2", "-w", "node1,node2")
    assert job.text().count("mpiexec exit 0") == 1 and "ABORTED" not in job.text(), job.text()[-3000:]


def requeue_after_a_commit(job: Job, ranks: int) -> None:
    """Requeue once the job's next periodic capture of `ranks` ranks committed, before the ring ended."""
    pattern = rf"committed \(interval\): {ranks} rank"
    job.wait_output(pattern, len(re.findall(pattern, job.text())) + 1, timeout=180)
    assert not ring_lines(job)[1], "the ring ended before the requeue"   # its own "final" line
    job.requeue()


def orted_log(job: Job) -> str:
    """The agent logs of the steps that ran orted (step 1 in the first run, step 0 after each restore)."""
    logs = [AGENT_LOGS / f"agent-{job.id}.{step}.0.log" for step in (0, 1)]
    return "".join(p.read_text() for p in logs if p.exists())


def orted_restores(job: Job) -> int:
    return len(re.findall(r"INFO restored epoch \d+ as pid", orted_log(job)))


def wait_for(done, timeout_s: float, what: str, job: Job) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{job.agent_log_tails()}"
        time.sleep(1)


def mpich_ring_requeued_twice(name: str, script: str, restored: tuple[str, ...], *placement: str):
    """The MPICH ring run by `script` (the batch script after its #! line) in a job placed by `placement`
    (sbatch options), requeued after a periodic capture (batch + 2 ranks) of each of its first two starts,
    each restart awaited by the `restored` output patterns in turn; returns the finished job after checking
    that every step printed once, in order, and the checksum equals an uninterrupted run's."""
    wd = build(name, "mpicc.mpich")
    out = run("mpiexec.mpich", "-n", "2", "./mpi_ring", "300", "0", user=USER, cwd=wd, timeout=300).stdout
    ref = [l for l in out.splitlines() if l.startswith("final ")]
    assert ref, out
    job = submit(USER, wd, f"#!/bin/bash\n{script}", "-J", name, *placement, "--checkpoint-interval=10s")
    for restart in (1, 2):
        requeue_after_a_commit(job, 3)
        for i, pattern in enumerate(restored):
            job.wait_output(pattern, restart, timeout=240 if i == 0 else 60)
    assert job.wait_done(timeout=400) == "COMPLETED", job.text()[-3000:]
    steps, result = ring_lines(job)
    assert steps == list(range(1, 301)), f"steps not printed exactly once in order: {steps[:5]}...{steps[-5:]}"
    assert result == ref, (result, ref)
    assert job.restarts() == 2
    return job


def srun_pmi2(opts: str) -> str:
    return f"srun --mpi=pmi2 {opts} ./mpi_ring 300 100\necho srun exit $?\n"


RANKS_RESTORED = (r"0\.1\]: restored from checkpoint epoch", r"0\.0\]: restored from checkpoint epoch")


@pytest.mark.coverage(program="MPI ring (C, 2 ranks)", package="mpich", launcher="srun --mpi=pmi2", nodes=1)
def test_mpich_srun_pmi2_on_one_node_requeued_twice_equals_an_uninterrupted_run() -> None:
    """MPICH (Debian's, ch4:ucx) ranks started by `srun --mpi=pmi2 -n2`, each its own task with its own agent
    and PID namespace, captured at one cut with the batch step: each rank holds its PMI socket to
    slurmstepd (handed into the tree, dumped as external, replaced by the new step's at the restore) and
    talks to the other rank over TCP on the node's address. Requeued twice mid-run: every step is printed
    exactly once (no restart from step 0), MPI_Finalize's PMI barrier and finalize succeed against the new
    slurmstepd (srun exits 0), and the ring's checksum equals an uninterrupted run's (mpiexec, outside
    Slurm)."""
    job = mpich_ring_requeued_twice("mpich-srun", srun_pmi2("-n2"), RANKS_RESTORED, "-n2", "-N1", "-w", "node1")
    assert job.text().count("srun exit 0") == 1 and "PMI" not in job.text(), job.text()[-3000:]


@pytest.mark.coverage(program="MPI ring (C, 2 ranks)", package="mpich", launcher="srun --mpi=pmi2", nodes=2)
def test_mpich_srun_pmi2_across_two_nodes_requeued_twice_equals_an_uninterrupted_run() -> None:
    """MPICH ranks on two nodes (`srun --mpi=pmi2 -N2 -n2`) talk TCP between the nodes' own addresses:
    both ends are frozen at the barrier and captured, and after each requeue (Slurm places the job on the
    same nodes) each end is restored on its node and held until the other is back. Every step is printed
    exactly once and the ring's checksum equals an uninterrupted run's."""
    job = mpich_ring_requeued_twice("mpich-2n", srun_pmi2("-N2 -n2"), RANKS_RESTORED, "-N2", "-n2", "-w",
                                    "node1,node2")
    assert job.text().count("srun exit 0") == 1 and "ABORTED" not in job.text(), job.text()[-3000:]


def pmi_barrier_lines(job: Job) -> tuple[list[int], list[str]]:
    lines = job.app_lines()
    return [int(l.split()[1]) for l in lines if re.fullmatch(r"step \d+", l)], sorted(
        l for l in lines if re.fullmatch(r"rank \d final [0-9a-f]{16}", l))


@pytest.mark.coverage(program="PMI-1 client (Python, 2 ranks) waiting in slurmstepd's PMI barrier",
                      package="slurm-wlm-basic-plugins", launcher="srun --mpi=pmi2", nodes=1)
def test_a_rank_waiting_in_a_pmi_barrier_is_not_captured_and_the_job_restores_after_it() -> None:
    """Two ranks that speak PMI-1 to slurmstepd themselves: rank 0 waits 30 s in a PMI barrier for rank 1.
    A checkpoint then would hold a request the next slurmstepd never gets (the restored rank would wait
    forever), so every capture in that time thaws, retries, and aborts naming the waiting thread (one line
    per capture, not one per round). After the barrier a capture commits; requeued, both ranks are
    restored, finish and PMI-finalize on the new step: every step is printed once and each rank's checksum
    equals an uninterrupted run's."""
    wd = workdir(USER, "pmi-barrier")
    ref_job = submit(USER, wd, "#!/bin/bash\nsrun --mpi=pmi2 -n2 python3 pmi_barrier.py 0 300\n",
                     "-J", "pmi-ref", "-n2", "-N1")
    assert ref_job.wait_done(timeout=120) == "COMPLETED", ref_job.text()[-2000:]
    ref_steps, ref = pmi_barrier_lines(ref_job)
    assert ref_steps == list(range(1, 301)) and len(ref) == 2, ref_job.text()[-2000:]
    job = submit(USER, wd, "#!/bin/bash\nsrun --mpi=pmi2 -n2 python3 pmi_barrier.py 30 300\necho srun exit $?\n",
                 "-J", "pmi-barrier", "-n2", "-N1", "--checkpoint-interval=10s")
    job.wait_output(r"ABORTED \(rank 0\.0, node [^,]+, stage pmi-(precheck|idle)\): thread \d+ of pid \d+ "
                    r"waits in read\(\) for slurmstepd's answer", timeout=120)
    assert "rank 1 passed the barrier" not in job.text(), "the barrier ended before a capture was tried"
    assert "prepare of epoch" not in job.text(), "each retried lock round reached the job's output"
    job.wait_output("rank 1 passed the barrier", timeout=60)
    commits = len(re.findall(r"committed \(interval\)", job.text()))
    job.wait_output(r"committed \(interval\)", commits + 1, timeout=60)
    assert not re.search(r"rank \d final", job.text()), "the ranks ended before the requeue"
    job.requeue()
    job.wait_output(r"0\.1\]: restored from checkpoint epoch", timeout=240)
    job.wait_output(r"0\.0\]: restored from checkpoint epoch", timeout=60)
    assert job.wait_done(timeout=300) == "COMPLETED", job.text()[-3000:]
    steps, result = pmi_barrier_lines(job)
    assert steps == list(range(1, 301)), f"steps not printed exactly once in order: {steps[:5]}...{steps[-5:]}"
    assert result == ref, (result, ref)
    assert job.text().count("srun exit 0") == 1 and job.restarts() == 1, job.text()[-3000:]
