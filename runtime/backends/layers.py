"""What the decoder ladder holds per layer: projections, norms and attention settings.

The lean backend fills these from a transformers model's fp32 weights, the native backend from a
GGUF file's blocks; runtime.backends.decoder runs them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from runtime.kernels import QuantMatrix, layer_plan, linear, rms_norm, streams
from runtime.kernels.build import active

SUPPORTED_TYPES = ("gemma3_text", "qwen2", "llama")
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the DecoderLayer fields a drafter may transform


class UnsupportedModel(ValueError):
    """The decoder ladder does not implement this architecture."""


class KernelProjection:
    """A projection the skinny kernel computes for a few rows: block (or fp32) matrices side by side, then a bias."""

    def kernel_parts(self) -> tuple[list[QuantMatrix], torch.Tensor | None] | None:
        """(matrices, bias [out] or None) that give this projection's bits for up to SKINNY_MAX_ROWS rows, or None."""
        raise NotImplementedError


@dataclass
class Projection(KernelProjection):
    """y = x W^T + b through runtime.kernels.linear (W: fp32 [out, in] or a QuantMatrix)."""

    weight: object  # [out, in]
    bias: torch.Tensor | None = None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # [T, out]

    def dense(self) -> torch.Tensor:
        """The fp32 weight [out, in] (what a drafter's int8 or low-rank copy is made from)."""
        return self.weight

    def kernel_parts(self) -> tuple[list[QuantMatrix], torch.Tensor | None] | None:
        """The weight as one matrix (an fp32 one viewed as F32 rows): what linear() streams, when it does."""
        w = self.weight
        if isinstance(w, QuantMatrix):
            return [w], self.bias
        if not streams(w):
            return None  # linear() takes torch's GEMM for it
        return [QuantMatrix(w.view(torch.uint8), GGMLQuantizationType.F32, w.shape[0], w.shape[1])], self.bias


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
    # The compiled one-call layer (layer_plan): None until first asked for, False where there is none.
    compiled: object = field(default=None, init=False, repr=False, compare=False)

    def plan(self, heads: int, kv_heads: int, head_dim: int):
        """This layer as one compiled call (runtime/kernels/csrc/layer_plan.h) over up to SKINNY_MAX_ROWS rows,
        or None: no compiled kernels, or a projection or activation it does not compute (a drafter's
        int8 or low-rank projections take the step-by-step path)."""
        if self.compiled is None:
            self.compiled = _layer_plan(self, heads, kv_heads, head_dim) or False
        return self.compiled or None


def activation_kind(module: torch.nn.Module) -> str | None:
    """'silu' or 'gelu_tanh' when the module computes exactly F.silu / F.gelu(approximate='tanh'), else None."""
    if isinstance(module, torch.nn.SiLU) or type(module).__qualname__ == "SiLUActivation":
        return "silu"
    act = getattr(module, "act", None)
    if isinstance(act, functools.partial) and act.func is torch.nn.functional.gelu and act.keywords == {"approximate": "tanh"}:
        return "gelu_tanh"
    return None


def _layer_plan(layer: DecoderLayer, heads: int, kv_heads: int, head_dim: int):
    kind = activation_kind(layer.activation)
    projections = [getattr(layer, name) for name in PROJECTIONS]
    if active()[1] is None or kind is None or not all(isinstance(p, KernelProjection) for p in projections):
        return None
    parts = [p.kernel_parts() for p in projections]
    if any(part is None for part in parts):
        return None
    norms = [layer.input_norm, layer.q_norm, layer.k_norm, layer.post_attention_norm, layer.pre_mlp_norm, layer.post_mlp_norm]
    return layer_plan([(n.factor, n.eps) if n is not None else None for n in norms], parts, heads, kv_heads, head_dim,
                      layer.scaling, kind)


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
