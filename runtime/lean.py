"""Transitional aliases for runtime.backends (removed once every caller imports runtime.backends)."""

from runtime.backends.decoder import Projection, UnsupportedModel
from runtime.backends.lean import lean_target as LeanTarget
from runtime.backends.target import DecoderTarget

__all__ = ["DecoderTarget", "LeanTarget", "Projection", "UnsupportedModel"]
