"""Building the CPU kernels: a build killed midway never blocks the next run, and a build folder is always whole.

torch.utils.cpp_extension.load is replaced by a stand-in here (a real build takes minutes); the stand-in
records the folder a real build would write into and what it would find there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.kernels import build

DEAD_PID = 2**22 + 1  # above Linux's pid_max: no process has it


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private torch extensions folder, and module()'s cache cleared before and after."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    build.module.cache_clear()
    yield tmp_path / "ext"
    build.module.cache_clear()


def fake_load(seen: list):
    """A stand-in for cpp_extension.load: records its build folder and that folder's files, writes the .so."""
    def load(name, build_directory, **kwargs):
        folder = Path(build_directory)
        seen.append((folder, sorted(p.name for p in folder.iterdir())))
        (folder / f"{name}.so").write_bytes(b"a built module")
        return "the module"
    return load


def test_a_build_killed_midway_is_removed_and_built_afresh(build_root: Path, monkeypatch: pytest.MonkeyPatch):
    """kill -9 during torch's build leaves its lock file (a later build in that folder waits forever) and
    half-written objects: the next run builds in a folder of its own and publishes it whole."""
    name, folder = build._build_dir("portable")
    dead = folder.parent / f".tmp-{DEAD_PID}-0000-{folder.name}"
    dead.mkdir(parents=True)
    (dead / "lock").write_text("")
    (dead / "module_portable.o").write_bytes(b"half an object")
    seen: list = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load(seen))
    assert build.module("portable") == "the module"
    [(work, files)] = seen
    assert work.name.startswith(f".tmp-{os.getpid()}-") and files == []  # its own, empty folder
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # the dead build's folder is gone
    assert sorted(p.name for p in folder.iterdir()) == [build.BUILT_MARKER, f"{name}.so"]


def test_a_folder_without_the_marker_is_rebuilt(build_root: Path, monkeypatch: pytest.MonkeyPatch):
    name, folder = build._build_dir("portable")
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # a build of the layout before builds had folders of their own
    seen: list = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load(seen))
    assert build.module("portable") == "the module" and len(seen) == 1
    assert sorted(p.name for p in folder.iterdir()) == [build.BUILT_MARKER, f"{name}.so"]


def test_two_first_runs_at_once_keep_the_first_whole_build(build_root: Path, monkeypatch: pytest.MonkeyPatch):
    """Another process published its build while this one compiled: this one's module is used, its folder dropped."""
    name, folder = build._build_dir("portable")

    def load_while_another_publishes(name, build_directory, **kwargs):
        folder.mkdir(parents=True)
        (folder / f"{name}.so").write_bytes(b"the other build")
        (folder / build.BUILT_MARKER).touch()
        return "this run's module"

    monkeypatch.setattr("torch.utils.cpp_extension.load", load_while_another_publishes)
    assert build.module("portable") == "this run's module"
    assert (folder / f"{name}.so").read_bytes() == b"the other build"
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


@pytest.fixture
def fresh_choice(build_root: Path):
    """active()'s cache cleared before and after (so later tests get the real kernels again)."""
    build.active.cache_clear()
    yield
    build.active.cache_clear()


def test_an_unwritable_build_folder_is_one_line_and_no_path_is_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      fresh_choice, capfd: pytest.CaptureFixture[str]):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "file" / "ext"))  # mkdir fails: not a directory
    monkeypatch.delenv(build.ENV, raising=False)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: pytest.fail("a build was started"))
    assert build.active() == ("torch", None)
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"specvocab: cannot build the CPU kernels in {tmp_path / 'file' / 'ext'} (Not a directory); set "
                   "TORCH_EXTENSIONS_DIR to a writable folder with room; decoding goes on with torch's kernels (slower)"]


def test_a_build_that_fills_the_disk_stops_the_other_paths(monkeypatch: pytest.MonkeyPatch, fresh_choice,
                                                            capfd: pytest.CaptureFixture[str]):
    builds = []

    def disk_full(name, **kwargs):
        builds.append(name)
        raise RuntimeError("Error building extension: ... fatal error: error writing to x.o: No space left on device")

    monkeypatch.delenv(build.ENV, raising=False)
    monkeypatch.setattr("torch.utils.cpp_extension.load", disk_full)
    assert build.active() == ("torch", None) and len(builds) == 1
    assert "(No space left on device); set TORCH_EXTENSIONS_DIR" in capfd.readouterr().err


def test_the_build_key_reads_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """csrc/ holds only .cpp and .h files, each compiled source is there, and a byte changed in any file
    gives another build folder (a cached build of older sources is never imported)."""
    import shutil

    sources = sorted(build._SOURCE_DIR.iterdir())
    assert sources and all(p.suffix in (".cpp", ".h") for p in sources), [p.name for p in sources]
    assert {name for names in build._SOURCES.values() for name in names} <= {p.name for p in sources}
    copy = tmp_path / "csrc"
    shutil.copytree(build._SOURCE_DIR, copy)
    monkeypatch.setattr(build, "_SOURCE_DIR", copy)
    keys = {build._build_dir("portable")[1]}
    for source in sorted(copy.iterdir()):
        source.write_bytes(source.read_bytes() + b"\n")
        keys.add(build._build_dir("portable")[1])
    assert len(keys) == len(sources) + 1
