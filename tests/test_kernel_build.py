"""Building the CPU kernels: one builder at a time, and a build killed midway never blocks the next run.

torch.utils.cpp_extension.load is replaced by a stand-in here (a real build takes minutes); the stand-in
checks what the real one would meet: torch's lock file, and whether another process could build too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.kernels import build


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private torch extensions folder, and module()'s cache cleared before and after."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    build.module.cache_clear()
    yield tmp_path / "ext"
    build.module.cache_clear()


def flock_taken(lock: Path) -> bool:
    """Whether another process holds the flock on `lock` (tried from a separate process, without waiting)."""
    code = ("import fcntl, sys\nf = open(sys.argv[1], 'a')\n"
            "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, str(lock)]).returncode == 3


def fake_load(seen: dict):
    """A stand-in for cpp_extension.load that records what a real build would meet, and returns a module."""
    def load(name, build_directory, **kwargs):
        folder = Path(build_directory)
        seen.update(torch_lock=(folder / build.TORCH_BUILD_LOCK).exists(), files=sorted(p.name for p in folder.iterdir()),
                    held=flock_taken(folder / build.BUILDER_LOCK))
        return "the module"
    return load


def test_a_build_killed_midway_is_started_afresh_not_waited_on(build_root: Path, monkeypatch: pytest.MonkeyPatch):
    """kill -9 during torch's build leaves its lock file (and half-written objects): the next run would wait forever."""
    name, folder = build._build_dir("portable")
    folder.mkdir(parents=True)
    (folder / build.TORCH_BUILD_LOCK).write_text("")
    (folder / "module_portable.o").write_bytes(b"half an object")
    seen: dict = {}
    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load(seen))
    assert build.module("portable") == "the module"
    assert seen == {"torch_lock": False, "files": [build.BUILDER_LOCK], "held": True}
    assert (folder / "built.ok").exists()


def test_a_second_process_waits_for_the_builder_and_then_uses_its_build(build_root: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capfd: pytest.CaptureFixture[str]):
    name, folder = build._build_dir("portable")
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time, pathlib\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\ntime.sleep(1.5)\npathlib.Path(sys.argv[2]).touch()\n"),  # builds, marks it done
        str(folder / build.BUILDER_LOCK), str(folder / "built.ok")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: pytest.fail("built a second time"))
        imported = []  # the .so the holder built is imported, not compiled again
        monkeypatch.setattr(build.importlib.util, "spec_from_file_location", lambda name, path: SimpleNamespace(
            loader=SimpleNamespace(exec_module=imported.append), path=path))
        monkeypatch.setattr(build.importlib.util, "module_from_spec", lambda spec: SimpleNamespace(spec=spec))
        started = time.monotonic()
        loaded = build.module("portable")
        assert time.monotonic() - started > 0.5 and imported == [loaded] and loaded.spec.path == folder / f"{name}.so"
    finally:
        holder.wait(timeout=30)
    assert "waiting for another process that compiles the CPU kernels" in capfd.readouterr().err
