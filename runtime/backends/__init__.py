"""Decoding backends (TargetModel implementations) and the choice between them.

- `native`: the decoder ladder over the GGUF file's own blocks (no fp32 copy; bit-identical to lean);
- `lean`: the same ladder over fp32 weights (gemma3, qwen2, llama);
- `transformers`: transformers' forward (any architecture it knows; the reference).

`auto` picks native whenever the model comes from a GGUF whose architecture and tensor types the
ladder and kernels know, lean for other supported architectures (an HF directory), transformers
otherwise.
"""

from __future__ import annotations

from pathlib import Path

from runtime.backends.base import KVCache, TargetModel, eos_ids
from runtime.backends.layers import SUPPORTED_TYPES, UnsupportedModel, check_supported

BACKENDS = ("auto", "native", "lean", "transformers")


def native_unsupported(gguf_path: Path | None, config) -> str | None:
    """Why the native backend cannot run this model (one line naming the fix), or None if it can."""
    if gguf_path is None:
        return "the native backend reads a .gguf file and this model has none (an HF directory); use --backend lean"
    try:
        check_supported(config)
        from runtime.backends.native import open_gguf

        open_gguf(gguf_path)
    except UnsupportedModel as exc:
        return str(exc)
    return None


def choose_backend(backend: str, gguf_path: Path | None, config) -> str:
    """The backend `backend` resolves to for this model; UnsupportedModel when it cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "native":
        reason = native_unsupported(gguf_path, config)
        if reason:
            raise UnsupportedModel(reason)
        return backend
    if backend == "lean":
        check_supported(config)
        return backend
    if backend == "auto":
        if native_unsupported(gguf_path, config) is None:
            return "native"
        return "lean" if config.model_type in SUPPORTED_TYPES else "transformers"
    return backend


def make_target(backend: str, *, config, eos_token_ids, model=None, gguf_path: Path | None = None) -> TargetModel:
    """A TargetModel of the chosen backend: `model` (fp32 transformers) for lean / transformers, `gguf_path` for native."""
    if backend == "native":
        from runtime.backends.native import native_target

        return native_target(gguf_path, config, eos_token_ids)
    if model is None:
        raise ValueError(f"the {backend} backend needs the fp32 model")
    if backend == "lean":
        from runtime.backends.lean import lean_target

        return lean_target(model, eos_token_ids)
    from runtime.backends.hf import TransformersTarget

    return TransformersTarget(model, eos_token_ids)


__all__ = [
    "BACKENDS", "SUPPORTED_TYPES", "KVCache", "TargetModel", "UnsupportedModel", "choose_backend", "eos_ids", "load_target",
    "make_target", "native_unsupported", "reload_target",
]


def load_target(spec: str, backend: str = "auto", progress: bool = True, chat: bool = False):
    """Load model `spec` for `backend` (auto | native | lean | transformers): (LoadedModel, TargetModel).

    The native backend reads the GGUF's blocks, so the fp32 weights are not loaded for it.
    chat: refuse a model without a chat template before anything of it loads.
    """
    from transformers import AutoConfig

    from runtime.models import load_model, resolve_model
    from runtime.models.cache import read_config
    from runtime.models.tokenizer import NO_CHAT_TEMPLATE, has_chat_template

    resolved = resolve_model(spec, progress=progress)
    read_config(resolved.path)  # a one-line ModelError for a missing or damaged config.json
    if chat and not has_chat_template(resolved.path):
        raise ValueError(f"{resolved.name} {NO_CHAT_TEMPLATE}")
    chosen = choose_backend(backend, resolved.gguf_path, AutoConfig.from_pretrained(resolved.path))
    loaded = load_model(spec, progress=False, weights=chosen != "native")
    target = make_target(chosen, config=loaded.config, eos_token_ids=loaded_eos_ids(loaded), model=loaded.model,
                         gguf_path=loaded.gguf_path)
    return loaded, target


def loaded_eos_ids(loaded) -> set[int]:
    """The end-of-sequence ids of a loaded model (runtime.models.load_model): its config's, its generation
    config's (absent without fp32 weights) and its tokenizer's."""
    return eos_ids(loaded.config, getattr(loaded.model, "generation_config", None), loaded.tokenizer)


def reload_target(loaded, backend: str, eos_token_ids) -> TargetModel:
    """The already loaded model `loaded` on another backend (its fp32 weights are read if that backend needs them)."""
    from runtime.models import load_model

    chosen = choose_backend(backend, loaded.gguf_path, loaded.config)
    model = loaded.model
    if chosen != "native" and model is None:
        model = load_model(str(loaded.path), progress=False).model
    return make_target(chosen, config=loaded.config, eos_token_ids=eos_token_ids, model=model, gguf_path=loaded.gguf_path)
