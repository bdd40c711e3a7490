"""Model resolution and loading: packaged names, Hugging Face directories, .gguf files."""

from runtime.models.cache import cache_root
from runtime.models.load import LoadedModel, load_model
from runtime.models.registry import DEFAULT_MODEL, PACKAGED, ModelError, PackagedModel
from runtime.models.resolve import ModelLog, ResolvedModel, resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "PACKAGED",
    "LoadedModel",
    "ModelLog",
    "ModelError",
    "PackagedModel",
    "ResolvedModel",
    "cache_root",
    "load_model",
    "resolve_model",
]
