"""The shim puts the wrapper in front of every wrapped task in the launch form the running Slurm has
(docs/slurm-versions.md, docs/contracts.md "SPANK shim behaviour"): from Slurm 23.02.5 on through
`spank_prepend_task_argv` (the task's argv kept whole behind the wrapper, SLURMCKPT_TASK_ARGV=prepended),
before that by replacing argv[0] (SLURMCKPT_TASK_ARGV0 holds the old one). Seen from outside, in the
processes Slurm lists for the job."""
from __future__ import annotations

import re
from pathlib import Path

from tests.integration.slurmjob import job_field, run, submit, workdir

USER = "ckptuser1"
PREPEND_SINCE = (23, 2, 5)


def slurm_version() -> tuple[int, int, int]:
    out = run("sinfo", "-V").stdout
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    assert m, f"sinfo -V printed no version: {out!r}"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def wrapper_path() -> str:
    m = re.search(r"^\s*required\s+\S*slurmckpt_spank\.so\b.*\bwrapper=(\S+)",
                  Path("/etc/slurm/plugstack.conf").read_text(), re.M)
    assert m, "plugstack.conf has no slurmckpt line with wrapper="
    return m.group(1)


def wrappers(job_id: int, wrapper: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """step name -> (the wrapper's arguments after its own path, its SLURMCKPT_TASK_* variables), for each
    wrapper among the processes `scontrol listpids` shows for the job."""
    out = run("scontrol", "listpids", str(job_id), job_field(job_id, "NodeList") or "").stdout
    found = {}
    for line in out.splitlines()[1:]:
        cols = line.split()      # PID JOBID STEPID LOCALID GLOBALID
        if len(cols) < 3 or not cols[0].isdigit():
            continue
        try:
            argv = Path(f"/proc/{cols[0]}/cmdline").read_bytes().decode().split("\0")[:-1]
            environ = Path(f"/proc/{cols[0]}/environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if wrapper not in argv:
            continue
        form = dict(e.split("=", 1) for e in environ if e.startswith("SLURMCKPT_TASK_ARGV"))
        found[cols[2]] = (argv[argv.index(wrapper) + 1:], form)
    return found


def test_wrapper_goes_in_front_of_batch_and_srun_tasks_in_the_form_this_slurm_has() -> None:
    """A batch step and an `srun sleep` step of one job: their wrappers' arguments are the task's whole argv
    (prepend form) or argv[1:] with argv[0] in SLURMCKPT_TASK_ARGV0 (older Slurm), and exactly one of the two
    variables is set."""
    prepend = slurm_version() >= PREPEND_SINCE
    wrapper = wrapper_path()
    wd = workdir(USER, "launchform")
    job = submit(USER, wd, "#!/bin/bash\necho started\nsrun -n1 sleep 300\n", "--checkpoint-interval=10m")
    try:
        job.wait_output("started", timeout=120)
        seen: dict = {}
        job.wait_for(lambda: seen.update(wrappers(job.id, wrapper)) or {"batch", "0"} <= seen.keys(),
                     "the wrappers of the batch step and step 0 in scontrol listpids", 60)
    finally:
        run("scancel", str(job.id))
    batch_args, batch_form = seen["batch"]
    step_args, step_form = seen["0"]
    if prepend:
        assert step_args == ["sleep", "300"], f"step 0's wrapper got {step_args}: not the task's whole argv"
        assert step_form == {"SLURMCKPT_TASK_ARGV": "prepended"}, step_form
        assert len(batch_args) == 1 and batch_args[0].endswith("/slurm_script"), batch_args
        assert batch_form == {"SLURMCKPT_TASK_ARGV": "prepended"}, batch_form
    else:
        assert step_args == ["300"], f"step 0's wrapper got {step_args}: argv[0] was not replaced"
        assert step_form == {"SLURMCKPT_TASK_ARGV0": "sleep"}, step_form
        assert batch_args == [], batch_args
        assert set(batch_form) == {"SLURMCKPT_TASK_ARGV0"} and batch_form["SLURMCKPT_TASK_ARGV0"].endswith(
            "/slurm_script"), batch_form
