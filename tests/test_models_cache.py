"""The conversion cache: a GGUF is converted once, published atomically, its fingerprint recorded; leftovers and damage."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from artifacts.fingerprint import ModelSource
from factories import save_tiny_model_dir
from runtime.models import ModelError, load_model, resolve, resolve_model

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest: never the user's model cache


@pytest.fixture
def toy_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in .gguf file (b"GGUF toy") that the structure check lets through."""
    monkeypatch.setattr(resolve, "check_gguf", lambda path: None)
    gguf = tmp_path / "toy.gguf"
    gguf.write_bytes(b"GGUF toy")
    return gguf


def _fake_convert(fail: bool):
    """Return a stand-in for resolve._convert that writes a model dir, or dies halfway."""
    calls = []

    def convert(gguf: Path, out: Path, log) -> dict:
        calls.append(gguf)
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "llama"}')
        if fail:
            raise RuntimeError("interrupted")  # an import that dies mid-write
        (out / "model.safetensors").write_bytes(b"")
        return {}

    return convert, calls


def test_gguf_conversion_is_cached_once_and_published_atomically(tmp_path: Path, toy_gguf: Path, private_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    digest = hashlib.sha256(b"GGUF toy").hexdigest()
    models = private_cache / "models"

    monkeypatch.setattr(resolve, "_convert", _fake_convert(fail=True)[0])
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model(str(toy_gguf), progress=False)
    assert list(models.iterdir()) == []  # nothing half-written survives

    convert, calls = _fake_convert(fail=False)
    monkeypatch.setattr(resolve, "_convert", convert)
    first = resolve_model(str(toy_gguf), progress=False)
    again = resolve_model(str(toy_gguf), progress=False)
    assert first == again and len(calls) == 1
    assert first.path == models / f"toy-{digest[:12]}"
    assert first.source == ModelSource("gguf", path=str(toy_gguf), gguf_sha256=digest)
    assert first.gguf_path == toy_gguf  # the native backend reads the user's own file
    assert sorted(p.name for p in models.iterdir()) == [first.path.name]
    # Resolving the cached directory itself still reports where it came from.
    assert resolve_model(str(first.path)).source == first.source


@pytest.mark.parametrize("writer", ["safetensors", "plain"])
def test_a_full_disk_during_a_conversion_names_the_cache_and_the_fix(toy_gguf: Path, private_cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch, writer: str):
    """A full disk while the weights (safetensors' own error) or the assembled .gguf (an OSError) are written: one
    ModelError naming the cache folder and $SPECVOCAB_CACHE, and nothing half-written is kept."""
    import errno

    import safetensors

    def convert(gguf: Path, out: Path, log) -> dict:
        out.mkdir()
        if writer == "plain":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "model.gguf"))
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(resolve, "_convert", convert)
    models = private_cache / "models"
    with pytest.raises(ModelError, match=rf"cannot write the model cache {models} \(No space left on device\); free space "
                                         "there or set SPECVOCAB_CACHE to a folder with room"):
        resolve_model(str(toy_gguf), progress=False)
    assert list(models.iterdir()) == []


def test_a_full_disk_while_an_older_entry_gets_its_gguf_names_the_fix(private_cache: Path, monkeypatch: pytest.MonkeyPatch):
    """An entry made before the .gguf was kept is given it later: no room there is the same one line."""
    import errno

    from runtime.models import registry

    def disk_full(model, chunks, tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    entry = private_cache / "models" / "smollm2-135m-instruct"
    entry.mkdir(parents=True)
    monkeypatch.setattr(resolve, "is_cached", lambda target: True)
    monkeypatch.setattr(registry, "ensure_installed", lambda model, log: [])
    monkeypatch.setattr(registry, "assemble", disk_full)
    with pytest.raises(ModelError, match=rf"cannot write the model cache {entry} \(No space left on device\); free space "
                                         "there or set SPECVOCAB_CACHE"):
        resolve_model("smollm2-135m-instruct", progress=False)
    assert list(entry.iterdir()) == []


def test_leftovers_of_killed_imports_are_removed(tmp_path: Path, toy_gguf: Path, private_cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    models = private_cache / "models"
    stale_name = f"toy-{hashlib.sha256(b'GGUF toy').hexdigest()[:12]}"
    # Pid 2**22 + 1 is above Linux's pid_max, so no such process can exist.
    stale = models / f".tmp-{2**22 + 1}-{stale_name}-abc"
    live = models / f".tmp-{os.getpid()}-{stale_name}-abc"
    stale.mkdir(parents=True)
    live.mkdir()
    monkeypatch.setattr(resolve, "_convert", _fake_convert(fail=False)[0])
    resolve_model(str(toy_gguf), progress=False)
    assert not stale.exists() and live.exists()


def test_progress_goes_to_stderr(tmp_path: Path, toy_gguf: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(resolve, "_convert", _fake_convert(fail=False)[0])
    resolve_model(str(toy_gguf))
    out, err = capsys.readouterr()
    assert out == "" and "[specvocab] toy.gguf: hashing toy.gguf: done in" in err


def test_a_damaged_cache_entry_says_to_delete_it(tmp_path: Path, toy_gguf: Path, private_cache: Path):
    damaged = private_cache / "models" / f"toy-{hashlib.sha256(b'GGUF toy').hexdigest()[:12]}"
    damaged.mkdir(parents=True)
    (damaged / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelError, match=f"{damaged} is incomplete; delete"):
        resolve_model(str(toy_gguf), progress=False)


def test_a_conversion_records_its_fingerprint_and_a_weights_free_load_uses_it(tmp_path: Path, toy_gguf: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """The native backend's load: config + tokenizer + fingerprint + .gguf, no fp32 weights read."""
    tiny = save_tiny_model_dir(tmp_path / "tiny")

    def convert(src: Path, out: Path, log) -> dict:
        import shutil

        shutil.copytree(tiny, out)
        return {"architecture": "llama", "vocab_size": 128, "hidden_size": 32, "lm_head_sha256": "a" * 64,
                "vocab_sha256": "b" * 64}

    monkeypatch.setattr(resolve, "_convert", convert)
    light = load_model(str(toy_gguf), weights=False, progress=False)
    assert light.model is None and light.gguf_path == toy_gguf
    assert (light.info.lm_head_sha256, light.info.vocab_sha256) == ("a" * 64, "b" * 64)
    # The full load recomputes the fingerprint, and a recorded one that differs means damage.
    with pytest.raises(ModelError, match="no longer matches the fingerprint.*prep import"):
        load_model(str(toy_gguf), progress=False)
