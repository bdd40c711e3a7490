"""`runtime`: decode with a model and its artifact, benchmark methods side by side, inspect artifacts.

The group and what its commands share are in `group`; each command module registers itself on it.
"""

from runtime.cli import bench, bench_serve, bench_threads, generate, inspect_command, serve  # noqa: F401  (the commands register on `main`)
from runtime.cli.group import main

__all__ = ["main"]
