"""The import graph of `engine_ref`, read from source with `ast` (nothing is imported): no cycles,
nothing from the benchmark's other packages, no test helpers in production modules, the serving
layer reaching the engine only through `engine_ref.serving.interface`, and the core importing
only the core (models come in loaded). Also the modules' sizes: `engine.py` stays the thin
loop over its model runner and output processor, and no module passes 500 lines.

Edges are explicit imports resolved to modules under `engine_ref/`; an import inside a function
(a lazy import) is an edge too, marked as lazy in failure messages. The implicit import of a
module's parent packages is not an edge.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import engine_ref

ROOT = Path(engine_ref.__file__).parent
FOREIGN_PACKAGES = frozenset({"harness", "workloads", "slo", "reports", "faults"})
TEST_ONLY_MODULES = frozenset({"pytest", "_pytest", "hypothesis", "unittest.mock", "tests"})
# Test-double and test-case names, and helpers that once lived in a production module.
TEST_HELPER_NAME = re.compile(r"^(test_|Test[A-Z_]|Fake|fake_|Mock|mock_|Stub|stub_|Dummy|dummy_)")
FORMER_TEST_HELPERS = frozenset({"running_server"})
ENGINE_GATEWAY = "engine_ref.serving.interface"
CORE = "engine_ref.core"
MAX_ENGINE_LINES = 260  # engine_ref/core/engine.py
MAX_MODULE_LINES = 500


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # dotted name as imported, relative imports resolved
    lineno: int
    lazy: bool  # inside a function body

    def __str__(self) -> str:
        where = "lazy, inside a function" if self.lazy else "module level"
        return f"{self.importer} -> {self.target} (line {self.lineno}, {where})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.function_depth = 0
        self.imports: list[Import] = []

    def _function(self, node: ast.AST) -> None:
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _add(self, target: str, node: ast.stmt) -> None:
        self.imports.append(Import(self.module, target, node.lineno, self.function_depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        targets = (
            f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
        )
        for target in dict.fromkeys(targets):
            self._add(target, node)


def _imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    collector = _ImportCollector(module, path.name == "__init__.py")
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    return collector.imports


IMPORTS = [imp for module in MODULES for imp in _imports_of(module)]


def _resolve(target: str) -> str | None:
    """The module under engine_ref that importing `target` loads, or None for other packages."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _cycles(edges: list[Import]) -> list[list[Import]]:
    """Import cycles, each as its edges in order; at least one for every tangle of modules."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in edges:
        target = _resolve(edge.target)
        if target is not None and target != edge.importer:
            graph.setdefault(edge.importer, {}).setdefault(target, edge)
    cycles: list[list[Import]] = []
    off_cycle_or_reported: set[str] = set()
    for start in sorted(graph):
        path: list[Import] = []
        visited = {start}

        def back_to_start(
            node: str, start: str = start, path: list = path, visited=visited
        ) -> bool:
            for target, edge in sorted(graph.get(node, {}).items()):
                if target == start:
                    path.append(edge)
                    return True
                if target in visited or target in off_cycle_or_reported:
                    continue
                visited.add(target)
                path.append(edge)
                if back_to_start(target):
                    return True
                path.pop()
            return False

        if start not in off_cycle_or_reported and back_to_start(start):
            cycles.append(path)
            off_cycle_or_reported.update(edge.importer for edge in path)
        off_cycle_or_reported.add(start)
    return cycles


def _describe(cycles: list[list[Import]]) -> str:
    return "\n".join("cycle:\n  " + "\n  ".join(str(e) for e in cycle) for cycle in cycles)


def test_the_graph_is_read():
    assert {"engine_ref", "engine_ref.core.engine", "engine_ref.serving.server"} <= set(MODULES)
    assert any(_resolve(i.target) == ENGINE_GATEWAY for i in IMPORTS)


def test_cycle_finder_reports_a_cycle_through_a_lazy_import():
    edges = [
        Import("engine_ref.serving.server", "engine_ref.serving.cli_serve", 3, lazy=True),
        Import("engine_ref.serving.cli_serve", "engine_ref.serving.server", 9, lazy=False),
        Import("engine_ref.serving.server", "engine_ref.serving.metrics", 4, lazy=False),
    ]
    (cycle,) = _cycles(edges)
    assert {e.importer for e in cycle} == {
        "engine_ref.serving.server",
        "engine_ref.serving.cli_serve",
    }
    assert "lazy" in _describe([cycle])


def test_no_module_level_import_cycles():
    cycles = _cycles([i for i in IMPORTS if not i.lazy])
    assert not cycles, _describe(cycles)


def test_no_import_cycles_even_through_lazy_imports():
    """A lazy import that closes a cycle hides a load-order problem rather than removing it."""
    cycles = _cycles(IMPORTS)
    assert not cycles, _describe(cycles)


def test_engine_ref_imports_nothing_from_the_other_packages():
    foreign = [i for i in IMPORTS if i.target.split(".")[0] in FOREIGN_PACKAGES]
    assert not foreign, "\n".join(map(str, foreign))


def test_the_serving_layer_reaches_the_engine_only_through_its_interface():
    def is_engine(module: str | None) -> bool:
        return module == "engine_ref" or (module or "").startswith("engine_ref.core")

    reaching = [
        i
        for i in IMPORTS
        if i.importer.startswith("engine_ref.serving")
        and i.importer != ENGINE_GATEWAY
        and is_engine(_resolve(i.target))
    ]
    assert not reaching, "\n".join(map(str, reaching))


def _outside_the_core(edges: list[Import]) -> list[Import]:
    """The edges from a core module to an engine_ref module outside the core: loading, serving,
    or the `engine_ref` package itself, whose lazy exports reach loading."""
    return [
        i
        for i in edges
        if (i.importer == CORE or i.importer.startswith(CORE + "."))
        and (target := _resolve(i.target)) is not None
        and target != CORE
        and not target.startswith(CORE + ".")
    ]


def test_the_core_imports_nothing_outside_the_core():
    """Not even lazily: `engine_ref.build_engine` loads models and hands them to the core."""
    reaching = _outside_the_core(IMPORTS)
    assert not reaching, "\n".join(map(str, reaching))


def test_the_core_rule_catches_a_lazy_import_of_loading():
    edges = [
        Import("engine_ref.core.engine", "engine_ref.loading.weights", 101, lazy=True),
        Import("engine_ref.core.engine", "engine_ref.core.model_runner", 30, lazy=False),
        Import("engine_ref.loading.build", "engine_ref.core.engine", 12, lazy=False),
    ]
    assert [str(e) for e in _outside_the_core(edges)] == [str(edges[0])]


CLUSTER = "engine_ref.cluster"
# The KV link frames the engine's handoff records; the rest of the room reaches the engine only
# through the serving interface, as a worker's server does.
CLUSTER_CORE_IMPORTERS = frozenset({"engine_ref.cluster.kv_link"})


def _in(module: str | None, room: str) -> bool:
    return module is not None and (module == room or module.startswith(room + "."))


def test_the_cluster_room_sits_on_top_of_serving():
    """Nothing below imports the cluster (the serve CLI alone, lazily, for --replicas), and
    the cluster reaches the engine through `engine_ref.serving.interface` only."""
    wrong = [
        i
        for i in IMPORTS
        if _in(_resolve(i.target), CLUSTER)
        and not _in(i.importer, CLUSTER)
        and not (i.importer == "engine_ref.serving.cli_serve" and i.lazy)
    ]
    wrong += [
        i
        for i in IMPORTS
        if _in(i.importer, CLUSTER)
        and i.importer not in CLUSTER_CORE_IMPORTERS
        and (_in(_resolve(i.target), CORE) or _resolve(i.target) == "engine_ref")
    ]
    assert not wrong, "\n".join(map(str, wrong))


def _num_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_engine_loop_stays_thin():
    """`LLMEngine` keeps the request lifecycle and the step; the forward is the model runner's
    and sampling and commit the output processor's."""
    lines = _num_lines(MODULES["engine_ref.core.engine"])
    assert lines <= MAX_ENGINE_LINES, f"engine_ref/core/engine.py has {lines} lines"


def test_no_module_passes_the_size_limit():
    too_long = {
        str(path.relative_to(ROOT.parent)): lines
        for path in MODULES.values()
        if (lines := _num_lines(path)) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_production_modules_define_no_test_helpers(module):
    test_imports = [
        i
        for i in _imports_of(module)
        if any(i.target == t or i.target.startswith(t + ".") for t in TEST_ONLY_MODULES)
    ]
    assert not test_imports, "\n".join(map(str, test_imports))
    tree = ast.parse(MODULES[module].read_text())
    defined = [
        node
        for scope in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]
        for node in scope.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    helpers = [
        f"{module}.{node.name} (line {node.lineno})"
        for node in defined
        if TEST_HELPER_NAME.match(node.name) or node.name in FORMER_TEST_HELPERS
    ]
    assert not helpers, "test helpers belong under tests/: " + ", ".join(helpers)
