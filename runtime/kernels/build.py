"""Pick the compiled CPU kernel path this CPU can run, build it once, and load it.

Four paths compute bit-identical results (one summation order, see gemm.h): `avx512vbmi` (the
avx512 sources built with AVX512_VBMI too: 5-bit blocks take their high bits with one byte
multishift), `avx512` (AVX512F/BW + FMA + F16C), `avx2` (AVX2 + FMA + F16C) and `portable` (plain
C++). Each is its own extension module, compiled with only its own instruction-set flags, so
nothing built for AVX-512 can leak into the AVX2 path. The best path the CPU reports
(/proc/cpuinfo) is used unless SPECVOCAB_KERNELS names one (avx512vbmi|avx512|avx2|portable|torch);
`torch` means no compiled kernels.

Builds are cached under torch's extension directory, keyed by a hash of the sources, flags, torch
and Python versions; a cached build is imported directly (no compiler run, nothing printed). A build
runs in a folder of its own and is published whole by one rename, so a build killed midway is
started afresh by the next run, never waited on.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

from artifacts.atomic import remove_dead_leftovers, tmp_name

ENV = "SPECVOCAB_KERNELS"
PATHS = ("avx512vbmi", "avx512", "avx2", "portable")  # best first
CHOICES = (*PATHS, "torch")
_SOURCE_DIR = Path(__file__).parent / "csrc"  # the C++ sources and headers
_SOURCES = {
    "avx512vbmi": ("module_avx512.cpp", "screen_avx512.cpp", "screen4_avx512.cpp"),
    "avx512": ("module_avx512.cpp", "screen_avx512.cpp", "screen4_avx512.cpp"),
    "avx2": ("module_avx2.cpp", "screen_avx2.cpp", "screen4_avx2.cpp"),
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
# -ffp-contract=off: GCC would otherwise fuse products and sums such as Q4_K's fl(d * sc) * q - fl(dmin * m)
# into FMAs, which round differently from gguf-py's float32 operations (where one FMA rounds the same,
# the _1 formats' d * q + m with d * q exact, the kernels write it: affine_per_element.h).
# No -fopenmp: the kernels' regions run on their own pool (pool.h).
_COMMON_FLAGS = ("-O3", "-ffp-contract=off")
BUILT_MARKER = "built.ok"  # in a build folder: its .so is complete


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
    for source in sorted(_SOURCE_DIR.glob("*.cpp")) + sorted(_SOURCE_DIR.glob("*.h")):
        digest.update(source.name.encode() + source.read_bytes())
    digest.update(" ".join((*_ISA_FLAGS[path], *_COMMON_FLAGS, torch.__version__, sys.version)).encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    name = f"specvocab_kernels_{path}"
    return name, root / f"{name}-{digest.hexdigest()[:16]}"


class NoBuildPlace(OSError):
    """The build folder cannot be written (read-only, full): every path would fail alike."""


@lru_cache(maxsize=None)
def module(path: str) -> ModuleType | None:
    """The extension module of `path`, built on first use; None (with a one-line note) if it cannot be built.

    NoBuildPlace when the build folder cannot be written, which no other path escapes either.
    """
    name, build_dir = _build_dir(path)
    built, marker = build_dir / f"{name}.so", build_dir / BUILT_MARKER
    try:
        if not marker.exists():
            return _compile(path, name, build_dir)
        spec = importlib.util.spec_from_file_location(name, built)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    except NoBuildPlace:
        raise
    except Exception as exc:  # a missing compiler must not stop decoding, only slow it
        if os.strerror(errno.ENOSPC) in str(exc):  # the compiler's output says so: the folder filled up
            raise NoBuildPlace(errno.ENOSPC, os.strerror(errno.ENOSPC), str(build_dir.parent)) from None
        print(f"specvocab: CPU kernels ({path}) unavailable ({' '.join(str(exc).split())[:300]})", file=sys.stderr)
        return None


def _compile(path: str, name: str, build_dir: Path) -> ModuleType:
    """Compile and load the extension of `path` in a private folder, then publish it as `build_dir` by one rename.

    torch builds under a lock file in its build folder that it removes when the build ends; a build
    killed with kill -9 leaves it, and a later build there would wait on it forever (as its compiler
    processes, which outlive it, may still write there). So each build has its own folder, named
    with its pid: a dead one's is removed by the next build, and a folder named `build_dir` is always
    a whole build. Two first runs at once both compile; the first rename wins, the other's is dropped.
    """
    from torch.utils.cpp_extension import load

    try:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_leftovers(build_dir.parent)
        if build_dir.exists():  # a folder without the marker: a build of an older layout, never imported
            shutil.rmtree(build_dir)
        work = build_dir.parent / tmp_name(build_dir.name)
        work.mkdir()
    except OSError as e:
        raise NoBuildPlace(e.errno, e.strerror, str(build_dir.parent)) from None
    try:
        print(f"specvocab: compiling the CPU kernels ({path}; once, ~1 min)", file=sys.stderr)
        loaded = load(
            name=name,
            sources=[str(_SOURCE_DIR / s) for s in _SOURCES[path]],
            extra_include_paths=[str(_SOURCE_DIR)],
            extra_cflags=[*_ISA_FLAGS[path], *_COMMON_FLAGS],
            build_directory=str(work),
            verbose=False,
        )
        (work / BUILT_MARKER).touch()
        try:
            os.rename(work, build_dir)
        except OSError:
            if not (build_dir / BUILT_MARKER).exists():  # not another process's whole build
                raise
        return loaded
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the loaded module stays mapped


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
    try:
        for path in (choice,) if choice else runnable_paths():
            loaded = module(path)
            if loaded is not None:
                return path, loaded
    except NoBuildPlace as e:
        print(f"specvocab: cannot build the CPU kernels in {e.filename} ({e.strerror}); set TORCH_EXTENSIONS_DIR to a "
              "writable folder with room; decoding goes on with torch's kernels (slower)", file=sys.stderr)
        return "torch", None
    print("specvocab: no compiled CPU kernels could be built; decoding goes on with torch's kernels (slower)",
          file=sys.stderr)
    return "torch", None
