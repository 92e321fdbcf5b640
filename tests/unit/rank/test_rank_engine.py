"""rank/engine.py: a named table runs in order, each stage timed and kept for the rollback, the epoch's phase
set as it starts and once it is done; the first failure is named and raised, and the rollback undoes exactly
the stages done, last first, every one of them; a settled table runs every stage whatever the others do."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slurmckpt.rank.capture import FINAL_CAPTURE, PERIODIC_CAPTURE, PERSIST, PREPARE, RESUME
from slurmckpt.rank.context import EpochState, Phase, RestoreState
from slurmckpt.rank.engine import Stage, Table, Unsettled, rollback, run_table
from slurmckpt.rank.restore import RESTORE


def table(log: list[str], fail: str = "", settled: bool = False) -> Table[EpochState]:
    def step(name: str):
        def run(ctx, st) -> None:
            log.append(name)
            if name in fail.split(","):
                raise OSError(f"{name} broke")
        return run

    def undo(name: str):
        return lambda ctx, st: log.append(f"undo {name}")
    return Table("t", tuple(Stage(n, step(n), undo(n) if n != "b" else None) for n in ("a", "b", "c", "d")),
                 running=Phase.PREPARING, reached=Phase.PREPARED, settled=settled)


class Ctx:
    class limits:
        stall_after = None


def test_a_table_runs_in_order_times_each_stage_and_reaches_its_phase() -> None:
    log: list[str] = []
    st = EpochState(3)
    run_table(table(log), Ctx(), st)
    assert log == ["a", "b", "c", "d"] and [s.name for s in st.done] == ["a", "b", "c", "d"]
    assert set(st.timings) == {"a", "b", "c", "d"} and st.failed_stage == "" and st.phase is Phase.PREPARED


def test_a_failure_mid_table_is_named_raised_and_rolls_back_exactly_the_stages_done() -> None:
    log: list[str] = []
    st = EpochState(3)
    with pytest.raises(OSError, match="c broke"):
        run_table(table(log, fail="c"), Ctx(), st)
    assert st.failed_stage == "c" and st.phase is Phase.PREPARING and [s.name for s in st.done] == ["a", "b"]
    assert rollback(Ctx(), st) == []
    assert log == ["a", "b", "c", "undo a"]          # b has no undo; c failed, so it is not undone; d never ran
    assert st.done == [] and st.phase is Phase.ROLLED_BACK
    assert rollback(Ctx(), st) == [] and log[-1] == "undo a"       # nothing is undone twice


def test_every_undo_runs_whatever_the_others_do_last_first() -> None:
    log: list[str] = []
    st = EpochState(1)
    run_table(table(log), Ctx(), st)

    def broken(ctx, st) -> None:
        raise RuntimeError("thaw: cgroup.freeze: No such device")
    st.done[3] = Stage("d", st.done[3].run, broken)
    failures = rollback(Ctx(), st)
    assert log[4:] == ["undo c", "undo a"]
    assert [str(f) for f in failures] == ["d: thaw: cgroup.freeze: No such device"]


def test_a_settled_table_runs_every_stage_and_raises_its_failures_together() -> None:
    """RESUME's tree stages: a thaw that fails does not keep the GPUs locked; nothing is timed or kept for
    a rollback, and the phase it reaches is reached only when none failed."""
    log: list[str] = []
    st = EpochState(2)
    with pytest.raises(Unsettled) as e:
        run_table(table(log, fail="a,c", settled=True), Ctx(), st)
    assert log == ["a", "b", "c", "d"] and [str(f) for f in e.value.failures] == ["a: a broke", "c: c broke"]
    assert st.done == [] and st.timings == {} and st.failed_stage == "" and st.phase is Phase.PREPARING
    run_table(table(log, settled=True), Ctx(), st)
    assert st.phase is Phase.PREPARED and st.done == []


def test_the_named_tables_hold_their_stages_in_order_and_name_their_phases() -> None:
    assert PREPARE.names == ("check", "pmi-precheck", "space", "memory", "gpu-lock", "gpu-checkpoint", "freeze",
                             "pmi-idle", "drain-output")
    assert (PREPARE.running, PREPARE.reached) == (Phase.PREPARING, Phase.PREPARED)
    # the two captures have the same stages but for the final one's hand-over (a periodic one runs its host
    # copy beside criu's dump), and reach different phases
    assert FINAL_CAPTURE.names[:-1] == PERIODIC_CAPTURE.names
    assert [s.times_itself for s in PERIODIC_CAPTURE.stages] == [False, True, True, False]
    assert FINAL_CAPTURE.names == ("record", "host-copy", "dump", "snapshot-output", "handover")
    assert (PERIODIC_CAPTURE.reached, FINAL_CAPTURE.reached) == (Phase.CAPTURED, Phase.HANDED_OVER)
    assert RESUME.names == ("thaw", "gpu-restore", "gpu-unlock", "memory") and RESUME.settled
    assert all(s.undo is None for s in RESUME.stages + PERSIST.stages) and PERSIST.names == ("persist",)
    assert RESTORE.names == ("gpu-check", "unpack", "host-copy-ahead", "shared-files", "output", "truncate", "shm", "handovers",
                             "tcp-hold", "criu", "host-copy", "tcp-release", "gpu-restore")
    assert [s.name for s in RESTORE.stages if s.undo] == ["tcp-hold", "criu"]
    assert RestoreState(1).phase is Phase.RESTORING and (RESTORE.running, RESTORE.reached) == (
        Phase.RESTORING, Phase.RESTORED)
    assert not any(t.settled for t in (PREPARE, PERIODIC_CAPTURE, FINAL_CAPTURE, PERSIST, RESTORE))


def test_the_failed_stage_has_one_writer() -> None:
    """`failed_stage` is set in one place, `EpochState.stage_failed`: the engine, the runner (SIZE, the final
    window through it), RESUME's persist and the failure recorder's reset all call it."""
    src = Path(__file__).resolve().parents[3] / "src"
    writers = []
    for path in sorted((src / "slurmckpt").rglob("*.py")):
        tree = ast.parse(path.read_text())
        owner = {id(n): "<module>" for n in ast.walk(tree)}
        for func in ast.walk(tree):          # outer functions first: an inner one claims its own nodes after
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner.update({id(n): func.name for n in ast.walk(func)})
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "failed_stage" for t in targets) or (
                    isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and any(isinstance(a, ast.Constant) and a.value == "failed_stage" for a in node.args)):
                writers.append((str(path.relative_to(src)), owner[id(node)], node.lineno))
    assert sorted({(f, name) for f, name, _ in writers}) == [("slurmckpt/rank/context.py", "stage_failed")], writers

