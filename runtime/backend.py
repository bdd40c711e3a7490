"""Choose a decoding backend by name: the lean forward where supported, else transformers'."""

from __future__ import annotations

import torch

from runtime.lean import LeanTarget, UnsupportedModel
from runtime.target import TorchTarget

BACKENDS = ("auto", "lean", "transformers")


def make_target(model: torch.nn.Module, eos_token_ids: set[int], backend: str = "auto") -> TorchTarget:
    """A TargetModel over `model`: lean, transformers, or auto (lean where the architecture is supported)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "transformers":
        return TorchTarget(model, eos_token_ids)
    try:
        return LeanTarget(model, eos_token_ids)
    except UnsupportedModel:
        if backend == "lean":
            raise
        return TorchTarget(model, eos_token_ids)


def backend_name(target: TorchTarget) -> str:
    """The name a report shows for the backend a target runs on."""
    return "lean" if isinstance(target, LeanTarget) else "transformers"
