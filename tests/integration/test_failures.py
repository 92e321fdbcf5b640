"""Deaths inside an epoch and the coordinator's own death, on the real cluster: a rank's wrapper or root agent killed
with SIGKILL inside PREPARE or CAPTURE, or the job's coordinator process killed between or inside epochs;
the two ranks run on two nodes (`make setup NODES=3`).
Every time: the epoch aborts (nothing committed), nothing stays frozen, the job runs on, and after a requeue
every rank restores the last commit from before the kill, so the output equals an uninterrupted run's."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests.integration.slurmjob import task_cgroups, run, submit, workdir, PGREP_HERE

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from exchange import expected_lines  # noqa: E402

USER = "ckptuser1"
CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
CONFIG = Path("/etc/slurmckpt/slurmckpt.yaml")
RING = "#!/bin/bash\nsrun python3 exchange.py --steps {steps} --sleep 0.1 --dir .\necho \"epilogue rc=$?\"\n"
STALL_S = 12     # the pause injected inside the stage (debug_stall_after): the window in which we kill


@pytest.fixture
def stall_after():
    """Agents started while the fixture is active pause STALL_S after the given stage (admin config)."""
    original = CONFIG.read_text()

    def set_stage(stage: str) -> None:
        CONFIG.write_text(original + f"\ndebug_stall_after: \"{stage}:{STALL_S}\"\n")
    yield set_stage
    CONFIG.write_text(original)


def check_ring(job, ranks: int, steps: int) -> None:
    lines = job.app_lines()
    for r in range(ranks):
        assert [l for l in lines if l.startswith(f"r{r} ")] == expected_lines(r, ranks, steps), f"rank {r}"
    assert lines[-1] == "epilogue rc=0"


def manual_checkpoint(job) -> None:
    run(CLI, "checkpoint", str(job.id), user=job.user)


def pids(pattern: str) -> list[str]:
    return run(*PGREP_HERE, "-f", pattern, check=False).stdout.split()


def frozen_trees(job_id: int) -> list[str]:
    """Task cgroups of this job that hold processes and are FROZEN right now (an empty cgroup left frozen,
    when slurmstepd's final SIGKILL ended the tree with its agent and watchdog, freezes nothing; the next
    start of the task removes it)."""
    found = []
    for cg in task_cgroups(job_id):
        try:
            if cg.pids() and cg.state() != "THAWED":
                found.append(cg.path.name)
        except OSError:
            pass
    return found


def wait_frozen(job, timeout: float = 30) -> None:
    job.wait_for(lambda: frozen_trees(job.id), "a frozen tree (inside the epoch)", timeout)


def wrapper_of(job_id: int, rank: int) -> list[str]:
    """The wrapper process of rank 0.<rank> (slurmstepd execs it as the task; found by its environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if b"slurmckpt-wrap" not in (proc / "cmdline").read_bytes():
                continue
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode(), b"SLURM_STEP_ID=0"} <= env:
            found.append(proc.name)
    return found


VICTIMS = {
    "wrapper": lambda job: wrapper_of(job.id, 1),
    "agent": lambda job: agent_of(job.id, 1),
}


def agent_of(job_id: int, rank: int) -> list[str]:
    """The root agent of rank 0.<rank>, not its thaw watchdog (a fork of it, with the same command line)."""
    found = pids(f"slurmckpt agent .*--job {job_id} --step 0 --rank {rank} ")
    return [p for p in found if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] not in found]


# freeze: inside PREPARE; dump: inside CAPTURE. Each victim once, each stage once (the other two pairings ran
# in CI until the suite outgrew its time: they add no path the agent's and the wrapper's death do not take)
@pytest.mark.parametrize("stage, victim", [("freeze", "agent"), ("dump", "wrapper")])
def test_rank_killed_inside_epoch_aborts_and_previous_commit_restores(stall_after, victim: str,
                                                                       stage: str) -> None:
    wd = workdir(USER, f"kill-{victim}-{stage}")
    stall_after(stage)
    job = submit(USER, wd, RING.format(steps=300), "-N2", "--ntasks-per-node=1",
                 "--checkpoint-interval=30m")
    job.wait_output(r"(?m)^r1 ", timeout=120)
    manual_checkpoint(job)
    job.wait_output(r"committed \(manual\): 3 rank", timeout=120)
    manual_checkpoint(job)
    wait_frozen(job)
    time.sleep(1)
    targets = VICTIMS[victim](job)
    assert targets, f"no {victim} found for rank 0.1 of job {job.id}"
    run("kill", "-9", *targets)
    job.wait_output(r"epoch \d+ \(manual\) ABORTED", timeout=120)
    assert job.state() == "RUNNING"
    job.wait_for(lambda: not frozen_trees(job.id), "every tree thawed after the abort", 30)
    assert len(re.findall(r"committed \(manual\)", job.text())) == 1
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    check_ring(job, 2, 300)
    job.wait_for(lambda: not task_cgroups(job.id), "no cgroup of the job's trees left, of either start", 30)


def coordinator_pids(job_id: int) -> list[str]:
    return pids(f"slurmckpt.coordinator.host --link [0-9]+ --job {job_id}$")


@pytest.mark.parametrize("when", ["between", "inside"])
def test_coordinator_killed_job_runs_on_and_new_epochs_commit(stall_after, when: str) -> None:
    """The coordinator's own death never kills the job: ranks thaw and run on, a new coordinator takes
    over, the next epoch commits, and a requeue restores it."""
    wd = workdir(USER, f"kill-coordinator-{when}")
    if when == "inside":
        stall_after("freeze")
    job = submit(USER, wd, RING.format(steps=300), "-N2", "--ntasks-per-node=1",
                 "--checkpoint-interval=30m")
    job.wait_output(r"(?m)^r1 ", timeout=120)
    manual_checkpoint(job)
    job.wait_output(r"committed \(manual\): 3 rank", timeout=120)
    first = coordinator_pids(job.id)
    assert len(first) == 1, f"want one coordinator process, got {first}"
    if when == "inside":
        manual_checkpoint(job)
        wait_frozen(job)
    run("kill", "-9", *first)
    job.wait_output(r"coordinator died \(signal 9\)")
    job.wait_output(r"reconnected to the job's coordinator", 3, timeout=60)
    if when == "inside":
        job.wait_output(r"abandoned \(its coordinator was lost mid-epoch\)", 2, timeout=60)
    job.wait_for(lambda: not frozen_trees(job.id), "every tree thawed", 60)
    assert job.state() == "RUNNING"
    assert coordinator_pids(job.id) and coordinator_pids(job.id) != first
    manual_checkpoint(job)
    job.wait_output(r"committed \(manual\): 3 rank", 2, timeout=120)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    check_ring(job, 2, 300)
    epochs = [int(e) for e in re.findall(r"checkpoint epoch (\d+) committed", job.text())]
    assert epochs == sorted(set(epochs)), f"an epoch number was reused: {epochs}"


def newest_committed(job_id: int) -> tuple[int, Path]:
    manifests = list(Path("/var/lib/slurmckpt/images").glob(f"*/{job_id}/manifest.json"))
    assert len(manifests) == 1, manifests
    epoch = max(e["epoch"] for e in json.loads(manifests[0].read_text())["epochs"])
    return epoch, manifests[0].parent / f"epoch-{epoch:06d}"


def test_rank_that_cannot_restore_withdraws_the_epoch_for_every_rank() -> None:
    """Coordinated fallback: one rank's images of the newest epoch are damaged. It must not fall back alone
    (the job would be at no common cut): the epoch is withdrawn for every rank, the job is requeued, and all
    ranks restore the previous epoch together; the output equals an uninterrupted run's."""
    wd = workdir(USER, "withdraw")
    job = submit(USER, wd, RING.format(steps=300), "-N2", "--ntasks-per-node=1", "--checkpoint-interval=30m")
    job.wait_output(r"(?m)^r1 ", timeout=120)
    manual_checkpoint(job)
    job.wait_output(r"committed \(manual\): 3 rank", timeout=120)
    run("scontrol", "requeuehold", str(job.id))           # final capture, then held: time to damage it
    job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
    newest, epoch_dir = newest_committed(job.id)
    pages = sorted((epoch_dir / "0.1").glob("pages-*.img*"), key=lambda p: p.stat().st_size)  # .zst or raw
    assert pages, f"no page images in {epoch_dir / '0.1'}"
    with open(pages[-1], "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    run("scontrol", "release", str(job.id))
    job.wait_output(rf"restore of checkpoint epoch {newest} FAILED.*withdrawing epoch {newest}", timeout=240)
    job.wait_output(r"restored from checkpoint epoch (?!%d)" % newest, 2, timeout=300)
    # read while the job runs: its images go at its end
    manifest = json.loads(next(Path("/var/lib/slurmckpt/images").glob(f"*/{job.id}/manifest.json")).read_text())
    assert [r["epoch"] for r in manifest.get("rejected", [])] == [newest]
    assert job.wait_done() == "COMPLETED"
    check_ring(job, 2, 300)
    assert job.restarts() == 2
