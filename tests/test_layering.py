"""Layering: artifacts <- runtime <- prep; the runtime never pulls in training or clustering libraries."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import runtime

FORBIDDEN_IN_RUNTIME = ("lightning", "pytorch_lightning", "faiss", "sklearn", "prep")


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


# Layers of the runtime, bottom to top: a module may import its own layer and the ones below, never above.
LAYERS = [
    ("runtime.checks", "runtime.numerics", "runtime.kernels", "runtime.sampling", "runtime.stats", "runtime.models", "runtime.data",
     "runtime.prompting", "runtime.stopping", "runtime.router", "runtime.describe", "runtime.rowwise"),
    ("runtime.backends", "runtime.heads", "runtime.verify",
     "runtime.trees", "runtime.verify_tree"),
    ("runtime.drafters", "runtime.session"),
    ("runtime.decode", "runtime.speculative", "runtime.tree_speculative", "runtime.mjsd"),
    ("runtime.methods", "runtime.bench", "runtime.llamacpp", "runtime.llamacpp_server"),
    ("runtime.api",),
    ("runtime.serve",),
    ("runtime.cli", "runtime.__main__"),
]


def _layer(module: str) -> int | None:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _imports(path) -> set[str]:
    """Every runtime module a source file imports (top level or inside functions)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runtime"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("runtime"))
    return names


def test_no_runtime_module_imports_a_layer_above_it():
    from pathlib import Path

    root = Path(runtime.__file__).parent
    upward, unplaced = [], []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("runtime", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        if module == "runtime":
            continue
        mine = _layer(module)
        if mine is None:
            unplaced.append(module)
            continue
        for name in _imports(path):
            theirs = _layer(name)
            if theirs is not None and theirs > mine and not name.startswith(module):
                upward.append(f"{module} imports {name}")
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"
    assert not upward, "\n".join(upward)


def test_drafters_and_heads_import_no_loop_bench_cli_or_api():
    from pathlib import Path

    root = Path(runtime.__file__).parent
    forbidden = ("runtime.speculative", "runtime.decode", "runtime.bench", "runtime.cli", "runtime.api",
                 "runtime.methods")
    for package in ("drafters", "heads"):
        for path in (root / package).rglob("*.py"):
            bad = [name for name in _imports(path) if name.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}"
