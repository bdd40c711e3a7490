"""Lanes layouts: GGML blocks rearranged so the SIMD kernels reach every quant with a shift.

A GGML block stores its quants as bytes (nibbles, high bits apart), and the kernels widen them to
int32 lanes before each table lookup or conversion: on AVX-512 that widening, and the shuffles
that gather high bits, share one port with the lookups (AVX2 reads a 64-byte vector as two halves). A lanes layout stores the same quants
pre-widened: 16 lanes, each a value of W 32-bit words (word w of every lane in the w-th 64-byte
vector, little-endian), element 16f + i of the span at bits [width * f, width * (f + 1)) of lane i,
so field f is one shift of one load away (two, merged, where it straddles two words).
Scales stay as the file has them. These are not GGML types and never reach a file: the native
backend repacks a matrix once at load (quant.kernel_layout), with the compiled pack (lanes_pack.h)
whose bytes `pack` here defines. `pack` and `unpack` are exact inverses on the bytes, and the kernels (blocks.h: Q5_0Lanes, Q4_KLanes, Q6_KLanes) compute the same
float values from either layout, so every output keeps its bits.

- Q5_0 (1006): three blocks (96 elements) per 70-byte group: 64 bytes of 5-bit fields (six per lane,
  f = 2 * block + half), then the three d (f16). A row's last cols % 96 elements stay Q5_0 blocks.
- Q4_K (1012): per 256-element super-block, 128 bytes of 4-bit fields (16 per lane, two words),
  then the 16-byte header (d, dmin, 12 bytes of packed scales). 144 bytes, as in the file.
- Q6_K (1014): per super-block, 192 bytes of 6-bit quants (16 per lane, three words; fields 5 and
  10 straddle), then the 16 int8 scales and d. 210 bytes, as in the file.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

LANES_TYPES = {T.Q5_0: 1006, T.Q4_K: 1012, T.Q6_K: 1014}  # GGML type -> its lanes layout (1000 + id)
SOURCE_TYPES = {lanes: source for source, lanes in LANES_TYPES.items()}
_GROUP, _GROUP_BYTES, _Q5_0_BYTES = 96, 70, 22  # Q5_0 lanes: elements and bytes per group; a Q5_0 block


def _to_lanes(fields: torch.Tensor, width: int) -> torch.Tensor:
    """fields [..., F, 16] (values < 2^width) -> [..., 64 W] bytes: field f at bits [width f, width (f + 1))
    of each lane's W-word value, word w (bits 32 w..) in the w-th 64-byte vector; a field may straddle two words."""
    count = fields.shape[-2]
    q = fields.to(torch.int64)
    words = torch.zeros(*fields.shape[:-2], -(-width * count // 32), 16, dtype=torch.int64)
    for f in range(count):
        w, off = divmod(width * f, 32)
        words[..., w, :] |= (q[..., f, :] << off) & 0xFFFFFFFF
        if off + width > 32:
            words[..., w + 1, :] |= q[..., f, :] >> (32 - off)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits
    return words.contiguous().view(torch.uint8).flatten(-2)


def _from_lanes(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., 64 W] bytes -> fields [..., count, 16] uint8 (the inverse of _to_lanes)."""
    words = data.contiguous().view(torch.int32).unflatten(-1, (-1, 16)).to(torch.int64) & 0xFFFFFFFF  # [..., W, 16]
    fields = []
    for f in range(count):
        w, off = divmod(width * f, 32)
        value = words[..., w, :] >> off
        if off + width > 32:
            value = value | words[..., w + 1, :] << (32 - off)
        fields.append(value & ((1 << width) - 1))
    return torch.stack(fields, dim=-2).to(torch.uint8)


def row_bytes(lanes_type: int, cols: int) -> int:
    """Bytes of one row of `cols` elements in a lanes layout (the same as the file's but for Q5_0's groups)."""
    if lanes_type == LANES_TYPES[T.Q5_0]:
        return cols // _GROUP * _GROUP_BYTES + cols % _GROUP // 32 * _Q5_0_BYTES
    block, size = GGML_QUANT_SIZES[SOURCE_TYPES[lanes_type]]
    return cols // block * size


def q5_quants(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks [..., bytes] (qh at byte qh_at, 16 bytes of nibbles after it) -> quants
    [..., 32] uint8 in 0..31, in element order (gguf-py's)."""
    qh = blocks[..., qh_at : qh_at + 4].to(torch.int64)
    qh = qh[..., 0:1] | qh[..., 1:2] << 8 | qh[..., 2:3] << 16 | qh[..., 3:4] << 24  # [..., 1]
    high = ((qh >> torch.arange(32)) & 1).to(torch.uint8) << 4
    qs = blocks[..., qh_at + 4 :]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1) | high


def _q5_0_blocks(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d [..., 2] bytes and quants [..., 32] -> Q5_0 blocks [..., 22] (the inverse of q5_quants)."""
    high = ((q >> 4).to(torch.int64) << torch.arange(32)).sum(-1, keepdim=True)  # [..., 1]
    qh = torch.cat([(high >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).to(torch.uint8)
    nibbles = (q[..., :16] & 0x0F) | (q[..., 16:] & 0x0F) << 4
    return torch.cat([d, qh, nibbles], dim=-1)


def k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K quant bytes [..., 128] (four 32-byte runs, low nibbles = sub-block 2r, high = 2r + 1)
    -> their nibbles [..., 256] in element order (gguf-py's)."""
    qs = qs.unflatten(-1, (4, 32))
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2).flatten(-3)  # [..., 4, 2, 32] -> 256


def _k_nibble_bytes(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of k_nibbles: [..., 256] low nibbles -> [..., 128] bytes."""
    n = nibbles.unflatten(-1, (4, 2, 32))
    return (n[..., 0, :] | n[..., 1, :] << 4).flatten(-2)


def q6_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [..., 210] -> quants [..., 256] uint8 in 0..63 (element order; gguf-py's reshapes)."""
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    lo = ql.unflatten(-1, (2, 1, 64)) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]  # [..., 2, 2, 64]
    hi = qh.unflatten(-1, (2, 1, 32)) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]  # [..., 2, 4, 32]
    return (lo & 0x0F).flatten(-3) | ((hi & 0x03).flatten(-3) << 4)


def _q6_k_bytes(q: torch.Tensor) -> torch.Tensor:
    """The inverse of q6_k_quants: quants [..., 256] -> ql [..., 128], qh [..., 64] bytes."""
    halves = q.unflatten(-1, (2, 4, 32))  # [..., half, k, 32]: element 128 h + 32 k + j
    lo, hi = halves & 0x0F, halves >> 4
    ql = torch.cat([lo[..., 0, :] | lo[..., 2, :] << 4, lo[..., 1, :] | lo[..., 3, :] << 4], dim=-1)  # [..., half, 64]
    qh = hi[..., 0, :] | hi[..., 1, :] << 2 | hi[..., 2, :] << 4 | hi[..., 3, :] << 6  # [..., half, 32]
    return ql.flatten(-2), qh.flatten(-2)


def pack(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """GGML rows [rows, row_bytes] of a type in LANES_TYPES -> the same rows in its lanes layout."""
    rows = data.shape[0]
    if ggml_type == T.Q5_0:
        groups = cols // _GROUP
        if groups == 0:  # only tail blocks: the same bytes
            return data
        blocks = data.reshape(rows, -1, _Q5_0_BYTES)
        b = blocks[:, : 3 * groups]  # the whole groups' blocks; the rest stay Q5_0
        fields = q5_quants(b, 2).reshape(rows, groups, 6, 16)  # f = 2 * block + half
        packed = torch.cat([_to_lanes(fields, 5), b[..., :2].reshape(rows, groups, 6)], dim=-1)  # [rows, groups, 70]
        return torch.cat([packed.reshape(rows, -1), blocks[:, 3 * groups :].reshape(rows, -1)], dim=1)
    b = data.reshape(rows, cols // 256, -1)  # [rows, super-blocks, bytes]
    if ggml_type == T.Q4_K:
        nibbles = k_nibbles(b[..., 16:])  # [rows, sb, 256]
        parts = [_to_lanes(nibbles.view(rows, -1, 16, 16), 4), b[..., :16]]
    else:  # Q6_K
        parts = [_to_lanes(q6_k_quants(b).view(rows, -1, 16, 16), 6), b[..., 192:]]
    return torch.cat(parts, dim=-1).reshape(rows, -1)


def unpack(data: torch.Tensor, lanes_type: int, cols: int) -> torch.Tensor:
    """Rows in a lanes layout -> the GGML rows they were packed from, byte for byte."""
    rows = data.shape[0]
    if lanes_type == LANES_TYPES[T.Q5_0]:
        groups = cols // _GROUP
        if groups == 0:
            return data
        g = data[:, : groups * _GROUP_BYTES].reshape(rows, groups, _GROUP_BYTES)
        q = _from_lanes(g[..., :64], 5, 6).reshape(rows, 3 * groups, 32)
        blocks = _q5_0_blocks(g[..., 64:].reshape(rows, 3 * groups, 2), q)
        return torch.cat([blocks.reshape(rows, -1), data[:, groups * _GROUP_BYTES :]], dim=1)
    b = data.reshape(rows, cols // 256, -1)
    if lanes_type == LANES_TYPES[T.Q4_K]:
        nibbles = _from_lanes(b[..., :128], 4, 16).flatten(-2)  # [rows, sb, 256]
        return torch.cat([b[..., 128:], _k_nibble_bytes(nibbles)], dim=-1).reshape(rows, -1)
    ql, qh = _q6_k_bytes(_from_lanes(b[..., :192], 6, 16).flatten(-2))
    return torch.cat([ql, qh, b[..., 192:]], dim=-1).reshape(rows, -1)
