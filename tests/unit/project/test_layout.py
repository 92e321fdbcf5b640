"""The package's layout is its architecture (docs/architecture.md, "Layout"), checked on the source itself,
every import counted, the lazy ones inside functions too.

One direction between the packages. The units are slurmckpt's subpackages (rank/sharing/ one of its own) and
its top-level modules; `ORDER` places them lowest first, and a unit imports only units below its own place:

    leaves        the top-level modules (errors identity validate duration sizes rates policy config channel,
                  and the package itself): no side of their own; they import one another (never in a circle)
    node          the node's kernel interfaces: /proc, cgroups, packet filters, processes
    slurm criu cuda   the drivers of what slurmckpt drives: Slurm's commands and environment, CRIU, the GPU
    store         the image store (it tells Slurm, through slurm/, what became of a job's images)
    rank/sharing  what a rank shares with other ranks (it keeps files' checksums in the store)
    rank          one rank's stage tables, over all of the above
    barrier       the GPU lock rounds                   the user side, which imports nothing of root's
    coordinator   one per job, hosted by a wrapper      below it either (the checks after the order's)
    agent task    the two sides of one task: root's agent and the user's wrapper; neither imports the other,
                  both stand on the coordinator (the wrapper hosts it, the agent commits for it and reads its
                  budget)
    cli           the commands; __main__ above it

A rank answers its agent and never sees the coordinator, so a rank's need of the coordinator's numbers (the
measured rates) lives in a leaf both use. Within one place only the leaves import each other; no two units
import each other in a circle anywhere (`cycles`). Besides the order: what runs as the job's user (task/,
the coordinator it hosts, barrier/) never imports what runs as root, only the parts of node/, slurm/ and
cuda/ named in USER_SIDE; coordinator/ stands on the leaves alone; the top level stays small; no module grows
past 400 lines."""
from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src"
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
# Lowest first (the docstring says why); a unit imports only the units of a lower place, or of its own place
# where that place is in SIDEWAYS.
ORDER: tuple[tuple[str, ...], ...] = (
    ("slurmckpt", "slurmckpt.errors", "slurmckpt.identity", "slurmckpt.validate", "slurmckpt.duration",
     "slurmckpt.sizes", "slurmckpt.rates", "slurmckpt.policy", "slurmckpt.config", "slurmckpt.channel"),
    ("slurmckpt.node",),
    ("slurmckpt.slurm", "slurmckpt.criu", "slurmckpt.cuda"),
    ("slurmckpt.store",),
    ("slurmckpt.rank.sharing",),
    ("slurmckpt.rank",),
    ("slurmckpt.barrier",),
    ("slurmckpt.coordinator",),
    ("slurmckpt.agent", "slurmckpt.task"),
    ("slurmckpt.cli",),
    ("slurmckpt.__main__",),
)
SIDEWAYS = {0}          # the leaves


def modules_under(src: Path) -> dict[str, Path]:
    """Every module of the slurmckpt package under `src`, by its dotted name."""
    def name(path: Path) -> str:
        parts = list(path.relative_to(src).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return {name(p): p for p in (src / "slurmckpt").rglob("*.py")}


MODULES = modules_under(SRC)


def imports(module: str, modules: Mapping[str, Path] | None = None) -> set[str]:
    """Every slurmckpt module `module` imports, at its top or inside any function."""
    modules = MODULES if modules is None else modules
    found = set()
    for node in ast.walk(ast.parse(modules[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
    return {m for m in found if m in modules}


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


# ---- the packages' graph: one direction, no circle ----------------------------------------------------------
def unit(module: str, modules: Mapping[str, Path]) -> str:
    """The unit a module belongs to: its package (rank/sharing/ is one of its own), or itself at the top."""
    if modules[module].name == "__init__.py" or module.count(".") < 2:
        return module
    return module.rsplit(".", 1)[0]


def package_graph(modules: Mapping[str, Path] | None = None) -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: the imports that make the edge, "module -> module"}."""
    modules = MODULES if modules is None else modules
    graph: dict[str, dict[str, list[str]]] = {unit(m, modules): {} for m in modules}
    for m in sorted(modules):
        for target in sorted(imports(m, modules)):
            a, b = unit(m, modules), unit(target, modules)
            if a != b:
                graph[a].setdefault(b, []).append(f"{m} -> {target}")
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle per group of units that import one another (a strongly connected component, Tarjan's):
    its units in import order, the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(sorted(g)[0], set(g), graph) for g in sorted(groups, key=min)]


def _circle(start: str, group: set[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """The shortest path from `start` back to itself inside `group`."""
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path + [start]
            if w in group and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"{start} is in no circle")


def place(name: str, order: tuple[tuple[str, ...], ...] = ORDER) -> int | None:
    return next((i for i, units in enumerate(order) if name in units), None)


def upward(graph: Mapping[str, Mapping[str, list[str]]], order: tuple[tuple[str, ...], ...] = ORDER,
           sideways: set[int] = SIDEWAYS) -> list[str]:
    """Every import of a unit by one that is not above it in `order` (nor beside it where allowed)."""
    out = []
    for a, targets in sorted(graph.items()):
        for b, why in sorted(targets.items()):
            pa, pb = place(a, order), place(b, order)
            if pa is None or pb is None or pb > pa or (pb == pa and pa not in sideways):
                out.append(f"{a} -> {b} ({'; '.join(why)})")
    return out


def describe(circle: list[str], graph: Mapping[str, Mapping[str, list[str]]]) -> str:
    steps = "; ".join(graph[a][b][0] for a, b in zip(circle, circle[1:]))
    return f"{' -> '.join(circle)} ({steps})"


def test_no_packages_import_each_other_in_a_circle():
    graph = package_graph()
    assert [describe(c, graph) for c in cycles(graph)] == []


def test_every_import_goes_down_the_order():
    assert upward(package_graph()) == []


def test_every_package_has_its_place_in_the_order():
    placed = [name for units in ORDER for name in units]
    assert sorted(n for n in package_graph() if place(n) is None) == [] and len(placed) == len(set(placed))


def test_the_check_names_a_circle_planted_in_a_package_tree(tmp_path):
    """The checks themselves can fail: a store module that imports slurm/ at its top, and a slurm module that
    imports the store back inside a function, make a circle, named with the imports that close it; the
    order names the upward one."""
    files = {"__init__.py": "", "store/__init__.py": "", "slurm/__init__.py": "",
             "store/keep.py": "from slurmckpt.slurm.note import one_line\n",
             "slurm/note.py": "def one_line():\n    from slurmckpt.store.keep import JobStore\n    return JobStore\n"}
    for name, text in files.items():
        (tmp_path / "slurmckpt" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "slurmckpt" / name).write_text(text)
    graph = package_graph(modules_under(tmp_path))
    assert [describe(c, graph) for c in cycles(graph)] == [
        "slurmckpt.slurm -> slurmckpt.store -> slurmckpt.slurm (slurmckpt.slurm.note -> slurmckpt.store.keep; "
        "slurmckpt.store.keep -> slurmckpt.slurm.note)"]
    assert upward(graph) == ["slurmckpt.slurm -> slurmckpt.store (slurmckpt.slurm.note -> slurmckpt.store.keep)"]


def test_a_circle_through_three_packages_is_found_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_unit_beside_another_or_outside_the_order_is_upward():
    graph = {"x": {"y": ["x.m -> y.m"]}, "y": {}, "z": {"x": ["z.m -> x.m"]}, "w": {"z": ["w.m -> z.m"]}}
    order = (("x", "y"), ("z",))
    assert upward(graph, order, set()) == ["w -> z (w.m -> z.m)", "x -> y (x.m -> y.m)"]
    assert upward(graph, order, {0}) == ["w -> z (w.m -> z.m)"]


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


def test_the_unit_tests_are_grouped_like_the_source():
    """tests/unit/<package>/ for each package of src/slurmckpt (its tests only), project/ for the project's own
    checks, fixtures/ for captured files; the top-level modules' tests and the shared fakes at the top."""
    unit = Path(__file__).resolve().parents[1]
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    groups = {p.name for p in unit.iterdir() if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
    assert groups <= packages | {"project"}, sorted(groups - packages - {"project"})
    top_tests = {p.stem[len("test_"):] for p in unit.glob("test_*.py")}
    assert top_tests <= {p.stem for p in PKG.glob("*.py")}, sorted(top_tests - {p.stem for p in PKG.glob("*.py")})
