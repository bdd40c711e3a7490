"""The decoder ladder's row-wise ops: RMSNorm, q/k preparation and single-query attention.

Compiled (layer_ops.h), each is one call in one fixed summation order, and every output row
depends only on its own input row and the keys it reads: the ladder's batch invariance (a verify
forward over n tokens, a token tree) rests on that. Without a compiled path the same arithmetic
runs as torch ops (same values up to float32 rounding, not the same bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.build import active

_NO_FACTOR = torch.empty(0)


def rms_norm(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """(x * rsqrt(mean(x²) + eps)) * factor over the last dim of x [..., d]; factor [d]."""
    _, ext = active()
    if ext is None:
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * factor
    rows = x.reshape(-1, x.shape[-1])
    return ext.rms_norm(rows if rows.is_contiguous() else rows.contiguous(), factor, eps).view(x.shape)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def prepare_qkv(
    qkv: torch.Tensor,
    heads: int,
    head_norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    rotary: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
) -> None:
    """Ready qkv [T, H + 2 KV, hd] for attention in place and cache its K/V.

    head_norms: (q factor, k factor) [hd] of gemma3's per-head RMSNorm, or None. rotary: the
    (cos, sin) tables [P, hd] read at positions [T]. keys, values: one layer's cache buffers
    [KV, capacity, hd]; the T tokens' rotated k and v go to slots start.. start + T - 1.
    """
    _, ext = active()
    if ext is not None:
        q_factor, k_factor = head_norms or (_NO_FACTOR, _NO_FACTOR)
        ext.prepare_qkv(qkv, heads, q_factor, k_factor, eps, rotary[0], rotary[1], positions, keys, values, start)
        return
    kv = (qkv.shape[1] - heads) // 2
    q, k, v = qkv.split((heads, kv, kv), dim=1)  # [T, *, hd] views
    if head_norms is not None:
        q.copy_(rms_norm(q, head_norms[0], eps))
        k.copy_(rms_norm(k, head_norms[1], eps))
    cos, sin = (table[positions].unsqueeze(1) for table in rotary)  # [T, 1, hd]
    for part in (q, k):
        part.copy_(part * cos + _rotate_half(part) * sin)
    end = start + qkv.shape[0]
    keys[:, start:end] = k.transpose(0, 1)
    values[:, start:end] = v.transpose(0, 1)


def attend(
    qkv: torch.Tensor,
    heads: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: torch.Tensor,
    end: torch.Tensor,
    extra: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each query (the first H heads of qkv [T, H + 2 KV, hd]) over the keys it sees: [T, H hd].

    Query t reads cache slots first[t] .. end[t] - 1, then extra[t] [T, E] up to its first -1 (a
    tree node's path), in that order, from keys, values [KV, capacity, hd]. Each query is
    computed alone, so its output depends only on the contents and order of the keys it reads.
    """
    _, ext = active()
    if ext is not None:
        return ext.attend(qkv, heads, keys, values, first, end, extra, scale)
    count, _, hd = qkv.shape
    rows = []
    for t in range(count):
        slots = torch.cat([torch.arange(int(first[t]), int(end[t])), extra[t][extra[t] >= 0]])
        rows.append(F.scaled_dot_product_attention(
            qkv[t : t + 1, :heads].transpose(0, 1).unsqueeze(0),  # [1, H, 1, hd]
            keys.index_select(1, slots).unsqueeze(0),  # [1, KV, K, hd]
            values.index_select(1, slots).unsqueeze(0),
            scale=scale,
            enable_gqa=heads != keys.shape[0],
        )[0, :, 0].reshape(heads * hd))
    return torch.stack(rows)


def layer_plan(norms: list, projections: list, heads: int, kv_heads: int, head_dim: int, scaling: float, activation: str):
    """One decoder layer as one compiled call (layer_plan.h's LayerPlan), or None without compiled kernels.

    norms: (factor [d], eps) or None for each of input, q, k, post-attention, pre-MLP and post-MLP;
    projections: (QuantMatrix list whose outputs sit side by side, bias [out] or None) for qkv, o,
    gate_up and down; activation: 'silu' or 'gelu_tanh'.
    """
    _, ext = active()
    if ext is None:
        return None
    return ext.LayerPlan(
        [n[0] if n is not None else _NO_FACTOR for n in norms], [n[1] if n is not None else 0.0 for n in norms],
        [[m.data for m in matrices] for matrices, _ in projections], [[int(m.ggml_type) for m in matrices] for matrices, _ in projections],
        [matrices[0].cols for matrices, _ in projections], [bias if bias is not None else _NO_FACTOR for _, bias in projections],
        heads, kv_heads, head_dim, float(scaling), activation,
    )
