"""io_uring in a checkpointed job (docs/gpu.md, "io_uring"): every tree starts under init's seccomp filter, so a
program that asks for a ring gets EPERM, before and after a restore, and its tree is captured; with the job's
opt-out (SLURMCKPT_IO_URING=allow) it gets its ring, and the capture's check stage refuses it before anything is
frozen, naming the process, its executable and io_uring. One node: runs in the Slurm 26.05 suite."""
from __future__ import annotations

import re

from tests.integration.slurmjob import Job, node, run, submit, workdir

USER = "ckptuser1"
PROGRAM = "#!/bin/bash\n./io_uring_steps {steps} {ms} {keep_at}\necho \"epilogue rc=$?\"\n"


def build(name: str):
    wd = workdir(USER, name)
    run("gcc", "-O2", "-o", "io_uring_steps", "io_uring_steps.c", user=USER, cwd=wd)
    return wd


def lines(answer: str, steps: int) -> list[str]:
    """What the program prints when every io_uring_setup answers `answer`: an uninterrupted run."""
    return [f"step {i} io_uring_setup: {answer}" for i in range(steps)] + ["done", "epilogue rc=0"]


def finish(job: Job) -> str:
    try:
        assert job.wait_done() == "COMPLETED", job.text()[-3000:]
    finally:
        run("scancel", str(job.id), check=False)
    return job.text()


def test_a_program_asking_for_io_uring_gets_eperm_and_is_captured_and_restored() -> None:
    """Requeued after an interval commit: restored, not restarted, and the restored process's own calls still
    get EPERM (criu brought the filter back with it); its output equals an uninterrupted run's."""
    wd = build("io-uring-blocked")
    job = submit(USER, wd, PROGRAM.format(steps=80, ms=250, keep_at=0), "-w", node("node1"),
                 "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch")
    text = finish(job)
    assert "holds an io_uring" not in text and "ABORTED" not in text, text[-3000:]
    assert job.app_lines() == lines("EPERM", 80), text[-3000:]
    assert job.restarts() == 1


def test_with_the_jobs_opt_out_a_ring_is_made_and_the_capture_refused_naming_it() -> None:
    """The ring is kept from step 60 on (12 s in): the capture before commits, the one after is refused in its
    check stage, before any freeze; the job runs on to a correct end."""
    wd = build("io-uring-allowed")
    job = submit(USER, wd, PROGRAM.format(steps=120, ms=200, keep_at=60), "-w", node("node1"),
                 "--checkpoint-interval=10s", "--export=ALL,SLURMCKPT_IO_URING=allow")
    job.wait_output(r"committed \(interval\)")
    exe = re.escape(str(wd / "io_uring_steps"))
    job.wait_output(rf"ABORTED \(rank batch\.0, node [^,]+, stage check\): pid \d+ \(io_uring_steps, {exe}\) "
                    r"holds an io_uring instance: criu cannot checkpoint io_uring", timeout=120)
    text = finish(job)
    assert job.app_lines() == lines("ring", 120), text[-3000:]
