"""Tests of the artifact format: round trips, checksums, model identity, versions, schema checks."""

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

from artifact_factories import CLUSTER_PARAMS, VERSION, cluster_tensors, make_model, stage_data
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
    SchemaMismatch,
    Stage,
    UnknownFormatVersion,
    same_model,
    tensor_sha256,
    vocab_sha256,
)


def test_round_trip_tensors_params_and_extra_files(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    tensors, params, _ = stage_data(Stage.ROUTER, hidden=[16, 8], lr=1e-3)
    tensors["router.net.0.weight"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    onnx = b"\x08\x07fake onnx bytes"
    artifact.write_stage(Stage.ROUTER, tensors, params, {"router.onnx": onnx})

    reopened = Artifact.open(tmp_path / "art")
    loaded = reopened.read_stage(Stage.ROUTER)
    assert set(loaded) == set(tensors)
    for key, t in tensors.items():
        assert loaded[key].dtype == t.dtype and loaded[key].device.type == "cpu"
        assert loaded[key].is_contiguous()
        assert torch.equal(loaded[key], t)
    assert reopened.stage_params(Stage.ROUTER) == params
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
    assert stage["params"] == CLUSTER_PARAMS
    created = datetime.fromisoformat(stage["created_at"])
    assert created.utcoffset() == timedelta(0)
    file_bytes = (art.path / "clusters.safetensors").read_bytes()
    assert stage["files"] == {
        "clusters.safetensors": {"sha256": hashlib.sha256(file_bytes).hexdigest(), "size": len(file_bytes)}
    }


def test_nothing_is_pickled(tmp_path: Path) -> None:
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.CLUSTERS, cluster_tensors(), CLUSTER_PARAMS)
    tensors, params, extra = stage_data(Stage.ROUTER)
    artifact.write_stage(Stage.ROUTER, tensors, params, extra)
    names = sorted(p.name for p in artifact.path.iterdir())
    assert names == ["clusters.safetensors", MANIFEST_FILE, "router.onnx", "router.safetensors"]
    assert not [p for p in artifact.path.rglob("*") if p.suffix in (".pt", ".pth", ".pkl", ".bin")]
    # Readable by the plain safetensors loader, which cannot unpickle anything.
    plain = safetensors.torch.load_file(artifact.path / "router.safetensors")
    assert torch.equal(plain["token_counts"], tensors["token_counts"])


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
    artifact.write_stage(Stage.ROUTER, *stage_data(Stage.ROUTER))
    (artifact.path / "router.onnx").write_bytes(b"router.onnx 9")  # same size, other bytes
    with pytest.raises(ChecksumMismatch, match="router.onnx fails its sha256"):
        artifact.stage_file(Stage.ROUTER, "router.onnx")
    with pytest.raises(ChecksumMismatch):
        artifact.read_stage(Stage.ROUTER)


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


def edit_manifest(art: Artifact, edit) -> None:
    """Rewrite the artifact's manifest.json after edit(data) changes its parsed JSON in place."""
    manifest = art.path / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("version", [3, 0])
def test_unknown_format_version(art: Artifact, version: object) -> None:
    edit_manifest(art, lambda data: data.update(format_version=version))
    with pytest.raises(UnknownFormatVersion, match="upgrade specvocab or rebuild"):
        Artifact.open(art.path)


@pytest.mark.parametrize("version", ["1", True, 2.0])
def test_a_format_version_that_is_no_integer_is_damage(art: Artifact, version: object) -> None:
    """No specvocab writes one: the file was damaged or edited, and a newer specvocab would not help."""
    edit_manifest(art, lambda data: data.update(format_version=version))
    with pytest.raises(NotAnArtifact, match=f"format_version {version!r}, not an integer") as caught:
        Artifact.open(art.path)
    assert "upgrade" not in str(caught.value)


@pytest.mark.parametrize("field, value", [("vocab_size", -1), ("hidden_size", 0)])
def test_a_model_size_below_one_is_damage(art: Artifact, field: str, value: int) -> None:
    edit_manifest(art, lambda data: data["model"].update({field: value}))
    with pytest.raises(NotAnArtifact, match=f"field '{field}' should be a size >= 1, got {value}"):
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
    with pytest.raises(NotAnArtifact, match="malformed.*NEWDIR"):
        Artifact.open(tmp_path)
    with pytest.raises(NotAnArtifact, match="check the path"):
        Artifact.open(tmp_path / "missing.gguf")  # no such file: not taken for a model file
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(NotAnArtifact, match=r"build an artifact from it with `prep all .*model\.gguf -o ART`"):
        Artifact.open(tmp_path / "model.gguf")  # the model file given where its artifact goes


def test_manifest_with_unsafe_file_name_is_rejected(art: Artifact) -> None:
    edit_manifest(art, lambda data: data["stages"]["clusters"]["files"].update({"../escape": {"sha256": "0" * 64, "size": 1}}))
    with pytest.raises(NotAnArtifact, match="not a plain file name"):
        Artifact.open(art.path)


def test_missing_stage_names_the_prep_command(art: Artifact) -> None:
    with pytest.raises(MissingStage, match=r"no 'router' stage; run `prep train-router .*art --traces"):
        art.read_stage(Stage.ROUTER)
    with pytest.raises(MissingStage):
        art.stage_params(Stage.GP)
    with pytest.raises(MissingStage, match="no file 'router.onnx'"):
        art.stage_file(Stage.CLUSTERS, "router.onnx")


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
    from runtime.cli.describe import describe_artifact

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


def _rewrite_record(art: Artifact, stage: str, filename: str) -> None:
    """Make the manifest's record of one file match the file's current bytes (a tamper that passes checksums)."""
    payload = (art.path / filename).read_bytes()
    record = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    edit_manifest(art, lambda data: data["stages"][stage]["files"].update({filename: record}))


def test_a_stage_holding_another_stages_file_is_a_schema_error(art: Artifact) -> None:
    art.write_stage(Stage.SCREEN, *stage_data(Stage.SCREEN)[:2])
    (art.path / "screen.safetensors").write_bytes((art.path / "clusters.safetensors").read_bytes())
    _rewrite_record(art, Stage.SCREEN, "screen.safetensors")
    with pytest.raises(SchemaMismatch, match=r"lacks tensor\(s\) qweight.*holds stage 'clusters'.*--force"):
        Artifact.open(art.path).read_stage(Stage.SCREEN)
    from runtime.cli.describe import describe_artifact

    report, valid = describe_artifact(art.path)  # its checksum passes, so only reading it finds the problem
    assert not valid and "screen.safetensors: 0.00 MiB, checksum ok" in report
    assert "contents: cannot be used" in report and "problem: " in report and "holds stage 'clusters'" in report

    (art.path / "screen.safetensors").write_bytes(b"\xff" * 64)  # not safetensors at all
    _rewrite_record(art, Stage.SCREEN, "screen.safetensors")
    report, valid = describe_artifact(art.path)
    assert not valid and "screen.safetensors cannot be read" in report

    # a stage this version declares no schema for
    edit_manifest(art, lambda data: data["stages"].update(later={**data["stages"]["clusters"], "files": {}}))
    (art.path / "later.safetensors").write_bytes((art.path / "clusters.safetensors").read_bytes())
    _rewrite_record(art, "later", "later.safetensors")
    report, _ = describe_artifact(art.path)  # reported, not read as tensors (the runtime never reads it)
    assert "[later]" in report and "later.safetensors: 0.00 MiB, checksum ok" in report


def test_the_loaded_file_is_always_verified(art: Artifact) -> None:
    """Emptying a stage's `files` does not skip the checksum: an unlisted file is refused."""
    data = json.loads((art.path / MANIFEST_FILE).read_text())
    data["stages"]["clusters"]["files"] = {}
    (art.path / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ChecksumMismatch, match="records no checksum for clusters.safetensors"):
        Artifact.open(art.path).read_stage(Stage.CLUSTERS)


def test_a_wrong_shape_for_this_model_is_a_schema_error(tmp_path: Path) -> None:
    art = Artifact.create(tmp_path / "art", make_model(), VERSION)
    tensors, params, _ = stage_data(Stage.SCREEN)
    art.write_stage(Stage.SCREEN, tensors, params)
    bad = {**tensors, "row_norms": torch.zeros(31)}
    safetensors.torch.save_file(bad, str(art.path / "screen.safetensors"))
    _rewrite_record(art, Stage.SCREEN, "screen.safetensors")
    with pytest.raises(SchemaMismatch, match=r"'row_norms' has shape \[31\], expected \[V\] with V=32"):
        Artifact.open(art.path).read_stage(Stage.SCREEN)
