"""Transitional aliases for runtime.backends (removed once every caller imports runtime.backends)."""

from runtime.backends import BACKENDS, SUPPORTED_TYPES


def make_target(model, eos_token_ids, backend: str = "auto"):
    """A lean or transformers TargetModel over an fp32 transformers model (old signature)."""
    from runtime.backends import choose_backend, make_target as make

    chosen = choose_backend("lean" if backend in ("auto", "native") and model.config.model_type in SUPPORTED_TYPES else backend, None, model.config)
    return make(chosen, config=model.config, eos_token_ids=eos_token_ids, model=model)


def backend_name(target) -> str:
    return target.name


__all__ = ["BACKENDS", "backend_name", "make_target"]
