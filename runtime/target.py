"""Transitional aliases for runtime.backends (removed once every caller imports runtime.backends)."""

from runtime.backends.base import TargetModel
from runtime.backends.hf import TransformersCache as TorchCache
from runtime.backends.hf import TransformersTarget as TorchTarget
from runtime.backends.lean import model_eos_ids as eos_ids

__all__ = ["TargetModel", "TorchCache", "TorchTarget", "eos_ids"]
