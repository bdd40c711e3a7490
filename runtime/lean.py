"""LeanTarget: a hand-written decoder forward over a transformers model's own weights.

transformers' forward spends ~15 ms of a gemma3-270m step on mask building, cache bookkeeping
and dispatch, and a forward over n new tokens grows much faster than its weight traffic. This
backend runs the same arithmetic as a ladder of plain tensor ops: fused q/k/v and gate/up
weights, one preallocated KV buffer per layer (rollback = lowering the length), rotary tables
computed once by the model's own rotary module, and SDPA with an explicit mask only when one is
needed. Norms and activations are the model's own modules, so the numerics match transformers
up to matmul accumulation order (checked in tests/test_lean.py).

Supported: gemma3 (text), qwen2 and llama decoders; anything else raises UnsupportedModel and
`open_session(backend="auto")` falls back to the transformers backend.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.kernels import linear
from runtime.target import TorchTarget

SUPPORTED_TYPES = ("gemma3_text", "qwen2", "llama")
_INITIAL_CAPACITY = 512


class UnsupportedModel(ValueError):
    """The lean backend does not implement this architecture."""


@dataclass
class Projection:
    """y = x W^T + b through the skinny kernel (runtime.kernels.linear)."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # [T, out]


@dataclass
class LeanLayer:
    """One decoder layer's weights and modules, arranged for the lean forward."""

    input_norm: torch.nn.Module
    qkv: Projection  # d -> (H + 2 KV) hd
    q_norm: torch.nn.Module | None  # per-head RMSNorm (gemma3)
    k_norm: torch.nn.Module | None
    o: Projection  # H hd -> d
    post_attention_norm: torch.nn.Module | None  # gemma3: normalizes the attention output
    pre_mlp_norm: torch.nn.Module
    post_mlp_norm: torch.nn.Module | None  # gemma3: normalizes the MLP output
    gate_up: Projection  # d -> 2 F
    down: Projection  # F -> d
    activation: torch.nn.Module
    scaling: float
    window: int | None  # sliding-window length, None for full attention
    rope: str  # key into LeanTarget's rotary tables


class LeanCache:
    """Preallocated per-layer K/V buffers [KV, capacity, hd]; `length` tokens are valid."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = _INITIAL_CAPACITY):
        self.keys = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.length = 0

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, length: int) -> None:
        """Grow every buffer (doubling) so that `length` tokens fit."""
        if length <= self.capacity:
            return
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(old.shape[0], capacity, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                buffers[i] = new


def _layer_type(config, index: int) -> str:
    types = getattr(config, "layer_types", None)
    return types[index] if types else "full_attention"


def _lean_layer(layer: torch.nn.Module, config, index: int, gemma: bool) -> LeanLayer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    biases = [p.bias for p in projections]
    qkv_bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if qkv_bias is None and any(b is not None for b in biases):
        raise UnsupportedModel("q/k/v projections with partial biases are not supported by the lean backend")
    layer_type = _layer_type(config, index)
    window = getattr(attn, "sliding_window", None) if layer_type == "sliding_attention" else None
    return LeanLayer(
        input_norm=layer.input_layernorm,
        qkv=Projection(torch.cat([p.weight.detach() for p in projections]).contiguous(), qkv_bias),
        q_norm=getattr(attn, "q_norm", None),
        k_norm=getattr(attn, "k_norm", None),
        o=Projection(attn.o_proj.weight.detach(), attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None),
        post_attention_norm=layer.post_attention_layernorm if gemma else None,
        pre_mlp_norm=layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
        post_mlp_norm=layer.post_feedforward_layernorm if gemma else None,
        gate_up=Projection(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous()),
        down=Projection(mlp.down_proj.weight.detach()),
        activation=mlp.act_fn,
        scaling=float(attn.scaling),
        window=int(window) if window else None,
        rope=layer_type,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attention_mask(start: int, queries: int, keys_from: int, keys_to: int, window: int | None) -> torch.Tensor | None:
    """Boolean mask [queries, keys] for queries at positions start.. over keys keys_from..keys_to-1.

    None when every query may see every key (one query and no window cut), so SDPA takes its
    unmasked path.
    """
    q_pos = torch.arange(start, start + queries).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(keys_from, keys_to).unsqueeze(0)  # [1, K]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    return None if bool(allowed.all()) else allowed


class LeanTarget(TorchTarget):
    """TargetModel whose forward is the lean ladder above; drafters still see the transformers body."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: set[int] | frozenset[int]) -> None:
        super().__init__(model, eos_token_ids)
        config = model.config
        if config.model_type not in SUPPORTED_TYPES:
            raise UnsupportedModel(
                f"the lean backend supports {', '.join(SUPPORTED_TYPES)}, not {config.model_type!r}; "
                "use --backend transformers"
            )
        if getattr(config, "attn_logit_softcapping", None):
            raise UnsupportedModel("attention logit soft-capping is not supported by the lean backend")
        gemma = config.model_type.startswith("gemma")
        self.layers = [_lean_layer(layer, config, i, gemma) for i, layer in enumerate(self.body.layers)]
        first = self.body.layers[0].self_attn
        self.head_dim = first.head_dim
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.dtype = self.layers[0].qkv.weight.dtype
        self._rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> (cos, sin) [P, hd]
        self._extend_rotary(_INITIAL_CAPACITY)

    def _extend_rotary(self, positions: int) -> None:
        """Rotary cos/sin tables [positions, hd] from the model's own rotary module, per layer type."""
        rotary = self.body.rotary_emb
        ids = torch.arange(positions).unsqueeze(0)  # [1, P]
        probe = torch.zeros(1, dtype=self.dtype)
        per_type = "layer_type" in inspect.signature(rotary.forward).parameters
        with torch.inference_mode():
            for kind in {layer.rope for layer in self.layers}:
                cos, sin = rotary(probe, ids, kind) if per_type else rotary(probe, ids)
                self._rotary[kind] = (cos[0], sin[0])

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def crop(self, cache: LeanCache, length: int) -> None:
        """Roll back by forgetting everything after `length` tokens (the buffers stay allocated)."""
        cache.length = min(cache.length, length)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: LeanCache) -> torch.Tensor:
        """Append tokens [T] to the cache and return final-normed hidden states [T, d]."""
        start, count = cache.length, tokens.numel()
        cache.reserve(start + count)
        if start + count > self._rotary[self.layers[0].rope][0].shape[0]:
            self._extend_rotary(cache.capacity)
        x = self.body.embed_tokens(tokens.view(-1))  # [T, d]
        for index, layer in enumerate(self.layers):
            x = self._layer(layer, x, cache, index, start)
        cache.length = start + count
        return self.body.norm(x)

    def _layer(self, layer: LeanLayer, x: torch.Tensor, cache: LeanCache, index: int, start: int) -> torch.Tensor:
        """One decoder layer over x [T, d] at positions start.. ; returns the new residual [T, d]."""
        attended = self._attention(layer, layer.input_norm(x), cache, index, start)  # [T, d]
        if layer.post_attention_norm is not None:
            attended = layer.post_attention_norm(attended)
        x = x + attended
        gate, up = layer.gate_up(layer.pre_mlp_norm(x)).chunk(2, dim=-1)  # [T, F] each
        mlp = layer.down(layer.activation(gate) * up)  # [T, d]
        if layer.post_mlp_norm is not None:
            mlp = layer.post_mlp_norm(mlp)
        return x + mlp

    def _attention(self, layer: LeanLayer, h: torch.Tensor, cache: LeanCache, index: int, start: int) -> torch.Tensor:
        """Self-attention of h [T, d] over the cached keys plus its own; writes its K/V to the cache."""
        count, hd, heads, kv = h.shape[0], self.head_dim, self.num_heads, self.kv_heads
        qkv = layer.qkv(h)  # [T, (H + 2 KV) hd]
        q, k, v = qkv.view(count, heads + 2 * kv, hd).split((heads, kv, kv), dim=1)  # [T, *, hd]
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = (table[start : start + count].unsqueeze(1) for table in self._rotary[layer.rope])  # [T, 1, hd]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        end = start + count
        cache.keys[index][:, start:end] = k.transpose(0, 1)
        cache.values[index][:, start:end] = v.transpose(0, 1)
        first = max(0, start + 1 - layer.window) if layer.window else 0  # older keys are outside every query's window
        keys = cache.keys[index][:, first:end]  # [KV, K, hd]
        values = cache.values[index][:, first:end]
        mask = _attention_mask(start, count, first, end, layer.window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, T, hd]
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=heads != kv,
        )  # [1, H, T, hd]
        return layer.o(out[0].transpose(0, 1).reshape(count, heads * hd))

