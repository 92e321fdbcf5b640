"""No silent restart from zero (docs/contracts.md, "Fresh starts"), on the real cluster: a requeued job that
has no checkpoint to restore says why in the first lines of its (truncated) output and in its AdminComment,
and `slurmckpt status` shows the failed final capture."""
from __future__ import annotations

import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from tests.integration.slurmjob import run, submit, workdir

USER = "ckptuser1"
CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
STEPS = 40
FRESH = r"slurmckpt\[[^]]*\]: starting from the beginning \(restart 1\): "


def admin_comment(job, pattern: str, timeout: float = 60) -> str:
    """The job's AdminComment as accounting (sacct) has it, once it matches `pattern`."""
    deadline = time.monotonic() + timeout
    while True:
        text = run("sacct", "-n", "-X", "-P", "-j", str(job.id), "-o", "AdminComment%1000", check=False).stdout
        if re.search(pattern, text) or time.monotonic() > deadline:
            return text.strip()
        time.sleep(2)


def app_steps(job) -> list[str]:
    return [l for l in job.app_lines() if l.startswith("tethered")]


def test_a_refused_final_capture_is_named_by_the_fresh_start_its_admin_comment_and_status() -> None:
    """The program holds a unix stream socket to a process outside the job, so every capture is refused
    (ipc.py). Requeued mid-run (and held), the final capture fails; the new run's first output line names
    that capture (epoch, rank) and the refusal, the program starts from step 0 once and runs to its end,
    sacct's AdminComment carries the same reason, and `slurmckpt status` (root and the job's user) shows it;
    the job's user sees the failed final capture, in the store's record and in AdminComment, in `slurmckpt
    status` already before the job runs again."""
    wd = workdir(USER, "freshstart-refused")
    with outside_listener(wd / "outside.sock"):
        job = submit(USER, wd, "#!/bin/bash\n"
                     f"python3 tethered.py --connect outside.sock --steps {STEPS} --sleep 0.5\n",
                     "-J", "freshstart-refused", "--checkpoint-interval=10m")
        job.wait_output(r"tethered step 3\n")
        run("scontrol", "requeuehold", str(job.id))      # held: the failed final capture is news before the rerun
        pending: list[str] = []

        def status_names_it() -> bool:
            pending.append(run(CLI, "status", str(job.id), user=USER).stdout)
            return "the final capture at epoch" in pending[-1] and "AdminComment: slurmckpt: the final" in pending[-1]
        job.wait_for(status_names_it, "slurmckpt status to show the failed final capture, its AdminComment too",
                     timeout=60)
        job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
        assert "starting from the beginning" not in job.text(), "the job restarted before status was read"
        assert re.search(r"AdminComment: slurmckpt: the final capture at epoch \d+ failed on rank batch\.0: "
                         r".*outside\.sock", pending[-1]), pending[-1]
        run("scontrol", "release", str(job.id))
        job.wait_for(lambda: "starting from the beginning" in job.text() and "tethered PASS" in job.text()
                     and job.state() == "COMPLETED", "the second run to complete", timeout=300)
        lines = job.text().splitlines()
        first = re.fullmatch(FRESH + r"the final capture at epoch (\d+) failed on rank batch\.0: (.*)", lines[0])
        assert first, "first line does not say why the job starts afresh:\n" + "\n".join(lines[:5])
        epoch, reason = first.group(1), first.group(2)
        assert re.search(r"unix stream socket .* is connected to .*outside\.sock in a process outside this task",
                         reason), reason
        assert app_steps(job) == (["tethered starting at step 0"] + [f"tethered step {i}" for i in range(STEPS)]
                                  + [f"tethered PASS steps={STEPS}"])
        comment = admin_comment(job, "started from the beginning")
        assert comment.startswith(f"slurmckpt: started from the beginning (restart 1): the final capture at "
                                  f"epoch {epoch} failed on rank batch.0: "), comment
        assert "outside.sock" in comment and "\n" not in comment
        as_root = run(CLI, "status", str(job.id)).stdout
        assert f"last failed capture: the final capture at epoch {epoch} failed on rank batch.0: " in as_root, as_root
        as_user = run(CLI, "status", str(job.id), user=USER).stdout
        assert f"AdminComment: slurmckpt: started from the beginning (restart 1): the final capture at epoch " \
               f"{epoch}" in as_user, as_user


def test_a_refused_final_capture_passes_slurms_sigterm_on_to_the_program() -> None:
    """Every capture of the job is refused (a unix socket to a process outside it). Requeued, its final
    capture fails, and the program then gets the SIGTERM Slurm sent, as it would without slurmckpt: its own
    handler runs (its output, kept in a file of its own, says so) instead of a SIGKILL after KillWait."""
    wd = workdir(USER, "refused-sigterm")
    with outside_listener(wd / "outside.sock"):
        job = submit(USER, wd, "#!/bin/bash\n"
                     "python3 tethered.py --connect outside.sock --steps 400 --sleep 0.5 &\n"
                     "python3 sigterm_trap.py --steps 400 --sleep 0.25 >> trap.out\n"
                     "wait\n", "-J", "refused-sigterm", "--checkpoint-interval=10m")
        trap = wd / "trap.out"
        job.wait_for(lambda: trap.exists() and "sigterm_trap step 3" in trap.read_text(), "the trap's step 3", 120)
        job.requeue()
        job.wait_for(lambda: "sigterm_trap caught SIGTERM" in trap.read_text(), "the program's SIGTERM handler", 60)
        job.wait_output(r"starting from the beginning \(restart 1\): the final capture at epoch", timeout=240)
        run("scancel", str(job.id))
    first_run = trap.read_text().split("sigterm_trap caught SIGTERM")[0]
    assert "sigterm_trap step 3" in first_run and "result" not in first_run


@contextmanager
def outside_listener(sock: Path):
    """A process of the job's user outside the job, holding every connection made to `sock`."""
    outside = subprocess.Popen(["runuser", "-u", USER, "--", "python3", str(sock.parent / "tethered.py"), "--serve",
                                str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not Path(f"{sock}.ready").exists():
            assert time.monotonic() < deadline and outside.poll() is None, "the outside listener did not start"
            time.sleep(0.1)
        yield outside
    finally:
        outside.kill()
        outside.wait()


def test_a_job_requeued_before_any_commit_says_no_checkpoint_committed_yet() -> None:
    """A job that ran to its end without a checkpoint (interval never reached) and is then requeued starts
    from the beginning and says that nothing was committed; its AdminComment says the same."""
    wd = workdir(USER, "freshstart-uncommitted")
    job = submit(USER, wd, "#!/bin/bash\npython3 tethered.py --steps 3 --sleep 0.2\n",
                 "-J", "freshstart-uncommitted", "--checkpoint-interval=10m")
    assert job.wait_done() == "COMPLETED"
    assert "starting from the beginning" not in job.text()        # a first run has nothing to explain
    job.requeue()
    job.wait_for(lambda: "starting from the beginning" in job.text() and "tethered PASS" in job.text()
                 and job.state() == "COMPLETED", "the requeued run to complete", timeout=240)
    lines = job.text().splitlines()
    assert re.fullmatch(FRESH + "no checkpoint committed yet", lines[0]), "\n".join(lines[:5])
    assert app_steps(job) == ["tethered starting at step 0", "tethered step 0", "tethered step 1",
                              "tethered step 2", "tethered PASS steps=3"]
    comment = admin_comment(job, "no checkpoint committed yet")
    assert comment == "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet", comment
