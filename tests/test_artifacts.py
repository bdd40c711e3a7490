"""Tests of the artifact format: round trips, checksums, model identity, atomic writes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import safetensors.torch
import torch

import artifacts.store
from artifacts import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Artifact,
    ArtifactError,
    ChecksumMismatch,
    MissingStage,
    ModelInfo,
    ModelMismatch,
    ModelSource,
    NotAnArtifact,
    Stage,
    StageExists,
    UnknownFormatVersion,
    same_model,
    tensor_sha256,
    vocab_sha256,
)

VERSION = "specvocab 0.1.0-test"


def make_model(seed: int = 0, name: str = "tiny") -> ModelInfo:
    """Return the ModelInfo of a tiny random model whose head depends on `seed`."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(32, 8, generator=gen)  # [V, d]
    vocab = {f"tok{i}": i for i in range(32)}
    return ModelInfo(
        name=name,
        source=ModelSource("hf-dir", path=f"/models/{name}"),
        architecture="llama",
        vocab_size=32,
        hidden_size=8,
        lm_head_sha256=tensor_sha256(head),
        vocab_sha256=vocab_sha256(vocab),
    )


def cluster_tensors() -> dict[str, torch.Tensor]:
    """Return small tensors of several dtypes, as a clusters stage might hold."""
    gen = torch.Generator().manual_seed(1)
    return {
        "centroids": torch.randn(4, 8, generator=gen),
        "radii": torch.rand(4, generator=gen, dtype=torch.float64),
        "assign": torch.randint(0, 4, (32,), generator=gen),
        "bias": torch.randn(4, generator=gen).to(torch.bfloat16),
    }


def snapshot(path: Path) -> dict[str, bytes]:
    """Return every file under `path` (relative name -> bytes), to compare states."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def art(tmp_path: Path) -> Artifact:
    """An artifact with one clusters stage."""
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.CLUSTERS, cluster_tensors(), {"k": 4, "metric": "cosine"})
    return artifact


def test_round_trip_tensors_params_and_extra_files(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    tensors = {"w": torch.arange(12.0).reshape(3, 4).t(), "b": torch.ones(3, dtype=torch.bfloat16)}
    onnx = b"\x08\x07fake onnx bytes"
    artifact.write_stage(Stage.ROUTER, tensors, {"hidden": [16, 8], "lr": 1e-3}, {"router.onnx": onnx})

    reopened = Artifact.open(tmp_path / "art")
    loaded = reopened.read_stage(Stage.ROUTER)
    assert set(loaded) == {"w", "b"}
    for key, t in tensors.items():
        assert loaded[key].dtype == t.dtype and loaded[key].device.type == "cpu"
        assert loaded[key].is_contiguous()
        assert torch.equal(loaded[key], t)
    assert reopened.stage_params(Stage.ROUTER) == {"hidden": [16, 8], "lr": 1e-3}
    assert reopened.stage_file(Stage.ROUTER, "router.onnx").read_bytes() == onnx
    assert reopened.stages == [Stage.ROUTER] and reopened.has_stage(Stage.ROUTER)
    assert reopened.model == make_model()


def test_manifest_content(art: Artifact) -> None:
    data = json.loads((art.path / MANIFEST_FILE).read_text())
    assert set(data) == {"format_version", "created_by", "model", "stages"}
    assert data["format_version"] == FORMAT_VERSION == 2
    assert data["created_by"] == VERSION
    assert ModelInfo.from_json(data["model"]) == make_model()
    assert set(data["model"]["fingerprint"]) == {"lm_head_sha256", "vocab_sha256"}
    stage = data["stages"]["clusters"]
    assert stage["params"] == {"k": 4, "metric": "cosine"}
    created = datetime.fromisoformat(stage["created_at"])
    assert created.utcoffset() == timedelta(0)
    file_bytes = (art.path / "clusters.safetensors").read_bytes()
    assert stage["files"] == {
        "clusters.safetensors": {"sha256": hashlib.sha256(file_bytes).hexdigest(), "size": len(file_bytes)}
    }


def test_nothing_is_pickled(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.CLUSTERS, cluster_tensors(), {"k": 4})
    artifact.write_stage(Stage.ROUTER, {"w": torch.zeros(2)}, {}, {"router.onnx": b"onnx"})
    names = sorted(p.name for p in artifact.path.iterdir())
    assert names == ["clusters.safetensors", MANIFEST_FILE, "router.onnx", "router.safetensors"]
    assert not [p for p in artifact.path.rglob("*") if p.suffix in (".pt", ".pth", ".pkl", ".bin")]
    # Readable by the plain safetensors loader, which cannot unpickle anything.
    assert torch.equal(safetensors.torch.load_file(artifact.path / "router.safetensors")["w"], torch.zeros(2))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_raises_checksum_mismatch(art: Artifact, damage: str) -> None:
    path = art.path / "clusters.safetensors"
    data = path.read_bytes()
    if damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "truncate":
        path.write_bytes(data[:-4])
    else:
        path.unlink()
    with pytest.raises(ChecksumMismatch, match=r"prep cluster tiny -o .* --force"):
        art.read_stage(Stage.CLUSTERS)
    problems = art.verify()
    assert len(problems) == 1 and "clusters.safetensors" in problems[0]


def test_corrupt_extra_file_is_caught_by_stage_file_and_read_stage(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.ROUTER, {"w": torch.zeros(2)}, {}, {"router.onnx": b"good"})
    (artifact.path / "router.onnx").write_bytes(b"evil")
    with pytest.raises(ChecksumMismatch, match="router.onnx fails its sha256"):
        artifact.stage_file(Stage.ROUTER, "router.onnx")
    with pytest.raises(ChecksumMismatch):
        artifact.read_stage(Stage.ROUTER)
    assert torch.equal(artifact.read_stage(Stage.ROUTER, verify=False)["w"], torch.zeros(2))


def test_verify_is_empty_for_an_intact_artifact(art: Artifact) -> None:
    assert art.verify() == []


def test_wrong_model_raises_model_mismatch(art: Artifact) -> None:
    other = make_model(seed=7, name="other")
    with pytest.raises(ModelMismatch, match=r"built for tiny .*not other .*prep cluster other -o NEWDIR"):
        Artifact.create(art.path, other, VERSION)
    with pytest.raises(ModelMismatch):
        art.check_model(other)
    # Same weights and tokenizer under another name is the same model.
    renamed = dataclasses.replace(make_model(), name="tiny-copy", source=ModelSource("hf-dir", path="/elsewhere"))
    art.check_model(renamed)
    assert Artifact.create(art.path, renamed, VERSION).stages == [Stage.CLUSTERS]


def test_same_model_compares_fingerprints_and_sizes() -> None:
    base = make_model()
    assert same_model(base, dataclasses.replace(base, name="x", architecture="y"))
    assert not same_model(base, dataclasses.replace(base, vocab_sha256="0" * 64))
    assert not same_model(base, dataclasses.replace(base, hidden_size=16))


def test_fingerprints_fold_in_dtype_shape_and_values() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    assert tensor_sha256(t) == tensor_sha256(t.t().contiguous().t())
    assert tensor_sha256(t) != tensor_sha256(t.reshape(3, 2))
    assert tensor_sha256(t) != tensor_sha256(t.double())
    assert tensor_sha256(t) != tensor_sha256(t + 1)
    assert tensor_sha256(t.bfloat16()) == tensor_sha256(t.bfloat16().clone())
    assert vocab_sha256({"a": 0, "b": 1}) == vocab_sha256({"b": 1, "a": 0})
    assert vocab_sha256({"a": 0, "b": 1}) != vocab_sha256({"a": 1, "b": 0})


@pytest.mark.parametrize("version", [3, 0, "1", True])
def test_unknown_format_version(art: Artifact, version: object) -> None:
    manifest = art.path / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["format_version"] = version
    manifest.write_text(json.dumps(data))
    with pytest.raises(UnknownFormatVersion, match="upgrade specvocab or rebuild"):
        Artifact.open(art.path)


def test_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(NotAnArtifact, match="no such directory"):
        Artifact.open(tmp_path / "missing")
    with pytest.raises(NotAnArtifact, match="no manifest.json"):
        Artifact.open(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(NotAnArtifact, match="not valid JSON"):
        Artifact.open(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format_version": 1, "created_by": "x"}))
    with pytest.raises(NotAnArtifact, match="malformed"):
        Artifact.open(tmp_path)


def test_manifest_with_unsafe_file_name_is_rejected(art: Artifact) -> None:
    manifest = art.path / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["stages"]["clusters"]["files"]["../escape"] = {"sha256": "0" * 64, "size": 1}
    manifest.write_text(json.dumps(data))
    with pytest.raises(NotAnArtifact, match="not a plain file name"):
        Artifact.open(art.path)


def test_missing_stage_names_the_prep_command(art: Artifact) -> None:
    with pytest.raises(MissingStage, match=r"no 'router' stage; run `prep train-router .*art --traces"):
        art.read_stage(Stage.ROUTER)
    with pytest.raises(MissingStage):
        art.stage_params(Stage.GP)
    with pytest.raises(MissingStage, match="no file 'router.onnx'"):
        art.stage_file(Stage.CLUSTERS, "router.onnx")


def test_existing_stage_needs_force(art: Artifact) -> None:
    before = snapshot(art.path)
    with pytest.raises(StageExists, match="pass --force to overwrite"):
        art.write_stage(Stage.CLUSTERS, {"x": torch.ones(1)}, {"k": 1})
    assert snapshot(art.path) == before
    assert art.stage_params(Stage.CLUSTERS) == {"k": 4, "metric": "cosine"}


def test_force_overwrites_and_drops_files_no_longer_listed(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.ROUTER, {"w": torch.zeros(2)}, {"v": 1}, {"router.onnx": b"old"})
    artifact.write_stage(Stage.ROUTER, {"w": torch.ones(3)}, {"v": 2}, force=True)
    reopened = Artifact.open(artifact.path)
    assert torch.equal(reopened.read_stage(Stage.ROUTER)["w"], torch.ones(3))
    assert reopened.stage_params(Stage.ROUTER) == {"v": 2}
    assert not (artifact.path / "router.onnx").exists()
    assert reopened.verify() == []


def _save_half_then_fail(tensors: dict[str, torch.Tensor], filename: str) -> None:
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
        art.write_stage(stage, {"u": torch.ones(2)}, {"rank": 2}, force=force)
    assert snapshot(art.path) == before
    assert not [p for p in art.path.iterdir() if p.name.startswith(".tmp-")]
    reopened = Artifact.open(art.path)
    assert reopened.stages == [Stage.CLUSTERS] and reopened.verify() == []
    assert torch.equal(reopened.read_stage(Stage.CLUSTERS)["centroids"], cluster_tensors()["centroids"])


def test_failed_manifest_commit_restores_old_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.ROUTER, {"w": torch.zeros(2)}, {"v": 1}, {"router.onnx": b"old"})
    before = snapshot(artifact.path)

    def fail_commit(path: Path, manifest: object) -> None:
        raise KeyboardInterrupt

    # Fails after the new files were renamed into place: the rollback path.
    monkeypatch.setattr(artifacts.store, "write_manifest", fail_commit)
    with pytest.raises(KeyboardInterrupt):
        artifact.write_stage(
            Stage.ROUTER, {"w": torch.ones(2)}, {"v": 2}, {"router.onnx": b"new"}, force=True
        )
    assert snapshot(artifact.path) == before
    assert artifact.stage_params(Stage.ROUTER) == {"v": 1}
    assert Artifact.open(artifact.path).verify() == []


def test_bad_names_and_params_are_rejected_before_writing(art: Artifact) -> None:
    before = snapshot(art.path)
    with pytest.raises(ValueError, match="plain file name"):
        art.write_stage(Stage.ROUTER, {}, {}, {"../router.onnx": b"x"})
    with pytest.raises(ValueError, match="belongs to stage 'clusters'"):
        art.write_stage(Stage.ROUTER, {}, {}, {"clusters.safetensors": b"x"})
    with pytest.raises(ValueError, match="lower_snake_case"):
        art.write_stage("Router/x", {}, {})
    with pytest.raises(ValueError, match="plain JSON"):
        art.write_stage(Stage.ROUTER, {}, {"t": torch.ones(1)})
    assert snapshot(art.path) == before


def test_writes_through_another_handle_are_kept(art: Artifact) -> None:
    other = Artifact.open(art.path)
    other.write_stage(Stage.GP, {"basis": torch.eye(2)}, {"rank": 2})
    art.write_stage(Stage.ONEDECODE, {"table": torch.zeros(3, dtype=torch.int32)}, {})
    assert Artifact.open(art.path).stages == [Stage.CLUSTERS, Stage.GP, Stage.ONEDECODE]


def test_errors_are_one_line_artifact_errors(tmp_path: Path) -> None:
    err = NotAnArtifact(tmp_path, "line one\nline two")
    assert isinstance(err, ArtifactError) and "\n" not in str(err)


def test_artifacts_imports_no_runtime_prep_or_heavy_deps() -> None:
    code = (
        "import sys, artifacts; "
        "print([m for m in sys.modules if m.split('.')[0] in "
        "('runtime', 'prep', 'click', 'faiss', 'lightning', 'sklearn')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_describe_artifact(art: Artifact) -> None:
    from runtime.describe import describe_artifact

    report, valid = describe_artifact(art.path, make_model())
    assert valid and report.endswith("valid: yes")
    for expected in ("format_version: 2", VERSION, "tiny (llama, vocab 32, hidden 8)", "[clusters]",
                     '"metric": "cosine"', "clusters.safetensors: 0.00 MiB, checksum ok"):
        assert expected in report

    _, valid_for_other = describe_artifact(art.path, make_model(seed=3, name="other"))
    assert not valid_for_other

    (art.path / "clusters.safetensors").write_bytes(b"junk")
    report, valid = describe_artifact(art.path)
    assert not valid and "problem: stage 'clusters'" in report

    report, valid = describe_artifact(art.path / "nope")
    assert not valid and "not a specvocab artifact" in report
