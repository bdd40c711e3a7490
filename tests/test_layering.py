"""Layering: artifacts <- runtime <- prep; inside the runtime its folders are its floors: a module imports
its own floor and the ones below, never one above, and no runtime modules import each other in a cycle."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import runtime

FORBIDDEN_IN_RUNTIME = ("lightning", "pytorch_lightning", "faiss", "sklearn", "prep")

# The floors of the runtime, bottom first: each name is a folder of runtime/ or a module at its top, and
# a module's floor is that of the first name on its path (runtime/loops/mjsd.py: loops).
FLOORS = [
    ("common", "kernels", "models"),
    ("text", "backends", "heads"),
    ("drafters", "session"),
    ("loops",),
    ("llamacpp", "bench", "methods"),
    ("api",),
    ("serve",),
    ("cli", "__main__"),
]
MAX_TOP_MODULES = 8  # .py files at the top of runtime/, __init__ and __main__ included
PROTOCOL_MODULES = ("runtime.drafters.base", "runtime.drafters.trees")  # what loops may import of the drafters
ROOT = Path(runtime.__file__).parent


def test_runtime_imports_no_training_or_clustering_library():
    modules = sorted(m.name for m in pkgutil.walk_packages(runtime.__path__, "runtime.") if not m.name.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(','.join(m for m in {FORBIDDEN_IN_RUNTIME!r} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert len(modules) > 10  # the walk found the runtime's modules
    assert loaded == "", f"runtime imported {loaded}"


def module_paths(root: Path) -> dict[str, Path]:
    """Every module under `root` (a package folder named like the package), by dotted name."""
    return {".".join((root.name, *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
            for p in sorted(root.rglob("*.py"))}
# Layers of the runtime, bottom to top: a module may import its own layer and the ones below, never above.
LAYERS = [
    ("runtime.common.checks", "runtime.common.numerics", "runtime.kernels", "runtime.common.sampling", "runtime.common.stats", "runtime.models", "runtime.text.data",
     "runtime.text.prompting", "runtime.text.stopping", "runtime.drafters.router", "runtime.cli.describe", "runtime.heads.rowwise"),
    ("runtime.backends", "runtime.heads", "runtime.loops.verify",
     "runtime.drafters.trees", "runtime.loops.verify_tree"),
    ("runtime.drafters", "runtime.session"),
    ("runtime.loops.decode", "runtime.loops.speculative", "runtime.loops.tree_speculative", "runtime.loops.mjsd"),
    ("runtime.methods", "runtime.bench", "runtime.llamacpp.bindings", "runtime.llamacpp.server"),
    ("runtime.api",),
    ("runtime.serve",),
    ("runtime.cli", "runtime.__main__"),
]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports, at its top or inside functions.

    `from pkg import name` is an edge to pkg.name where that is a module, else to pkg's __init__; the
    parent packages Python runs first on any import are no edges (a package re-exporting its own
    modules is no cycle), only names taken from them are.
    """
    paths = module_paths(root)
    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in paths}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                source = ".".join(part for part in (base, node.module) if part)
                if source in paths:
                    edges |= {f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names}
        graph[module] = edges - {module}
    return graph


def floor_of(module: str, floors: list[tuple[str, ...]]) -> int | None:
    """The floor of the first name under the root on the module's path (None: the root package itself)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return next((i for i, names in enumerate(floors) if parts[1] in names), None)


def upward_imports(graph: dict[str, set[str]], floors: list[tuple[str, ...]]) -> list[str]:
    """Each import of a module on a higher floor than the importer's."""
    return [f"{module} imports {name}" for module, names in sorted(graph.items()) for name in sorted(names)
            if (floor_of(name, floors) or 0) > (floor_of(module, floors) or 0)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a cycle (strongly connected components of > 1 module)."""
    order, low, stack, found = {}, {}, [], []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for name in sorted(graph[module]):
            if name not in order:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], order[name])
        if low[module] == order[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_the_floors_name_every_folder_and_top_module_of_runtime():
    entries = {p.stem for p in ROOT.iterdir() if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    listed = [name for names in FLOORS for name in names]
    assert len(listed) == len(set(listed)), "a name stands on two floors"
    assert not entries - set(listed), f"place these in FLOORS: {sorted(entries - set(listed))}"
    assert not set(listed) - entries, f"FLOORS names what runtime/ no longer holds: {sorted(set(listed) - entries)}"


def test_runtime_keeps_few_top_level_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of runtime/ ({', '.join(top)}): move some into a folder"


def test_no_runtime_module_imports_a_floor_above_its_own():
    upward = upward_imports(import_graph(ROOT), FLOORS)
    assert not upward, "\n".join(upward)


def test_no_runtime_modules_import_each_other_in_a_cycle():
    assert cycles(import_graph(ROOT)) == []


def test_loops_import_the_drafter_protocols_only():
    graph = import_graph(ROOT)
    concrete = sorted(f"{module} imports {name}" for module, names in graph.items() if module.startswith("runtime.loops")
                      for name in names if name.startswith("runtime.drafters") and name not in PROTOCOL_MODULES)
    assert not concrete, "\n".join(concrete)


def test_the_checks_catch_an_upward_import_and_a_cycle_inside_a_function(tmp_path: Path):
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", "low/__init__.py": "from pkg.low.a import A\n",
                       "low/a.py": "A = 1\n\ndef later():\n    from pkg.low import b\n",
                       "low/b.py": "from pkg.low.a import A\n", "high.py": "from pkg.low import A\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root)
    assert graph["pkg.high"] == {"pkg.low"} and graph["pkg.low.a"] == {"pkg.low.b"}
    assert cycles(graph) == [["pkg.low.a", "pkg.low.b"]]
    assert upward_imports(graph, [("low",), ("high",)]) == []
    assert upward_imports(graph, [("high",), ("low",)]) == ["pkg.high imports pkg.low"]
