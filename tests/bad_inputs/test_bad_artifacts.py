"""Damaged and foreign artifacts, read through Artifact.read_stage and written into by `prep cluster`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import safetensors.torch

from artifacts import Artifact, ArtifactError
from artifacts.format import MANIFEST_FILE, Stage
from bad_helpers import TINY_CLUSTERS, prep_fails, snapshot


def read_fails(art: Path, stage: str, *must_say: str) -> str:
    """Reading `stage` raises one line of ArtifactError naming the fix, and changes nothing on disk."""
    before = snapshot(art)
    with pytest.raises(ArtifactError) as err:
        Artifact.open(art).read_stage(stage)
    message = str(err.value)
    assert "\n" not in message
    for text in must_say:
        assert text in message, message
    assert snapshot(art) == before
    return message


def patch_manifest(art: Path, edit) -> None:
    data = json.loads((art / MANIFEST_FILE).read_text())
    edit(data)
    (art / MANIFEST_FILE).write_text(json.dumps(data))


def rerecord(art: Path, stage: str, filename: str) -> None:
    """Make the manifest agree with a file's current bytes: a tamper that checksums cannot see."""
    payload = (art / filename).read_bytes()
    patch_manifest(art, lambda d: d["stages"][stage]["files"].__setitem__(
        filename, {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}))


def test_flipped_byte(art: Path):
    data = bytearray((art / "screen.safetensors").read_bytes())
    data[-3] ^= 0x40
    (art / "screen.safetensors").write_bytes(bytes(data))
    read_fails(art, Stage.SCREEN, "fails its sha256", "--force")


def test_truncated_stage_file(art: Path):
    path = art / "clusters.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    read_fails(art, Stage.CLUSTERS, "has 100 bytes", "prep cluster")


def test_deleted_stage_file(art: Path):
    (art / "clusters.safetensors").unlink()
    read_fails(art, Stage.CLUSTERS, "clusters.safetensors is missing", "--force")


def test_files_emptied_then_byte_flipped(art: Path):
    patch_manifest(art, lambda d: d["stages"]["screen"].__setitem__("files", {}))
    data = bytearray((art / "screen.safetensors").read_bytes())
    data[-1] ^= 1
    (art / "screen.safetensors").write_bytes(bytes(data))
    read_fails(art, Stage.SCREEN, "records no checksum for screen.safetensors", "--force")


def test_a_stage_holding_another_stages_file(art: Path):
    (art / "screen.safetensors").write_bytes((art / "clusters.safetensors").read_bytes())
    rerecord(art, "screen", "screen.safetensors")
    read_fails(art, Stage.SCREEN, "holds stage 'clusters'", "--force")


def test_a_tensor_of_the_wrong_dtype(art: Path):
    tensors = safetensors.torch.load_file(art / "screen.safetensors")
    tensors["qweight"] = tensors["qweight"].float()
    safetensors.torch.save_file(tensors, str(art / "screen.safetensors"))
    rerecord(art, "screen", "screen.safetensors")
    read_fails(art, Stage.SCREEN, "'qweight' is float32, expected int8")


def test_a_tensor_of_another_models_shape(art: Path):
    tensors = safetensors.torch.load_file(art / "clusters.safetensors")
    tensors["labels"] = tensors["labels"][:-1].clone()
    safetensors.torch.save_file(tensors, str(art / "clusters.safetensors"))
    rerecord(art, "clusters", "clusters.safetensors")
    read_fails(art, Stage.CLUSTERS, "'labels' has shape [255], expected [V] with V=256")


def test_a_missing_stage(art: Path):
    read_fails(art, Stage.GP, "no 'gp' stage", "prep gp-basis")


def test_a_missing_parameter(art: Path):
    patch_manifest(art, lambda d: d["stages"]["screen"]["params"].pop("per_row"))
    read_fails(art, Stage.SCREEN, "has no parameter(s) per_row")


@pytest.mark.parametrize("manifest, says", [
    ("{not json", "not valid JSON"),
    (json.dumps({"format_version": 99}), "format_version 99"),
    (json.dumps({"format_version": 2, "created_by": "x"}), "malformed"),
    ("", "not valid JSON"),
], ids=["not-json", "future-version", "malformed", "empty"])
def test_a_bad_manifest_is_refused_by_prep(art: Path, tiny_model: Path, manifest: str, says: str):
    (art / MANIFEST_FILE).write_text(manifest)
    line = prep_fails(["cluster", tiny_model, "-o", art, *TINY_CLUSTERS], says, unchanged=(art,))
    assert "NEWDIR" in line and f"-o {art}`" not in line  # building into the same folder would meet the same manifest


def test_a_manifest_with_an_escaping_file_name(art: Path, tiny_model: Path):
    patch_manifest(art, lambda d: d["stages"]["screen"]["files"].__setitem__("../x", {"sha256": "0" * 64, "size": 1}))
    prep_fails(["cluster", tiny_model, "-o", art, *TINY_CLUSTERS], "not a plain file name", unchanged=(art,))


def test_an_artifact_of_another_model(art: Path, other_model: Path):
    prep_fails(["cluster", other_model, "-o", art, *TINY_CLUSTERS], "was built for tiny", "NEWDIR", unchanged=(art,))


def test_a_foreign_directory_holding_a_stage_file(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "clusters.safetensors").write_bytes(b"not ours")
    prep_fails(["cluster", tiny_model, "-o", out, *TINY_CLUSTERS], "not a specvocab artifact", "--force", unchanged=(out,))


def test_output_is_a_file(tmp_path: Path, tiny_model: Path):
    (tmp_path / "file").write_text("x")
    prep_fails(["cluster", tiny_model, "-o", tmp_path / "file", *TINY_CLUSTERS], "not a directory", unchanged=(tmp_path,))


def test_output_under_a_file_is_unwritable(tmp_path: Path, tiny_model: Path):
    (tmp_path / "file").write_text("x")
    prep_fails(["cluster", tiny_model, "-o", tmp_path / "file" / "art", *TINY_CLUSTERS], "cannot write to",
               "choose a writable -o", unchanged=(tmp_path,))


def test_a_manifest_naming_an_unknown_packaged_model(art: Path):
    from runtime.models import ModelError
    from runtime.session import open_session

    patch_manifest(art, lambda d: d["model"].__setitem__("source", {"kind": "packaged", "name": "llama-99b"}))
    with pytest.raises(ModelError, match="unknown model 'llama-99b'.*pass --model"):
        open_session(art, progress=False)


def test_stage_files_are_readable_by_others(art: Path):
    for p in art.iterdir():
        assert p.stat().st_mode & 0o044 == 0o044, p.name  # the umask's 0644, not 0600


def test_a_file_inside_an_artifact_names_the_folder(art: Path):
    with pytest.raises(ArtifactError, match=rf"not a specvocab artifact \(not a directory\); pass the artifact's folder, {art}$"):
        Artifact.open(art / MANIFEST_FILE)


def test_a_dangling_link_is_named_as_one(tmp_path: Path, tiny_model: Path):
    link = tmp_path / "art"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ArtifactError, match=f"it is a link to {tmp_path / 'gone'}, which does not exist: fix or remove the link"):
        Artifact.open(link)
    prep_fails(["cluster", tiny_model, "-o", link, *TINY_CLUSTERS], f"cannot write to {link}: it is a link to "
               f"{tmp_path / 'gone'}, which does not exist; fix or remove the link, or choose another -o")
    assert link.is_symlink() and not (tmp_path / "gone").exists()
