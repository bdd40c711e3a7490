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
