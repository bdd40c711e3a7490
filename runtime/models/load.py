"""Load a resolved model: config, tokenizer and fingerprint, and the fp32 weights unless asked not to.

Weights are read from safetensors only (`use_safetensors=True`): transformers never unpickles a
`pytorch_model.bin`, whatever else the directory holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from artifacts.fingerprint import ModelInfo
from runtime.models.cache import read_provenance, update_provenance
from runtime.models.fingerprint import INFO_FIELDS, fingerprint_fields
from runtime.models.registry import ModelError, first_line
from runtime.models.resolve import ResolvedModel, resolve_model
from runtime.models.tokenizer import load_tokenizer


@dataclass
class LoadedModel:
    """A model ready to run: eval-mode weights (None if loaded with weights=False), tokenizer, config,
    fingerprint, its directory and, when the weights came from one, its .gguf file."""

    model: torch.nn.Module | None  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    info: ModelInfo
    path: Path
    config: Any = None  # a transformers PretrainedConfig
    gguf_path: Path | None = None


def load_model(spec: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               progress: bool = True, weights: bool = True) -> LoadedModel:
    """Resolve `spec`, load config and tokenizer, fingerprint them, and load the weights in eval mode.

    weights=False skips the fp32 weights (for the native GGUF backend, which reads `gguf_path`): the
    fingerprint then comes from the cache's provenance record, or from the head tensor alone.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    resolved = resolve_model(spec, progress=progress)
    hf_logging.disable_progress_bar()  # a cached safetensors load takes seconds: no bar needed
    config = _load(AutoConfig.from_pretrained, resolved.path)
    tokenizer = _load(load_tokenizer, resolved.path)  # from a JSON cache beside a cache entry (tokenizer.py)
    cached = _cached_fields(resolved.path)
    if not weights:
        fields = cached or _fields_from_files(resolved.path, config, tokenizer)
        return LoadedModel(None, tokenizer, _info(resolved, fields), resolved.path, config, resolved.gguf_path)
    # Load in float32 first so the fingerprint does not depend on `dtype`.
    model = _load(AutoModelForCausalLM.from_pretrained, resolved.path, dtype=torch.float32, use_safetensors=True)
    fields = fingerprint_fields(model.config.model_type, model.get_output_embeddings().weight, tokenizer)
    if cached is not None and cached != fields:
        raise ModelError(f"cached model {resolved.path} no longer matches the fingerprint recorded when it was converted; "
                         "delete that folder and run `prep import` again")
    if cached is None and read_provenance(resolved.path):
        update_provenance(resolved.path, model_info=fields)  # entries made before it was recorded
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model, tokenizer, _info(resolved, fields), resolved.path, model.config, resolved.gguf_path)


def model_info(model: torch.nn.Module, tokenizer: Any, resolved: ResolvedModel) -> ModelInfo:
    """Return the ModelInfo of a loaded model."""
    return _info(resolved, fingerprint_fields(model.config.model_type, model.get_output_embeddings().weight, tokenizer))


def _info(resolved: ResolvedModel, fields: dict[str, Any]) -> ModelInfo:
    return ModelInfo(name=resolved.name, source=resolved.source, **fields)


def _cached_fields(path: Path) -> dict[str, Any] | None:
    """The fingerprint fields recorded in a cache entry's provenance, or None."""
    fields = read_provenance(path).get("model_info")
    if isinstance(fields, dict) and set(fields) == set(INFO_FIELDS):
        return fields
    return None


def _fields_from_files(path: Path, config: Any, tokenizer: Any) -> dict[str, Any]:
    """Fingerprint a model directory reading only its LM-head tensor from the safetensors files."""
    import safetensors
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # parameter names and tying only; no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    head = skeleton.get_output_embeddings().weight
    names = {name for name, p in skeleton.named_parameters(remove_duplicate=False) if p is head}
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                found = names & set(f.keys())
                if found:
                    return fingerprint_fields(config.model_type, f.get_tensor(sorted(found)[0]), tokenizer)
        except (safetensors.SafetensorError, OSError) as e:
            raise ModelError(f"{file} cannot be read ({e}); restore it, or re-save the model with save_pretrained") from None
    raise ModelError(f"{path} holds no LM-head tensor ({', '.join(sorted(names))}); re-save the model with save_pretrained")


def _load(loader: Callable[..., Any], path: Path, **kwargs: Any) -> Any:
    """Call a transformers loader; a damaged or unsupported directory is a one-line ModelError."""
    import safetensors

    try:
        return loader(path, **kwargs)
    except (OSError, ValueError, KeyError, safetensors.SafetensorError) as e:
        raise ModelError(f"cannot load {path} ({first_line(e)}); check the directory, or re-save the model with "
                         "save_pretrained(safe_serialization=True)") from None
