"""The layering the architecture page promises, held by tests that can fail:

* no import cycle among harness modules (backends/ and kernels/ as harness.backends and
  harness.kernels), counting imports inside functions; only ``if TYPE_CHECKING:`` imports
  are exempt. Importing ``a.b.c`` from outside ``a.b`` runs ``a/b/__init__.py`` first, so
  such an import is an edge to each package above the module too;
* the typed config imports neither the stack nor the engine;
* the engine knows the roofline only through the Executor protocol;
* the engine changes the scheduler only through ``add``, ``schedule``, ``end_forward``
  and ``update`` (forks, beam prunes and finishes travel in the step's outcome);
* the core (harness/kv, harness/sched) imports without torch, the backends or the
  kernels; harness/kv and harness/sched form no cycle; no module outside harness/kv
  assigns pool or block-table state; each folder imports only folders at or below its
  layer (:data:`LAYERS`: the application on top, the core at the bottom).
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.engine.engine import Engine
from harness.runner import run
from tests.compose import compose_cfg

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"harness": "harness", "backends": "harness.backends", "kernels": "harness.kernels"}


def module_files() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [*name.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The harness modules ``module`` imports anywhere in its file (functions included),
    but for the body of ``if TYPE_CHECKING:``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for a in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                sub = f"{base}.{a.name}"
                names.add(sub if sub in known else base)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    edges: set[str] = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # the packages above run first
            up = ".".join(parts[:i])
            if up in known and up not in own:
                edges.add(up)
    return edges


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: imported(m, p, known) for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                state[node] = 2
                continue
            nxt = todo.pop()
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    # The detector itself: a function-level import closes a cycle; TYPE_CHECKING does not.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import harness.x.b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import harness.x.a\n"
                 "def f():\n    from harness.x import a\n")
    known = {"harness.x.a", "harness.x.b"}
    graph = {"harness.x.a": imported("harness.x.a", a, known),
             "harness.x.b": imported("harness.x.b", b, known)}
    assert find_cycle(graph) == ["harness.x.a", "harness.x.b", "harness.x.a"]
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import harness.x.a\n")
    graph["harness.x.b"] = imported("harness.x.b", b, known)
    assert find_cycle(graph) is None


def test_no_import_cycles_among_harness_modules() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the walk found the code (backends and kernels included)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def reachable(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen, todo = set(roots), list(roots)
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_config_imports_neither_the_stack_nor_the_engine() -> None:
    static = reachable(import_graph(), ["harness.config"])
    assert not {m for m in static if m == "harness.stack" or m.startswith("harness.engine")}
    # and at run time, in a fresh interpreter (what `import harness.config` really loads)
    code = ("import sys, harness.config; print(' '.join(m for m in sys.modules "
            "if m == 'harness.stack' or m.startswith('harness.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == ""


def test_the_engine_does_not_import_the_roofline() -> None:
    graph = import_graph()
    engine = [m for m in graph if m.startswith("harness.engine")]
    assert not {m for m in reachable(graph, engine) if m.startswith("harness.roofline")}


# The step's entry points, and the roofline's lane step's (LaneScheduler.lane_step_ready:
# a step of decode-lane members only, scheduled and finished without a StepRecord; and its
# members' leaving at the end of a run).
ALLOWED = {"add", "schedule", "end_forward", "update",
           "lane_step_ready", "schedule_lane", "finish_lane", "leave_lane"}


class SchedulerSpy:
    """Stands in for the engine's scheduler: every method the engine calls on it is
    recorded; attributes (queues, the config, the KV manager) pass through."""

    def __init__(self, real: object) -> None:
        object.__setattr__(self, "real", real)
        object.__setattr__(self, "calls", set())

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.real, name)
        if inspect.ismethod(value):
            self.calls.add(name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.real, name, value)


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    calls: set[str] = set()
    original = Engine.run

    def spy_run(self: Engine, *args: Any, **kwargs: Any) -> float:
        spy = SchedulerSpy(self.scheduler)
        self.scheduler = spy  # type: ignore[assignment]
        try:
            return original(self, *args, **kwargs)
        finally:
            calls.update(spy.calls)
            self.scheduler = spy.real  # type: ignore[assignment]

    monkeypatch.setattr(Engine, "run", spy_run)
    return calls


BEAM = ["model=tiny", "workload=beam_search", "workload.n=3", "workload.prompt_tokens=40",
        "workload.output_tokens=12", "workload.num_requests=4", "backend.block_size=8"]
SAMPLES = ["model=tiny", "workload=parallel_sampling", "workload.num_requests=3",
           "workload.prompt_tokens=21", "workload.output_tokens=6", "workload.n=3"]


@pytest.mark.parametrize("overrides", [
    pytest.param([*BEAM, "cache.kv_budget=2MiB"], id="beams"),
    # recompute preemption, then a group too big to readmit: rejected by schedule()
    pytest.param([*BEAM, "cache.kv_budget=64KiB"], id="beams-stuck-head"),
    pytest.param([*SAMPLES, "cache.kv_budget=256KiB"], id="samples"),
    pytest.param([*SAMPLES, "cache.kv_budget=64KiB", "scheduler.preemption_mode=swap",
                  "cache.swap_space=1MiB"], id="samples-swap"),
    pytest.param(["executor=roofline", "workload=random", "workload.num_requests=8"],
                 id="roofline"),
])
def test_the_engine_calls_only_the_schedulers_entry_points(
        spied: set[str], overrides: list[str]) -> None:
    r = run(compose_cfg(overrides))
    assert r.metrics["requests.finished"] > 0
    assert spied & {"schedule", "update"}  # the spy saw the loop
    assert spied <= ALLOWED, f"the engine called {sorted(spied - ALLOWED)} on the scheduler"


# -- the core and the layers (issue #51) ----------------------------------------------------

CORE = ("harness.kv", "harness.sched")


def test_the_core_imports_without_torch_backends_or_kernels() -> None:
    """A fresh interpreter imports every module under harness/kv and harness/sched (found
    by their files: harness/kv/policies is a namespace package, which
    ``pkgutil.walk_packages`` does not enter) and then holds no torch, harness.backends*
    or harness.kernels* module."""
    core = sorted(m for m in module_files() if m.startswith(CORE))
    assert len(core) >= 20 and "harness.kv.policies.window" in core
    code = ("import importlib, sys\n"
            f"for m in {core!r}:\n"
            "    importlib.import_module(m)\n"
            "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith(("
            "'torch.', 'harness.backends', 'harness.kernels')))[:8]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "", f"importing the core loaded: {out}"


def unit_of(module: str) -> str:
    """A module's folder under harness/ (``harness.kv.paged`` -> ``kv``), or, for a module
    at harness/'s top level, its own name (``harness.stack`` -> ``stack``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "harness"


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for m, deps in graph.items():
        a = unit_of(m)
        units.setdefault(a, set())
        for d in deps:
            b = unit_of(d)
            if b not in (a, "harness"):  # (harness/__init__.py: a docstring)
                units[a].add(b)
    return units


def test_kv_and_sched_form_no_cycle() -> None:
    """No import between the two packages' modules closes a circle, counting the imports
    made only for annotations (``if TYPE_CHECKING:``) too; and at run time harness/kv
    imports nothing from harness/sched (the scheduler builds on the KV manager)."""
    files = {m: p for m, p in module_files().items() if m.startswith(CORE)}
    known = set(module_files())
    full: dict[str, set[str]] = {}
    for m, p in files.items():
        tree = ast.parse(p.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        full[m] = {x for x in names if x in known and x.startswith(CORE) and x != m}
    for m in full:
        full[m] &= set(full)
    # A circle through both packages: a kv module and a sched module each reach the other.
    reach = {m: reachable(full, [m]) for m in full}
    both = sorted((a, b) for a in full if a.startswith("harness.kv") for b in reach[a]
                  if b.startswith("harness.sched") and a in reach[b])
    assert not both, f"kv <-> sched circles (annotations counted): {both[:5]}"
    runtime = unit_graph(import_graph())
    assert "sched" not in runtime["kv"], "harness/kv imports harness/sched at run time"


# What may write a paged pool's and a block table's state: the pool's own fields
# (``pool.<anything> = ...``), a table's blocks and hashes and the manager's logical count.
_POOL_TARGET = re.compile(r"\bpool\.|\.(table|hashes)\b|\.logical_blocks\b|\.block_hash\b")
_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "__setitem__", "add",
             "update", "discard"}


def pool_writes(path: Path) -> list[str]:
    """Statements of ``path`` that assign or mutate pool or block-table state."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _MUTATORS):
            targets = [node.func.value]
        for t in targets:
            if isinstance(t, ast.Attribute | ast.Subscript) and \
                    _POOL_TARGET.search(ast.unparse(t)):
                out.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def test_the_pool_state_guard_finds_a_write(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("def f(kv, st, b):\n    kv.pool.block_hash[b] = 3\n    st.table.append(b)\n"
                 "    kv.logical_blocks += 1\n    n = kv.pool.num_free\n    q = st.table[0]\n")
    lines = sorted(int(w.split(":")[1]) for w in pool_writes(f))
    assert lines == [2, 3, 4], lines  # three writes; the reads are not


def test_only_the_kv_package_writes_pool_or_table_state() -> None:
    bad = [w for m, p in module_files().items() if not m.startswith("harness.kv")
           for w in pool_writes(p)]
    assert not bad, "pool or block-table state written outside harness/kv:\n" + "\n".join(bad)


# The layers, bottom to top: a folder (or a module at harness/'s top level) imports only
# from its own layer and the layers below. A new top-level module or folder must be placed.
LAYERS: list[set[str]] = [
    {"errors", "units", "validate", "layer_types", "checkout_path"},  # foundation
    {"kv", "sched"},  # the core: no torch (test above)
    {"kernels", "model"},
    {"backends"},
    {"workloads"},
    {"metrics"},
    {"engine"},
    # a run: its typed config, the stack, the executors' targets (the model's, the
    # roofline's with its fast path), clusters of replicas, the results it writes
    {"sizing", "stack", "target", "quality_config", "quality_check", "quality_outputs",
     "quality", "config", "model_target", "results", "repeats", "progress", "runner",
     "roofline", "cluster"},
    # the application: the CLI, report, gate, SLA search, sweep supervision, sinks, the
    # GPU check, the what-if's calibration and validation tools
    {"app", "__main__", "report", "gate", "sla", "reporting", "sinks", "gpucheck",
     "roofline_tools"},
]


def test_each_folder_imports_only_its_layer_and_below() -> None:
    units = unit_graph(import_graph())
    layer = {u: i for i, group in enumerate(LAYERS) for u in group}
    unplaced = sorted(set(units) - set(layer) - {"harness"})
    assert not unplaced, f"place these in LAYERS (tests/e2e/test_layering.py): {unplaced}"
    up = sorted(f"{a} -> {b}" for a, deps in units.items() for b in deps
                if layer.get(b, 0) > layer.get(a, 0))
    assert not up, "imports going up a layer: " + ", ".join(up)
    cycle = find_cycle(units)
    assert cycle is None, "a cycle between folders: " + " -> ".join(cycle or [])
