"""What the decoder ladder holds per layer: projections, norms and attention settings.

The lean backend fills these from a transformers model's fp32 weights, the native backend from a
GGUF file's blocks; runtime.backends.decoder runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.kernels import linear, rms_norm

SUPPORTED_TYPES = ("gemma3_text", "qwen2", "llama")
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the DecoderLayer fields a drafter may transform


class UnsupportedModel(ValueError):
    """The decoder ladder does not implement this architecture."""


@dataclass
class Projection:
    """y = x W^T + b through runtime.kernels.linear (W: fp32 [out, in] or a QuantMatrix)."""

    weight: object  # [out, in]
    bias: torch.Tensor | None = None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # [T, out]

    def dense(self) -> torch.Tensor:
        """The fp32 weight [out, in] (what a drafter's int8 or low-rank copy is made from)."""
        return self.weight


@dataclass
class RMSNorm:
    """transformers' RMSNorm, (x * rsqrt(mean(x²) + eps)) * factor, as one fixed-order kernel."""

    factor: torch.Tensor  # [d]: the weight (llama, qwen2) or 1 + weight (gemma3)
    eps: float

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float, gemma: bool) -> "RMSNorm":
        """From a norm's stored weight [d] (gemma3 scales by 1 + weight, as its module computes it)."""
        weight = weight.detach().float()
        return cls(1.0 + weight if gemma else weight.clone(), float(eps))

    @classmethod
    def of_module(cls, module: torch.nn.Module, gemma: bool, weight: torch.Tensor | None = None) -> "RMSNorm":
        """From a transformers RMSNorm module (Gemma3RMSNorm, LlamaRMSNorm, Qwen2RMSNorm): its eps,
        and its weight unless `weight` is given (a meta-device module's, read from a file)."""
        eps = getattr(module, "eps", None)
        return cls.of(module.weight if weight is None else weight, module.variance_epsilon if eps is None else eps, gemma)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.factor, self.eps)  # [..., d]


@dataclass
class DecoderLayer:
    """One decoder layer's projections and modules, arranged for the ladder."""

    input_norm: RMSNorm
    # Projections: callables [T, in] -> [T, out] with `.bias` and `.dense()` (the fp32 weight).
    qkv: Callable  # d -> (H + 2 KV) hd
    q_norm: RMSNorm | None  # per-head RMSNorm over hd (gemma3)
    k_norm: RMSNorm | None
    o: Callable  # H hd -> d
    post_attention_norm: RMSNorm | None  # gemma3: normalizes the attention output
    pre_mlp_norm: RMSNorm
    post_mlp_norm: RMSNorm | None  # gemma3: normalizes the MLP output
    gate_up: Callable  # d -> 2 F
    down: Callable  # F -> d
    activation: torch.nn.Module
    scaling: float
    window: int | None  # sliding-window length, None for full attention
    rope: str  # key into the rotary tables


def layer_type(config, index: int) -> str:
    """The attention kind of decoder layer `index` (sliding_attention / full_attention)."""
    types = getattr(config, "layer_types", None)
    return types[index] if types else "full_attention"


def check_supported(config) -> None:
    """UnsupportedModel unless the ladder implements this configuration."""
    if config.model_type not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"the lean and native backends support {', '.join(SUPPORTED_TYPES)}, not {config.model_type!r}; "
            "use --backend transformers"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModel("attention logit soft-capping is not supported by the lean backend; use --backend transformers")
    if getattr(config, "final_logit_softcapping", None):
        raise UnsupportedModel("final logit soft-capping is not supported (gemma2); use gemma3, qwen2 or llama")
