"""rank/engine.py: a table runs in order, each stage timed and kept for the rollback; the first failure is
handed to the caller's rollback with its stage named; undos run last first and every one of them runs."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slurmckpt.rank.context import EpochState
from slurmckpt.rank.engine import Stage, run_table, settle, undo_steps


def table(log: list[str], fail: str = "") -> tuple[Stage, ...]:
    def step(name: str):
        def run(ctx, st) -> None:
            log.append(name)
            if name == fail:
                raise OSError(f"{name} broke")
        return run

    def undo(name: str):
        return lambda ctx, st: log.append(f"undo {name}")
    return tuple(Stage(n, step(n), undo(n) if n != "b" else None) for n in ("a", "b", "c", "d"))


class Ctx:
    class limits:
        stall_after = None


def test_a_table_runs_in_order_and_times_each_stage() -> None:
    log: list[str] = []
    st = EpochState(3)
    run_table(table(log), Ctx(), st, lambda stage, e: pytest.fail("nothing failed"))
    assert log == ["a", "b", "c", "d"] and [s.name for s in st.done] == ["a", "b", "c", "d"]
    assert set(st.timings) == {"a", "b", "c", "d"} and st.failed_stage == ""


def test_the_first_failure_is_named_and_handed_to_the_rollback_then_raised() -> None:
    log: list[str] = []
    st = EpochState(3)
    seen: list[tuple[str, str]] = []

    def rollback(stage: str, error: BaseException) -> None:
        seen.append((stage, str(error)))
        assert settle(undo_steps(st.done), Ctx(), st) == []
    with pytest.raises(OSError, match="c broke"):
        run_table(table(log, fail="c"), Ctx(), st, rollback)
    assert seen == [("c", "c broke")] and st.failed_stage == "c"
    assert log == ["a", "b", "c", "undo a"]          # b has no undo; c failed, so it is not undone; d never ran


def test_every_undo_runs_whatever_the_others_do_last_first() -> None:
    log: list[str] = []
    done = list(table(log))

    def broken(ctx, st) -> None:
        raise RuntimeError("thaw: cgroup.freeze: No such device")
    done[3] = Stage("d", done[3].run, broken)
    failures = settle(undo_steps(done), Ctx(), EpochState(1))
    assert log == ["undo c", "undo a"]
    assert [str(f) for f in failures] == ["d: thaw: cgroup.freeze: No such device"]


def test_the_failed_stage_has_one_writer() -> None:
    """`failed_stage` is set in one place, `EpochState.stage_failed`: the engine, the runner (SIZE, the final
    window through it), RESUME's persist and the failure recorder's reset all call it."""
    src = Path(__file__).resolve().parents[2] / "src"
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

