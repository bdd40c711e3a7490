"""Where a bench record comes from: the code's git commit, the CPU and the kernel path that ran, kept in
every record's setup so that figures from different machines, commits and paths (AVX2 on an AVX-512
CPU, `SPECVOCAB_KERNELS=avx2`) are never mixed up."""

from __future__ import annotations

import subprocess
from pathlib import Path

from runtime.kernels import kernel_name
from runtime.kernels.build import cpu_description

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding runtime/ (prep/, tests/ ...)


def code_version() -> str | None:
    """The short git commit of the checkout this code runs from, '+dirty' when tracked files differ from
    it; None outside a git checkout (an installed copy) or without git."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(PACKAGE_ROOT), *args], capture_output=True, text=True, timeout=10)
        if done.returncode:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "prep", "runtime", "artifacts", "recipes")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def provenance() -> dict:
    """{"code": code_version(), "cpu": cpu_description(), "screen_kernel": kernel_name()} for a bench
    record's setup ("screen_kernel": the kernel path every kernel ran on, the key bench-summary reads)."""
    return {"code": code_version(), "cpu": cpu_description(), "screen_kernel": kernel_name()}
