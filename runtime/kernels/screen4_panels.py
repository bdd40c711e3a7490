"""The 4-bit screen in the kernel's panel layout: 16 vocabulary rows side by side, one byte stream.

Stage `screen4` stores the screen row by row (codes [V, d/2], scales / mins [V, G], corr [V, k],
corr_scale [V]). The kernel (screen4_avx512.cpp) instead gives each of the 16 lanes of a vector one
vocabulary row, so a group's integer dot products stay in their lanes until the group ends: one
float scaling per group and hidden row for 16 rows, where the row layout needed one per 64 columns.
Panel p holds rows 16p .. 16p + 15 (the last panel padded with zero rows) as, for each group g of
n columns:

    n/8 vectors of 64 bytes: byte 4L + m of vector v holds q[L, gn + 8v + m] (low nibble) and
                             q[L, gn + 8v + 4 + m] (high nibble), L the row within the panel;
    16 float16 scales, then 16 float16 minimums (32 bytes each);

then the correction, k vectors of 16 int8 (byte 16j + L = corr[L, j]), and the 16 float32
corr_scale. So a panel is G (8n + 64) + 16k + 64 bytes, a multiple of 64, read front to back.
Packed once when the bound loads; `rows` unpacks any range back (the float64 reference path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels import hugepages

PANEL_ROWS = 16
_CHUNK_PANELS = 1024  # panels packed or unpacked per step: 16384 rows, ~30 MB of temporaries at d = 640


@dataclass(frozen=True)
class Screen4Panels:
    """A `screen4` stage in panels: packed [P, panel_bytes] uint8 for `vocab` rows of `dim` columns."""

    packed: torch.Tensor
    vocab: int
    dim: int
    group: int  # n: columns per scale and minimum (32 or 64)
    rank: int  # k: correction coordinates

    @property
    def groups(self) -> int:
        return self.dim // self.group

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Rows [start, stop) as (q [r, d] uint8 in 0..15, scales [r, G] float16, mins [r, G] float16,
        corr [r, k] int8, corr_scale [r] float32): the stage's values, in natural column order."""
        first, last = start // PANEL_ROWS, -(-stop // PANEL_ROWS)
        parts = _unpack(self.packed[first:last], self.dim, self.group, self.rank)
        offset = start - first * PANEL_ROWS
        return tuple(t[offset : offset + stop - start] for t in parts)


def pack_screen4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, corr: torch.Tensor,
                 corr_scale: torch.Tensor) -> Screen4Panels:
    """The stage's tensors (codes [V, d/2] uint8, scales / mins [V, G] float16, corr [V, k] int8,
    corr_scale [V] float32) in panels."""
    V, G = scales.shape
    dim, rank = codes.shape[1] * 2, corr.shape[1]
    group = dim // G
    panels = -(-V // PANEL_ROWS)
    packed = hugepages.empty((panels, panel_bytes(dim, group, rank)), torch.uint8)  # streamed every step: huge pages
    for first in range(0, panels, _CHUNK_PANELS):
        rows = slice(first * PANEL_ROWS, min(V, (first + _CHUNK_PANELS) * PANEL_ROWS))
        q = unpack_int4(codes[rows], group)  # [r, d]
        parts = [_pad_rows(t) for t in (q, scales[rows], mins[rows], corr[rows], corr_scale[rows].float())]
        packed[first : first + parts[0].shape[0] // PANEL_ROWS] = _pack(*parts, group)
    return Screen4Panels(packed, V, dim, group, rank)


def panel_bytes(dim: int, group: int, rank: int) -> int:
    """Bytes of one panel of 16 rows."""
    return dim // group * _group_bytes(group) + PANEL_ROWS * rank + 64


def _group_bytes(group: int) -> int:
    """Bytes of one group of a panel: 16 rows' codes (8n), scales and minimums (32 each)."""
    return 8 * group + 64


def unpack_int4(codes: torch.Tensor, group: int) -> torch.Tensor:
    """4-bit screen codes [V, d/2] uint8 -> q [V, d] uint8: per group of n columns, byte j holds q[j] (low
    nibble) and q[j + n/2] (high nibble), ggml's Q4_1 order at n = 32."""
    V, half = codes.shape
    pairs = codes.view(V, half * 2 // group, group // 2)  # [V, G, n/2]
    return torch.cat([pairs & 0x0F, pairs >> 4], dim=2).view(V, half * 2)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """t [r, ...] with zero rows appended up to a multiple of 16."""
    extra = -t.shape[0] % PANEL_ROWS
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t


def _pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, corr: torch.Tensor, corr_scale: torch.Tensor,
          group: int) -> torch.Tensor:
    """Padded rows (a multiple of 16) -> their panels [P, panel_bytes] uint8."""
    rows, dim = q.shape
    P, G, k = rows // PANEL_ROWS, dim // group, corr.shape[1]
    nibbles = q.view(P, PANEL_ROWS, G, group // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [P, G, v, L, m, low/high]
    code_bytes = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(P, G, 8 * group)  # [P, G, 8n]

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [16P, X] -> [P, X, 16] as bytes
        return t.view(P, PANEL_ROWS, -1).transpose(1, 2).contiguous().view(torch.uint8)

    per_group = torch.cat([code_bytes, lanes(scales).view(P, G, 32), lanes(mins).view(P, G, 32)], dim=2)  # [P, G, 8n + 64]
    tail = [lanes(corr).view(P, 16 * k), corr_scale.view(P, PANEL_ROWS).contiguous().view(torch.uint8)]
    return torch.cat([per_group.view(P, -1), *tail], dim=1)


def _unpack(packed: torch.Tensor, dim: int, group: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Panels [P, panel_bytes] -> (q, scales, mins, corr, corr_scale) of their 16P rows."""
    P, G = packed.shape[0], dim // group
    per_group = packed[:, : G * _group_bytes(group)].reshape(P, G, _group_bytes(group))
    code_bytes = per_group[..., : 8 * group].reshape(P, G, group // 8, PANEL_ROWS, 4)  # [P, G, v, L, m]
    nibbles = torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=-1)  # [P, G, v, L, m, low/high]
    q = nibbles.permute(0, 3, 1, 2, 5, 4).reshape(P * PANEL_ROWS, dim)

    def rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [P, X, 16 * size] bytes -> [16P, X]
        return t.contiguous().view(dtype).view(P, -1, PANEL_ROWS).transpose(1, 2).reshape(P * PANEL_ROWS, -1)

    scales = rows(per_group[..., 8 * group : 8 * group + 32], torch.float16)
    mins = rows(per_group[..., 8 * group + 32 :], torch.float16)
    start = G * _group_bytes(group)
    corr = rows(packed[:, start : start + 16 * rank].reshape(P, rank, PANEL_ROWS), torch.int8)
    corr_scale = packed[:, start + 16 * rank :].contiguous().view(torch.float32).reshape(-1)
    return q, scales, mins, corr, corr_scale
