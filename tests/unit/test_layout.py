"""The package's layout is its architecture (docs/architecture.md, "Layout"), checked on the source itself:
what runs as the job's user (task/, the coordinator it hosts) never imports what runs as root, not even
lazily inside a function; coordinator/ stands on nothing above it; the top level stays small; no module
grows past 400 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "slurmckpt"
LEAVES = {"slurmckpt", "slurmckpt.errors", "slurmckpt.validate", "slurmckpt.duration", "slurmckpt.sizes",
          "slurmckpt.identity", "slurmckpt.rates"}
# What the user side may load: its own packages, the coordinator it hosts, Slurm's client side, reading
# /proc, the frameworks' GPU defaults it sets, and the leaves. Anything else (agent/, rank/, store/, criu/,
# the node's privileged drivers, the CUDA checkpoint driver) is root's.
USER_SIDE = LEAVES | {"slurmckpt.channel", "slurmckpt.config", "slurmckpt.policy", "slurmckpt.node.procfs",
                      "slurmckpt.node.proctree", "slurmckpt.cuda.frameworks", "slurmckpt.cuda.nccl",
                      "slurmckpt.cuda.release", "slurmckpt.slurm.control",
                      "slurmckpt.slurm.env", "slurmckpt.slurm.jobrecord", "slurmckpt.slurm.queue",
                      "slurmckpt.slurm.pmi", "slurmckpt.slurm.window", "slurmckpt.node", "slurmckpt.cuda", "slurmckpt.slurm"}
USER_PACKAGES = ("slurmckpt.task", "slurmckpt.coordinator", "slurmckpt.barrier")


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PKG.rglob("*.py")}


def imports(module: str) -> set[str]:
    """Every slurmckpt module `module` imports, at its top or inside any function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return {m for m in found if m in MODULES}


def reached(start: str) -> dict[str, str]:
    """Every module `start` loads, directly or not, with the module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        here = todo.pop()
        for m in imports(here):
            if m not in seen and m != start:
                seen[m] = here
                todo.append(m)
    return seen


def _outside(start: str, allowed) -> list[str]:
    return [f"{m} (imported by {by})" for m, by in sorted(reached(start).items()) if not allowed(m)]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(USER_PACKAGES)))
def test_the_user_side_never_imports_root_side_code(module):
    assert _outside(module, lambda m: m in USER_SIDE or m.startswith(USER_PACKAGES)) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("slurmckpt.coordinator")))
def test_the_coordinator_stands_on_nothing_above_it(module):
    below = ("slurmckpt.coordinator", "slurmckpt.barrier")
    assert _outside(module, lambda m: m in LEAVES or m.startswith(below)) == []


def test_the_check_sees_a_root_import_hidden_in_a_function(tmp_path, monkeypatch):
    """The check itself can fail: a lazy import of the agent inside a user-side function is found."""
    fake = tmp_path / "wrapper.py"
    fake.write_text("def helper():\n    from slurmckpt.agent.service import Agent\n    return Agent\n")
    monkeypatch.setitem(MODULES, "slurmckpt.task.fake", fake)
    assert "slurmckpt.agent.service (imported by slurmckpt.task.fake)" in _outside(
        "slurmckpt.task.fake", lambda m: m in USER_SIDE or m.startswith(USER_PACKAGES))


def test_the_top_level_holds_at_most_a_dozen_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top



def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
