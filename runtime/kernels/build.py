"""Pick the compiled CPU kernel path this CPU can run, build it once, and load it.

Four paths compute bit-identical results (one summation order, see gemm.h): `avx512vbmi` (the
avx512 sources built with AVX512_VBMI too: 5-bit blocks take their high bits with one byte
multishift), `avx512` (AVX512F/BW + FMA + F16C), `avx2` (AVX2 + FMA + F16C) and `portable` (plain
C++). Each is its own extension module, compiled with only its own instruction-set flags, so
nothing built for AVX-512 can leak into the AVX2 path. The best path the CPU reports
(/proc/cpuinfo) is used unless SPECVOCAB_KERNELS names one (avx512vbmi|avx512|avx2|portable|torch);
`torch` means no compiled kernels.

Builds are cached under torch's extension directory, keyed by a hash of the sources, flags, torch
and Python versions; a cached build is imported directly (no compiler run, nothing printed). One
process builds a path at a time (builder_lock); a build killed midway is started afresh by the next
run, not waited on forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import warnings
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

ENV = "SPECVOCAB_KERNELS"
PATHS = ("avx512vbmi", "avx512", "avx2", "portable")  # best first
CHOICES = (*PATHS, "torch")
_HERE = Path(__file__).parent
_SOURCES = {
    "avx512vbmi": ("module_avx512.cpp", "screen_avx512.cpp", "screen4_avx512.cpp"),
    "avx512": ("module_avx512.cpp", "screen_avx512.cpp", "screen4_avx512.cpp"),
    "avx2": ("module_avx2.cpp", "screen_avx2.cpp"),
    "portable": ("module_portable.cpp",),
}
_ISA_FLAGS = {
    "avx512vbmi": ("-mavx512f", "-mavx512bw", "-mavx512vbmi", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
}
_CPU_NEEDS = {
    "avx512vbmi": frozenset({"avx512f", "avx512bw", "avx512vbmi", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
}
# -ffp-contract=off: GCC would otherwise fuse the intrinsics' d * q + m into one FMA, which rounds
# differently from gguf-py's two float32 operations. -fopenmp: at::parallel_for's OpenMP pragmas.
_COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
TORCH_BUILD_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
BUILDER_LOCK = "specvocab.lock"  # builder_lock's flock


@lru_cache(maxsize=None)
def _cpuinfo_field(name: str) -> str | None:
    """The value of the first `name` line of /proc/cpuinfo (None if absent or unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (first `flags` line of /proc/cpuinfo; empty if unreadable)."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity): the most threads worth asking for."""
    return len(os.sched_getaffinity(0))


# Flags that change which kernels run or how fast llama.cpp runs: recorded with every bench.
NOTABLE_FLAGS = ("avx2", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8")


def cpu_description() -> str:
    """This CPU's model name and its NOTABLE_FLAGS, e.g. 'AMD EPYC 9R14; avx2 avx512f ... (no avx_vnni amx_tile amx_int8)'."""
    flags = cpu_flags()
    have = [f for f in NOTABLE_FLAGS if f in flags]
    lack = [f for f in NOTABLE_FLAGS if f not in flags]
    return f"{_cpuinfo_field('model name') or 'unknown CPU'}; {' '.join(have) or 'none of ' + ' '.join(NOTABLE_FLAGS)}" + (
        f" (no {' '.join(lack)})" if have and lack else "")


def missing_cpu_flags(path: str) -> list[str]:
    """The CPU flags `path` needs that this CPU lacks (empty: it can run here)."""
    return sorted(_CPU_NEEDS[path] - cpu_flags())


def runnable_paths() -> tuple[str, ...]:
    """The compiled paths this CPU can run, best first (`portable` always)."""
    return tuple(p for p in PATHS if not missing_cpu_flags(p))


def _build_dir(path: str) -> tuple[str, Path]:
    """Module name and its build directory, keyed by everything that changes the binary."""
    digest = hashlib.sha256()
    for source in sorted(_HERE.glob("*.cpp")) + sorted(_HERE.glob("*.h")):
        digest.update(source.name.encode() + source.read_bytes())
    digest.update(" ".join((*_ISA_FLAGS[path], *_COMMON_FLAGS, torch.__version__, sys.version)).encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    name = f"specvocab_kernels_{path}"
    return name, root / f"{name}-{digest.hexdigest()[:16]}"


@contextmanager
def builder_lock(build_dir: Path) -> Iterator[None]:
    """Be the one process building into `build_dir`: an flock, which the kernel drops when its holder dies.

    torch's own lock (a file `lock` that its build removes when it ends) outlives a build killed with
    kill -9, and then every later build waits on it forever. Under this lock no other specvocab
    process builds there, so such a file is a dead build's: its folder is emptied (half-written
    objects included) and the build starts afresh.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILDER_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("specvocab: waiting for another process that compiles the CPU kernels", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        if (build_dir / TORCH_BUILD_LOCK).exists():
            for leftover in build_dir.iterdir():
                if leftover.name != BUILDER_LOCK:
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        yield


@lru_cache(maxsize=None)
def module(path: str) -> ModuleType | None:
    """The extension module of `path`, built on first use; None (with a warning) if it cannot be built."""
    name, build_dir = _build_dir(path)
    built, marker = build_dir / f"{name}.so", build_dir / "built.ok"  # marker: the .so is complete
    try:
        if not marker.exists():
            with builder_lock(build_dir):
                if not marker.exists():  # else another process built it while this one waited
                    return _compile(path, name, build_dir, marker)
        spec = importlib.util.spec_from_file_location(name, built)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    except Exception as exc:  # a missing compiler must not stop decoding, only slow it
        warnings.warn(f"CPU kernels ({path}) unavailable ({' '.join(str(exc).split())[:300]}); falling back")
        return None


def _compile(path: str, name: str, build_dir: Path, marker: Path) -> ModuleType:
    """Compile and load the extension of `path` in `build_dir` (under builder_lock), then mark it complete."""
    from torch.utils.cpp_extension import load

    print(f"specvocab: compiling the CPU kernels ({path}; once, ~1 min)", file=sys.stderr)
    loaded = load(
        name=name,
        sources=[str(_HERE / s) for s in _SOURCES[path]],
        extra_include_paths=[str(_HERE)],
        extra_cflags=[*_ISA_FLAGS[path], *_COMMON_FLAGS],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
    marker.touch()
    return loaded


def requested() -> str | None:
    """The path SPECVOCAB_KERNELS names, or None; ValueError (one line) for a bad or unrunnable one."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r} is not a kernel path: use one of {', '.join(CHOICES)}")
    if value != "torch" and missing_cpu_flags(value):
        raise ValueError(
            f"{ENV}={value}: this CPU lacks {', '.join(missing_cpu_flags(value))}; "
            f"use one of {', '.join((*runnable_paths(), 'torch'))}"
        )
    return value


@lru_cache(maxsize=1)
def active() -> tuple[str, ModuleType | None]:
    """(path name, module) in use: SPECVOCAB_KERNELS or the best runnable path that builds, else ('torch', None)."""
    choice = requested()
    if choice == "torch":
        return "torch", None
    for path in (choice,) if choice else runnable_paths():
        loaded = module(path)
        if loaded is not None:
            return path, loaded
    return "torch", None
