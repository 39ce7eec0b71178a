"""The project's import graph, read from the AST of every production module (imports inside
functions count): no cycle between packages, the harness's rooms in one direction
(`http` <- `targets` <- `load` <- `run` <- `cli`), fault injection above the run (`harness.run`
and the rooms under it never import `faults`; `faults` builds on `harness.http` and
`harness.targets`), no private name imported from another module, and no module past 500
lines. Each rule is also run on a small planted tree that breaks it (its negative control)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "faults", "workloads", "slo", "reports", "engine_ref", "bench_common")
# The harness's rooms, lowest first: a room imports only from rooms before it. `harness`
# stands for its root modules (errors, the version), which import no room.
ROOMS = ("harness", "harness.http", "harness.targets", "harness.load", "harness.run", "harness.cli")
# What `faults` may build on of the harness: its transport seam and its targets.
FAULTS_MAY_IMPORT = {"harness", "harness.http", "harness.targets"}
MAX_LINES = 500


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every production module under `root`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def node(module: str) -> str | None:
    """The graph node of a dotted module name: its top-level package, or the harness room
    it lies in; None for a module outside the project."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "harness" and len(parts) > 1 and f"harness.{parts[1]}" in ROOMS:
        return f"harness.{parts[1]}"
    return parts[0]


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names) for every import statement of module `name`, anywhere
    in the file; `from package import module` names the module itself."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno, []) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = name.split(".")[: len(name.split(".")) - n.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [a.name for a in n.names]
            for a in names:
                sub = f"{base}.{a}"
                out.append((sub if sub in known else base, n.lineno, [a]))
    return out


def graph(root: Path) -> dict[str, dict[str, list[str]]]:
    """node -> {imported node: ["module:line", ...]} over every production module."""
    known = modules(root)
    edges: dict[str, dict[str, list[str]]] = {}
    for name, path in known.items():
        source = node(name)
        for target, line, _ in imports(name, path, known):
            dest = node(target)
            if dest is not None and dest != source:
                where = f"{path.relative_to(root)}:{line}"
                edges.setdefault(source, {}).setdefault(dest, []).append(where)
    return edges


def find_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A cycle of nodes as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, {})):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (cycle := visit(m)) is not None:
                return cycle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (cycle := visit(n)) is not None:
            return cycle
    return None


def cycle_report(root: Path) -> str | None:
    edges = graph(root)
    cycle = find_cycle(edges)
    if cycle is None:
        return None
    steps = [f"{a} -> {b} ({edges[a][b][0]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return "import cycle: " + "; ".join(steps)


def room_violations(root: Path) -> list[str]:
    """Imports of a higher room from a lower one (the root modules count lowest)."""
    rank = {room: i for i, room in enumerate(ROOMS)}
    return [
        f"{source} imports {dest}: {where[0]}"
        for source, dests in graph(root).items()
        for dest, where in dests.items()
        if source in rank and dest in rank and rank[dest] > rank[source]
    ]


def fault_violations(root: Path) -> list[str]:
    """`faults` imported by any harness room but the CLI, or importing more of the harness
    than its seams."""
    edges = graph(root)
    out = [
        f"{source} imports faults: {dests['faults'][0]}"
        for source, dests in edges.items()
        if source in ROOMS and source != "harness.cli" and "faults" in dests
    ]
    out += [
        f"faults imports {dest}: {where[0]}"
        for dest, where in edges.get("faults", {}).items()
        if dest.startswith("harness") and dest not in FAULTS_MAY_IMPORT
    ]
    return out


def private_imports(root: Path) -> list[str]:
    """`from module import _name`: a private name taken from another module."""
    known = modules(root)
    return [
        f"{path.relative_to(root)}:{line}: from {target} import {names[0]}"
        for name, path in known.items()
        for target, line, names in imports(name, path, known)
        if names and names[0].startswith("_") and not names[0].startswith("__")
    ]


def long_files(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}: {n} lines"
        for path in modules(root).values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def test_the_graph_sees_the_project():
    names = modules(ROOT)
    assert {"harness.cli", "harness.run.orchestrator", "faults.session", "slo"} <= set(names)
    assert set(graph(ROOT)) >= {"harness.cli", "harness.run", "harness.load", "faults"}


def test_no_import_cycle_between_packages():
    assert cycle_report(ROOT) is None, cycle_report(ROOT)


def test_the_harness_rooms_import_one_way():
    assert room_violations(ROOT) == []


def test_faults_sit_above_the_run():
    assert fault_violations(ROOT) == []


def test_no_private_name_is_imported_from_another_module():
    assert private_imports(ROOT) == []


def test_no_production_module_is_over_500_lines():
    assert long_files(ROOT) == []


# Negative controls: each rule on a planted tree that breaks it ------------------------------


def plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def planted(tmp_path):
    """A minimal tree that keeps every rule: rooms importing downwards, faults on http."""
    return plant(
        tmp_path,
        {
            "harness/__init__.py": "",
            "harness/errors.py": "",
            "harness/http/__init__.py": "",
            "harness/http/client.py": "from harness.errors import HarnessError\n",
            "harness/targets/__init__.py": "",
            "harness/load/__init__.py": "",
            "harness/run/__init__.py": "",
            "harness/run/orchestrator.py": "from harness.http import client\n",
            "harness/cli/__init__.py": "import faults.session\n",
            "faults/__init__.py": "",
            "faults/session.py": "from harness.http.client import x\n",
            "slo/__init__.py": "",
        },
    )


def test_the_planted_tree_keeps_every_rule(planted):
    assert cycle_report(planted) is None
    assert room_violations(planted) == fault_violations(planted) == []
    assert private_imports(planted) == long_files(planted) == []


def test_a_cycle_through_an_import_inside_a_function_is_caught(planted):
    plant(planted, {"slo/x.py": "def f():\n    import faults\n", "faults/y.py": "import slo\n"})
    report = cycle_report(planted)
    assert report is not None and "faults -> slo" in report and "slo -> faults" in report
    assert "slo/x.py:2" in report  # where the import is, inside the function


def test_a_lower_room_importing_a_higher_one_is_caught(planted):
    plant(planted, {"harness/http/sse.py": "def f():\n    from harness.run import orchestrator\n"})
    assert room_violations(planted) == ["harness.http imports harness.run: harness/http/sse.py:2"]


def test_the_run_importing_faults_is_caught(planted):
    plant(planted, {"harness/run/drive.py": "from faults import session\n"})
    assert fault_violations(planted) == ["harness.run imports faults: harness/run/drive.py:1"]


def test_faults_importing_the_run_is_caught(planted):
    plant(planted, {"faults/x.py": "from harness.run.orchestrator import run\n"})
    assert fault_violations(planted) == ["faults imports harness.run: faults/x.py:1"]


def test_a_private_import_is_caught(planted):
    plant(planted, {"harness/run/drive.py": "from harness.http.client import _send, ok\n"})
    assert private_imports(planted) == [
        "harness/run/drive.py:1: from harness.http.client import _send"
    ]


def test_a_long_module_is_caught(planted):
    plant(planted, {"slo/big.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_files(planted) == [f"slo/big.py: {MAX_LINES + 1} lines"]
