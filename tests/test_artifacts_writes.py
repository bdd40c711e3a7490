"""Tests of artifact writes: --force, failures that leave the previous state, concurrent handles, the writer lock, modes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from artifact_factories import CLUSTER_PARAMS, VERSION, cluster_tensors, make_model, snapshot, stage_data
import artifacts.store
from artifacts import MANIFEST_FILE, Artifact, ArtifactError, Stage, StageExists


def test_existing_stage_needs_force(art: Artifact) -> None:
    before = snapshot(art.path)
    with pytest.raises(StageExists, match="pass --force to overwrite"):
        art.write_stage(Stage.CLUSTERS, *stage_data(Stage.CLUSTERS, seed=1)[:2])
    assert snapshot(art.path) == before
    assert art.stage_params(Stage.CLUSTERS) == CLUSTER_PARAMS


def test_force_overwrites(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.CLUSTERS, cluster_tensors(), CLUSTER_PARAMS)
    artifact.write_stage(Stage.CLUSTERS, *stage_data(Stage.CLUSTERS, seed=1, v=2)[:2], force=True)
    reopened = Artifact.open(artifact.path)
    assert torch.equal(reopened.read_stage(Stage.CLUSTERS)["radii"], stage_data(Stage.CLUSTERS, seed=1)[0]["radii"])
    assert reopened.stage_params(Stage.CLUSTERS)["v"] == 2
    assert reopened.verify() == []


def _save_half_then_fail(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
    """Stand-in for safetensors' save_file that dies after writing part of the file."""
    Path(filename).write_bytes(b"partial")
    raise OSError("disk full")


@pytest.mark.parametrize("force", [False, True])
def test_failed_write_leaves_previous_state(
    art: Artifact, monkeypatch: pytest.MonkeyPatch, force: bool
) -> None:
    stage = Stage.CLUSTERS if force else Stage.GP
    before = snapshot(art.path)
    monkeypatch.setattr(safetensors.torch, "save_file", _save_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        art.write_stage(stage, *stage_data(stage, seed=2)[:2], force=force)
    assert snapshot(art.path) == before
    assert not [p for p in art.path.iterdir() if p.name.startswith(".tmp-")]
    reopened = Artifact.open(art.path)
    assert reopened.stages == [Stage.CLUSTERS] and reopened.verify() == []
    assert torch.equal(reopened.read_stage(Stage.CLUSTERS)["centroids"], cluster_tensors()["centroids"])


def test_failed_manifest_commit_restores_old_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.ROUTER, *stage_data(Stage.ROUTER, v=1))
    before = snapshot(artifact.path)

    def fail_commit(path: Path, manifest: object) -> None:
        raise KeyboardInterrupt

    # Fails after the new files were renamed into place: the rollback path.
    monkeypatch.setattr(artifacts.store, "write_manifest", fail_commit)
    with pytest.raises(KeyboardInterrupt):
        artifact.write_stage(Stage.ROUTER, *stage_data(Stage.ROUTER, seed=1, v=2), force=True)
    assert snapshot(artifact.path) == before
    assert artifact.stage_params(Stage.ROUTER)["v"] == 1
    assert Artifact.open(artifact.path).verify() == []


def test_bad_names_and_params_are_rejected_before_writing(art: Artifact) -> None:
    before = snapshot(art.path)
    tensors, params, _ = stage_data(Stage.ROUTER)
    with pytest.raises(ValueError, match="has files"):
        art.write_stage(Stage.ROUTER, tensors, params, {"../router.onnx": b"x"})
    with pytest.raises(ValueError, match="no schema is declared for stage 'Router/x'"):
        art.write_stage("Router/x", {}, {})
    with pytest.raises(ValueError, match="plain JSON"):
        art.write_stage(Stage.ROUTER, tensors, {"t": torch.ones(1)})
    with pytest.raises(ValueError, match=r"tensor 'qweight' has shape \[32, 7\], expected \[V, d\]"):
        art.write_stage(Stage.SCREEN, {**stage_data(Stage.SCREEN)[0], "qweight": torch.zeros(32, 7, dtype=torch.int8)},
                        stage_data(Stage.SCREEN)[1])
    assert snapshot(art.path) == before


def test_writes_through_another_handle_are_kept(art: Artifact) -> None:
    other = Artifact.open(art.path)
    other.write_stage(Stage.GP, *stage_data(Stage.GP)[:2])
    art.write_stage(Stage.ONEDECODE, *stage_data(Stage.ONEDECODE)[:2])
    assert Artifact.open(art.path).stages == [Stage.CLUSTERS, Stage.GP, Stage.ONEDECODE]


def test_a_reader_with_an_old_manifest_rereads_it(art: Artifact) -> None:
    """A reader that opened the manifest before a --force rewrite gets the new stage, not a corruption error."""
    reader = Artifact.open(art.path)
    writer = Artifact.open(art.path)
    new = stage_data(Stage.CLUSTERS, seed=5)
    writer.write_stage(Stage.CLUSTERS, *new[:2], force=True)
    assert torch.equal(reader.read_stage(Stage.CLUSTERS)["radii"], new[0]["radii"])


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_taken_over(art: Artifact) -> None:
    from artifacts.atomic import LOCK_FILE

    with art.writing():
        assert (art.path / LOCK_FILE).read_text().strip() == str(os.getpid())
        held = subprocess.run([sys.executable, "-c", (
            "import sys, torch; from artifacts import Artifact; "
            f"a = Artifact.open({str(art.path)!r})\n"
            "try:\n    a.writing().__enter__()\nexcept Exception as e:\n    print(e)")],
            capture_output=True, text=True, check=True)
        assert f"being written by another prep run (pid {os.getpid()})" in held.stdout
    assert not (art.path / LOCK_FILE).exists()
    (art.path / LOCK_FILE).write_text(f"{2**22 + 1}\n")  # a pid no process can have
    (art.path / f".tmp-{2**22 + 1}-abcd-clusters").mkdir()  # and its leftover
    art.write_stage(Stage.SCREEN, *stage_data(Stage.SCREEN)[:2])
    assert sorted(p.name for p in art.path.iterdir()) == ["clusters.safetensors", MANIFEST_FILE, "screen.safetensors"]


def test_a_killed_writer_not_yet_reaped_is_dead(art: Artifact) -> None:
    """kill -9 leaves a zombie until the parent waits (an orchestrating script, a slow exit): its lock and its
    leftovers are a dead writer's, not a live one's that a rerun must wait for."""
    import time

    from artifacts.atomic import LOCK_FILE, is_zombie, pid_alive

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(killed.pid)
        killed.kill()
        deadline = time.monotonic() + 30
        while not is_zombie(killed.pid):  # the kill is asynchronous
            assert time.monotonic() < deadline, "the killed process never became a zombie"
            time.sleep(0.01)
        assert not pid_alive(killed.pid)
        (art.path / LOCK_FILE).write_text(f"{killed.pid}\n")
        (art.path / f".tmp-{killed.pid}-abcd-screen").mkdir()
        art.write_stage(Stage.SCREEN, *stage_data(Stage.SCREEN)[:2])
    finally:
        killed.wait()
    assert sorted(p.name for p in art.path.iterdir()) == ["clusters.safetensors", MANIFEST_FILE, "screen.safetensors"]


def test_files_get_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        art = Artifact.create(tmp_path / "art", make_model(), VERSION)
        art.write_stage(Stage.CLUSTERS, cluster_tensors(), CLUSTER_PARAMS)
    finally:
        os.umask(old)
    for p in art.path.iterdir():
        assert p.stat().st_mode & 0o777 == 0o644, p.name


def test_a_foreign_directory_with_stage_files_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "clusters.safetensors").write_bytes(b"someone else's")
    with pytest.raises(ArtifactError, match="not a specvocab artifact but holds clusters.safetensors.*--force"):
        Artifact.create(out, make_model(), VERSION)
    assert sorted(p.name for p in out.iterdir()) == ["clusters.safetensors"]
    Artifact.create(out, make_model(), VERSION, force=True).write_stage(
        Stage.CLUSTERS, cluster_tensors(), CLUSTER_PARAMS, force=True)


@pytest.mark.parametrize("filename", [None, "tmp"], ids=["unnamed", "names-the-temporary"])
def test_a_failed_atomic_write_names_the_file_it_replaces(tmp_path: Path, filename: str | None) -> None:
    """A full disk during a write (matplotlib's names no file; a plain write names the temporary) is reported
    as the target's, whose old bytes stay; the temporary is removed."""
    import errno

    from artifacts.atomic import atomic_write

    target = tmp_path / "run.md"
    target.write_text("old")

    def disk_full(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(tmp)] if filename else []))

    with pytest.raises(OSError) as raised:
        atomic_write(target, disk_full)
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(target))
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["run.md"]
