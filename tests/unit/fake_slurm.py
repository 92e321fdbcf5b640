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
