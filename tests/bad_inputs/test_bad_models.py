"""Bad model arguments to `prep import` / `prep cluster`: one line naming the fix, cache untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bad_helpers import TINY_CLUSTERS, prep_fails


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def test_unknown_packaged_name(private_cache: Path):
    prep_fails(["import", "gemma9-1t"], "unknown model 'gemma9-1t'", "gemma3-270m", unchanged=(private_cache,))


def test_missing_gguf_file(tmp_path: Path, private_cache: Path):
    prep_fails(["import", tmp_path / "nope.gguf"], "does not exist", "check the path", unchanged=(private_cache,))


def test_truncated_gguf(tmp_path: Path, private_cache: Path):
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00\x02\x00")
    prep_fails(["import", gguf], "not a readable GGUF", "copy or download it again", unchanged=(private_cache, tmp_path))


def test_a_zip_named_gguf(tmp_path: Path, private_cache: Path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    prep_fails(["import", gguf], "GGUF magic", unchanged=(private_cache, tmp_path))


def test_a_text_file(tmp_path: Path, private_cache: Path):
    (tmp_path / "notes.txt").write_text("hello")
    prep_fails(["import", tmp_path / "notes.txt"], "neither a model directory", unchanged=(private_cache, tmp_path))


def test_a_directory_without_config(tmp_path: Path, private_cache: Path):
    (tmp_path / "empty").mkdir()
    prep_fails(["import", tmp_path / "empty"], "no config.json", unchanged=(private_cache, tmp_path))


def test_truncated_config_json_in_import(model_copy: Path, private_cache: Path):
    text = (model_copy / "config.json").read_text()
    (model_copy / "config.json").write_text(text[: len(text) // 3])
    prep_fails(["import", model_copy], "damaged or truncated", "re-save", unchanged=(private_cache, model_copy))


def test_truncated_config_json_in_cluster(model_copy: Path, tmp_path: Path, private_cache: Path):
    text = (model_copy / "config.json").read_text()
    (model_copy / "config.json").write_text(text[:10])
    prep_fails(["cluster", model_copy, "-o", tmp_path / "out", *TINY_CLUSTERS], "damaged or truncated",
               unchanged=(private_cache, model_copy))
    assert not (tmp_path / "out").exists()  # the -o made for the run is gone again


def test_config_without_model_type(model_copy: Path, private_cache: Path):
    (model_copy / "config.json").write_text(json.dumps({"hidden_size": 64}))
    prep_fails(["import", model_copy], "has no model_type", unchanged=(private_cache, model_copy))


def test_no_safetensors(model_copy: Path, private_cache: Path):
    (model_copy / "model.safetensors").unlink()
    prep_fails(["import", model_copy], "no *.safetensors", "safe_serialization=True", unchanged=(private_cache, model_copy))


def test_a_pickle_beside_a_dummy_safetensors_is_never_unpickled(model_copy: Path, tmp_path: Path, private_cache: Path):
    (model_copy / "model.safetensors").rename(model_copy / "dummy.safetensors")
    torch.save({"payload": 1}, model_copy / "pytorch_model.bin")
    prep_fails(["cluster", model_copy, "-o", tmp_path / "out", *TINY_CLUSTERS], "cannot load", "safe_serialization=True",
               unchanged=(private_cache, model_copy))


def test_truncated_weights(model_copy: Path, tmp_path: Path, private_cache: Path):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    prep_fails(["cluster", model_copy, "-o", tmp_path / "out", *TINY_CLUSTERS], "cannot load",
               unchanged=(private_cache, model_copy))
