"""The layout's rules, checked on the source: `placement` loads neither torch nor ray, packages import each other only
downwards (no module-level cycle, no import hidden in a function to dodge one), and each layer imports only what
the README's Layout table allows."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
#: Every package of the project (each top-level folder with an `__init__.py`): their import graph is acyclic.
ACYCLIC_PACKAGES = tuple(sorted(path.parent.name for path in ROOT.glob("*/__init__.py")))
#: placement's system packages: each builds on placement.core and imports none of the others.
SYSTEM_PACKAGES = ("placement.alpaserve", "placement.arlo", "placement.otas", "placement.tcb")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(packages=ACYCLIC_PACKAGES) -> dict[str, Path]:
    return {module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported name lands in: the module itself, else its package (longest prefix)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, modules: dict[str, Path], own: str | None = None) -> tuple[set[str], set[str]]:
    """(module-level, inside a function or class body) project modules imported by one file (module `own`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = own or module_name(path)
    top: set[str] = set()
    nested: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:  # relative import
            anchor = own if path.name == "__init__.py" else own.rpartition(".")[0]  # the importing package
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            base = f"{anchor}.{base}" if base else anchor
        # `from pkg import sub` imports the submodule when it is one
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]

    def visit(node: ast.AST, in_body: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if is_type_checking_block(child):  # typing-only imports: no import at run time, no edge
                visit(ast.Module(body=child.orelse, type_ignores=[]), in_body)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in targets(child):
                    target = resolve(name, modules)
                    if target is not None and target != own:
                        (nested if in_body else top).add(target)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                visit(child, True)
            else:
                visit(child, in_body)

    visit(tree, False)
    return top, nested


def is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): its body never runs."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a list of nodes, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def import_graph(packages=ACYCLIC_PACKAGES) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = project_modules(packages)
    top, nested = {}, {}
    for name, path in modules.items():
        top[name], nested[name] = imports_of(path, modules)
    return top, nested


def modules_loaded_by(names: list[str]) -> set[str]:
    """Every module a fresh interpreter has loaded after importing `names`."""
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_import_placement_loads_neither_torch_nor_ray():
    names = sorted(name for name in project_modules(("placement",)) if not name.endswith("__main__"))
    loaded = {name.split(".")[0] for name in modules_loaded_by(names)}
    assert "placement" in loaded and "numpy" in loaded  # the check sees what was imported
    assert not loaded & {"torch", "ray", "torchvision", "transformers", "timm"}


@pytest.mark.parametrize("module", ["rayserve_apps.metrics", "rayserve_apps.contracts"])
def test_serve_leaf_modules_load_neither_the_app_nor_torch(module):
    """Metrics and the names/contracts module are imported by every replica and the controller: importing one must
    not build the application (the builder imports every deployment) nor load torch."""
    loaded = modules_loaded_by([module])
    assert module in loaded  # the check sees what was imported
    heavy = {name for name in loaded if name.split(".")[0] in {"torch", "transformers", "timm"}}
    app_modules = {name for name in loaded
                   if name.startswith("rayserve_apps.") and name not in {module, "rayserve_apps.contracts"}}
    assert not heavy and not app_modules, f"{module} loads {sorted(heavy)[:5]} {sorted(app_modules)}"


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_reads_from_relative_and_nested_imports(tmp_path):
    modules = {name: tmp_path / f"{name}.py" for name in ("pkg", "pkg.a", "pkg.b", "pkg.d", "pkg.c")}
    source = ("import os\nfrom pkg import b\nfrom . import d\n\n"
              "def f():\n    from pkg.a import x\n\nclass K:\n    import pkg.b\n")
    path = tmp_path / "c.py"
    path.write_text(source)
    top, nested = imports_of(path, modules, own="pkg.c")
    assert top == {"pkg.b", "pkg.d"}
    assert nested == {"pkg.a", "pkg.b"}


def test_no_module_level_import_cycle():
    top, _ = import_graph()
    assert find_cycle(top) is None, f"import cycle: {' -> '.join(find_cycle(top))}"


def test_no_import_inside_a_function_dodges_a_cycle():
    top, nested = import_graph()
    combined = {name: top[name] | nested[name] for name in top}
    cycle = find_cycle(combined)
    assert cycle is None, f"an import inside a function closes a cycle: {' -> '.join(cycle)}"


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between subpackages (and top-level modules) of each package: `pkg.sub.mod` becomes `pkg.sub`."""
    def node(name: str) -> str:
        return ".".join(name.split(".")[:2])
    collapsed: dict[str, set[str]] = {}
    for name, targets in graph.items():
        collapsed.setdefault(node(name), set()).update(node(t) for t in targets if node(t) != node(name))
    return collapsed


def test_subpackages_import_each_other_only_one_way():
    top, nested = import_graph()
    graph = subpackage_graph({name: top[name] | nested[name] for name in top})
    cycle = find_cycle(graph)
    assert cycle is None, f"subpackages import each other both ways: {' -> '.join(cycle)}"


def test_serve_app_layers():
    """No module imports the builder; contracts import no other module of the app; routers and the control plane
    import neither the builder, nor the ingress, nor a replica (the README's Layout table)."""
    top, nested = import_graph(("rayserve_apps",))
    app_modules = [name for name in top if name.startswith("rayserve_apps.")]
    assert "rayserve_apps.contracts" in app_modules and "rayserve_apps.routers.polymorph" in app_modules
    for name in app_modules:
        targets = top[name] | nested[name]
        assert "rayserve_apps.app" not in targets, f"{name} imports the builder"
        if name == "rayserve_apps.contracts":
            assert not [t for t in targets if t.startswith("rayserve_apps")], targets
        if name.startswith(("rayserve_apps.routers", "rayserve_apps.control")):
            above = ("rayserve_apps.ingress", "rayserve_apps.replicas", "rayserve_apps.engine", "rayserve_apps.edge")
            bad = [t for t in targets if t.startswith(above)]
            assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("package", ["ops", "placement"])
def test_leaf_layers_import_nothing_above_them(package):
    top, nested = import_graph()
    forbidden = {"ops": ("models", "parallel", "placement"), "placement": ("models", "ops", "parallel")}[package]
    for name in top:
        if name.split(".")[0] != package:
            continue
        bad = [t for t in top[name] | nested[name] if t.split(".")[0] in forbidden]
        assert not bad, f"{name} imports {bad}"


def test_placement_core_imports_no_system_package_and_systems_not_each_other():
    top, nested = import_graph(("placement",))
    for name in top:
        targets = top[name] | nested[name]
        if name.startswith("placement.core"):
            assert not [t for t in targets if t.startswith(SYSTEM_PACKAGES)], name
        if name.startswith("placement.sim"):  # the simulation contract stands alone
            assert all(t.startswith("placement.sim") for t in targets), name
        for system in SYSTEM_PACKAGES:
            if name.startswith(system):
                others = [t for t in targets if t.startswith(SYSTEM_PACKAGES) and not t.startswith(system)]
                assert not others, f"{name} imports {others}"


def test_every_imported_project_name_exists(monkeypatch):
    """Names imported from the project anywhere (benchmarks and tests included, and imports inside functions, which
    run only on some paths) exist where they are imported from: a moved name fails here, not halfway through a
    benchmark run."""
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ is imported as its scripts import it: from the repo root
    folders = (*ACYCLIC_PACKAGES, "benchmarks", "tests")
    sources = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    missing = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in (*ACYCLIC_PACKAGES, "benchmarks")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing
