"""A fake of the Slurm client tools as slurm/control.py's CliSlurm runs them (through subprocess.run), for unit
tests: it answers per command name and records every command line. The real tools: tests/integration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from slurmckpt.slurm import control


@dataclass
class Ran:
    """What subprocess.run returns, as far as CliSlurm reads it."""
    returncode: int
    stdout: str
    stderr: str = ""


Answer = Union[str, Ran, Callable[[list[str]], Union[str, Ran]]]


class FakeSlurm:
    """`FakeSlurm(squeue='...', scancel=Ran(1, '', 'denied'))`: stdout for a command, a whole result, or a
    function of the command line; a command without an answer succeeds with no output."""

    def __init__(self, **answers: Answer) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str], **kw: object) -> Ran:
        self.calls.append(list(cmd))
        answer = self.answers.get(cmd[0], "")
        if callable(answer):
            answer = answer(list(cmd))
        return answer if isinstance(answer, Ran) else Ran(0, answer)

    def install(self, monkeypatch) -> FakeSlurm:
        monkeypatch.setattr(control.subprocess, "run", self)
        return self

    def ran(self, name: str) -> list[list[str]]:
        return [c for c in self.calls if c[0] == name]


def squeue_line(job_id: int, user: str = "ckptuser1", uid: int = 1001, state: str = "RUNNING", restarts: int = 0,
                partition: str = "debug", qos: str = "normal", nodes: str = "node1", array: tuple | None = None,
                admin_comment: str = "(null)", comment: str = "(null)", reqnodes: str = "") -> str:
    """One line of `squeue -h -O` as slurm/queue.py asks for it (the fields it names, each followed by the
    separator), the way Slurm 22.05 prints them."""
    from slurmckpt.slurm.queue import SEP
    array_job, task = array if array else (job_id, "N/A")
    values = [job_id, array_job, task, user, uid, state, restarts, partition, qos, nodes, reqnodes, "None",
              admin_comment, comment]
    return "".join(f"{v}{SEP}" for v in values) + "\n"


def squeue_answer(*lines: str):
    """An squeue answer that knows exactly these jobs: `-j` of any other id fails like squeue does."""
    from slurmckpt.slurm.queue import SEP
    known = {line.split(SEP)[0]: line for line in lines}
    known.update({f"{line.split(SEP)[1]}_{line.split(SEP)[2]}": line for line in lines})

    def answer(cmd: list[str]) -> Ran:
        if "-j" not in cmd:
            return Ran(0, "".join(lines))
        wanted = cmd[cmd.index("-j") + 1].split(",")
        found = [known[w] for w in wanted if w in known]
        if not found and len(wanted) == 1:
            return Ran(1, "", "slurm_load_jobs error: Invalid job id specified")
        return Ran(0, "".join(found))
    return answer


def squeue_states(states: dict[int, str]):
    """squeue as job_states asks it, one job at a time (`-O jobid,state -j N`), knowing `states`; the whole
    queue (`--all`, or 22.05's `--json`, which lists every job whatever -j says) is an error here."""
    from slurmckpt.slurm.queue import SEP

    def answer(cmd: list[str]) -> Ran:
        if "--all" in cmd or "--json" in cmd or "-j" not in cmd or "," in cmd[cmd.index("-j") + 1]:
            raise AssertionError(f"asked slurmctld for more than the job in hand: {cmd}")
        job = int(cmd[cmd.index("-j") + 1])
        if job not in states:
            return Ran(1, "", "slurm_load_jobs error: Invalid job id specified")
        return Ran(0, f"{job}{SEP}{states[job]}{SEP}\n")
    return answer
