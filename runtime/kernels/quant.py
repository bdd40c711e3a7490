"""GGML block formats: a weight matrix kept as its GGUF blocks, and its exact float32 values.

`QuantMatrix` holds a [rows, cols] weight as the file's raw row bytes (a zero-copy view of the
memory-mapped GGUF). `dequantize` and `take_rows` give exactly the float32 values gguf-py's
`gguf.quants.dequantize` gives (the values transformers' GGUF loader puts in an fp32 model): the
compiled kernels decode in gguf-py's float32 operation order, and `_dequantize_torch` (the
fallback and the kernels' reference) repeats gguf-py's numpy code in torch, op for op.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runtime.kernels.build import active

T = GGMLQuantizationType
SUPPORTED_GGML_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
# Q5_0 repacked into lanes (Q5_0Lanes in blocks.h): no GGML type and never in a file, the layout the
# native backend gives Q5_0 matrices where the AVX-512 kernels run (kernel_layout). Three blocks per
# 70-byte group: 16 little-endian uint32 lanes, element 16f + i of the group in bits 5f..5f+4 of
# lane i (f = 0..5), then the three blocks' d (f16); a row's last cols % 96 elements stay Q5_0 blocks.
Q5_0_LANES = 1006
_LANES_GROUP, _LANES_BYTES, _Q5_0_BYTES = 96, 70, 22
_FIELD_SHIFTS = torch.arange(0, 30, 5, dtype=torch.int32).view(6, 1)  # field f at bit 5f
KERNEL_TYPES = (*SUPPORTED_GGML_TYPES, Q5_0_LANES)


def type_name(ggml_type: int) -> str:
    """GGML type id -> its name ('Q4_K'), or the number when gguf-py does not know it."""
    if ggml_type == Q5_0_LANES:
        return "Q5_0 (lanes)"
    return T(ggml_type).name if ggml_type in T._value2member_map_ else str(int(ggml_type))


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of `cols` elements; ValueError when cols is not a whole number of blocks."""
    if ggml_type == Q5_0_LANES:
        if cols <= 0 or cols % 32:
            raise ValueError(f"a Q5_0 row holds a multiple of 32 elements, not {cols}")
        return cols // _LANES_GROUP * _LANES_BYTES + cols % _LANES_GROUP // 32 * _Q5_0_BYTES
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    if cols <= 0 or cols % block:
        raise ValueError(f"a {type_name(ggml_type)} row holds a multiple of {block} elements, not {cols}")
    return cols // block * size


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """A [rows, cols] weight in ggml type `ggml_type`, as its row bytes `data` [rows, row_bytes] uint8.

    `data` may be a view of a read-only memory map: nothing here copies or writes it.
    """

    data: torch.Tensor  # [rows, row_bytes] uint8
    ggml_type: int
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.ggml_type not in KERNEL_TYPES:
            raise ValueError(
                f"tensor type {type_name(self.ggml_type)} is not supported by the native kernels "
                f"(supported: {', '.join(t.name for t in SUPPORTED_GGML_TYPES)}); use --backend lean"
            )
        expected = (self.rows, row_bytes(self.ggml_type, self.cols))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected or not self.data.is_contiguous():
            raise ValueError(f"QuantMatrix data must be contiguous uint8 {list(expected)}, got {self.data.dtype} {list(self.data.shape)}")

    @classmethod
    def from_numpy(cls, array: np.ndarray, ggml_type: int, rows: int, cols: int) -> "QuantMatrix":
        """Wrap a contiguous numpy array (e.g. a read-only GGUF memmap) of the rows' bytes, without copying it."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns that a read-only map is not writable
            return cls(torch.from_numpy(array.view(np.uint8).reshape(rows, -1)), int(ggml_type), rows, cols)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()


_SHIFT_4 = torch.tensor([0, 4], dtype=torch.uint8)  # low nibble, high nibble


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [..., 1] (exact, as numpy's astype)."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k]: the k low nibbles, then the k high ones (gguf-py's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed bytes -> 6-bit (scale, min) [..., 8] each (gguf-py Q4_K.get_scale_min)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q5_quants(b: torch.Tensor, off: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks [..., block bytes] (qh at byte off, nibbles after it) -> quants [..., 32] uint8 0..31."""
    qh = b[..., off : off + 4].to(torch.int64)
    qh = qh[..., 0:1] | qh[..., 1:2] << 8 | qh[..., 2:3] << 16 | qh[..., 3:4] << 24  # [..., 1]
    high = ((qh >> torch.arange(32)) & 1).to(torch.uint8) << 4
    return _nibbles(b[..., off + 4 :]) | high


def to_lanes(w: QuantMatrix) -> QuantMatrix:
    """A Q5_0 matrix repacked into Q5_0_LANES: the same values (so the same kernel bits), read faster."""
    if w.ggml_type != T.Q5_0:
        raise ValueError(f"to_lanes repacks Q5_0 matrices, not {type_name(w.ggml_type)}")
    rows, groups = w.rows, w.cols // _LANES_GROUP
    if groups == 0:  # only tail blocks: the same bytes
        return QuantMatrix(w.data, Q5_0_LANES, w.rows, w.cols)
    blocks = w.data.reshape(rows, -1, _Q5_0_BYTES)  # [rows, blocks, 22]
    b = blocks[:, : 3 * groups]  # the whole groups' blocks; the rest stay as they are
    q = _q5_quants(b, 2).to(torch.int32).view(rows, groups, 6, 16)  # [rows, groups, field, lane]
    lanes = (q << _FIELD_SHIFTS).sum(2, dtype=torch.int32)  # [rows, groups, 16]: the fields' bits do not overlap
    scales = b[..., :2].reshape(rows, groups, 6)  # the three blocks' d
    packed = torch.cat([lanes.view(torch.uint8), scales], dim=-1).reshape(rows, groups * _LANES_BYTES)
    data = torch.cat([packed, blocks[:, 3 * groups :].reshape(rows, -1)], dim=1)
    return QuantMatrix(data, Q5_0_LANES, w.rows, w.cols)


def kernel_layout(w: QuantMatrix) -> QuantMatrix:
    """w in the layout the active kernels read fastest: a Q5_0 matrix in lanes (to_lanes) where an
    AVX-512 path runs, else w itself. The values, and so every kernel output's bits, are the same."""
    path, ext = active()
    if ext is None or not path.startswith("avx512") or w.ggml_type != T.Q5_0:
        return w
    return to_lanes(w)


def _lanes_dequantize(data: torch.Tensor, cols: int) -> torch.Tensor:
    """Q5_0_LANES rows [rows, row_bytes] -> [rows, cols] float32: Q5_0's values, from the repacked quants."""
    rows, groups = data.shape[0], cols // _LANES_GROUP
    if groups == 0:  # only tail blocks
        return _dequantize_torch(data, T.Q5_0, cols)
    g = data[:, : groups * _LANES_BYTES].reshape(rows, groups, _LANES_BYTES)
    lanes = g[..., :64].contiguous().view(torch.int32)  # [rows, groups, 16]
    q = ((lanes.unsqueeze(2) >> _FIELD_SHIFTS) & 31).to(torch.uint8).reshape(rows, 3 * groups, 32)  # [rows, blocks, 32]
    d = _f16(g[..., 64:].reshape(rows, 3 * groups, 2), 0)  # [rows, blocks, 1]
    w = d * (q.to(torch.int8) - 16).float()  # Q5_0's operation
    tail = _dequantize_torch(data[:, groups * _LANES_BYTES :], T.Q5_0, cols % _LANES_GROUP) if cols % _LANES_GROUP else None
    return torch.cat([w.reshape(rows, -1), tail], dim=1) if tail is not None else w.reshape(rows, cols)


def _dequantize_torch(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """data [rows, row_bytes] uint8 -> [rows, cols] float32, gguf-py's numpy code op for op."""
    if ggml_type == Q5_0_LANES:
        return _lanes_dequantize(data, cols)
    rows, t = data.shape[0], T(ggml_type)
    if t == T.F32:
        return data.view(torch.float32).clone()
    if t == T.F16:
        return data.view(torch.float16).float()
    if t == T.BF16:
        return (data.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    b = data.reshape(rows, -1, GGML_QUANT_SIZES[t][1])  # [rows, blocks, block bytes]
    if t == T.Q8_0:
        w = b[..., 2:].view(torch.int8).float() * _f16(b, 0)
    elif t == T.Q4_0:
        w = _f16(b, 0) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
    elif t == T.Q4_1:
        w = _f16(b, 0) * _nibbles(b[..., 4:]).float() + _f16(b, 2)
    elif t in (T.Q5_0, T.Q5_1):
        q = _q5_quants(b, 2 if t == T.Q5_0 else 4)
        w = _f16(b, 0) * (q.to(torch.int8) - 16).float() if t == T.Q5_0 else _f16(b, 0) * q.float() + _f16(b, 2)
    elif t in (T.Q4_K, T.Q5_K):
        sc, mn = _scale_min_k4(b[..., 4:16])
        d = (_f16(b, 0) * sc.float())[..., None]  # [rows, blocks, 8, 1]
        dm = (_f16(b, 2) * mn.float())[..., None]
        qs = b[..., 16:] if t == T.Q4_K else b[..., 48:]
        q = (qs.unflatten(-1, (4, 1, 32)) >> _SHIFT_4[:, None]).flatten(-3, -2) & 0x0F  # [rows, blocks, 8, 32]
        if t == T.Q5_K:
            qh = b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8)[:, None]  # [rows, blocks, 8, 32]
            q = q | ((qh & 1) << 4)
        w = d * q.float() - dm
    elif t == T.Q6_K:
        ql, qh = b[..., 0:128], b[..., 128:192]
        d = (_f16(b, 208) * b[..., 192:208].view(torch.int8).float())[..., None]  # [rows, blocks, 16, 1]
        lo = ql.unflatten(-1, (2, 1, 64)) >> _SHIFT_4[:, None]  # [rows, blocks, 2, 2, 64]
        hi = qh.unflatten(-1, (2, 1, 32)) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]  # [rows, blocks, 2, 4, 32]
        q = ((lo & 0x0F).flatten(-3) | ((hi & 0x03).flatten(-3) << 4)).to(torch.int8) - 32  # [rows, blocks, 256]
        w = d * q.unflatten(-1, (16, 16)).float()
    else:  # pragma: no cover - QuantMatrix refuses other types
        raise ValueError(f"tensor type {t.name} is not supported; use --backend lean")
    return w.reshape(rows, cols)


def dequantize(w: QuantMatrix | torch.Tensor) -> torch.Tensor:
    """The exact float32 values [rows, cols] of a weight (gguf-py's `dequantize`); an fp32 tensor as is."""
    if isinstance(w, torch.Tensor):
        return w
    return take_rows(w, torch.arange(w.rows))


def take_rows(w: QuantMatrix | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [k] of a weight as exact float32 [k, cols] (embedding lookup, a head's exact rows)."""
    if isinstance(w, torch.Tensor):
        return w[ids]
    ids = ids.reshape(-1).long()
    _, ext = active()
    if ext is None:
        return _dequantize_torch(w.data[ids], w.ggml_type, w.cols)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < w.rows):
        raise IndexError(f"row ids must lie in [0, {w.rows})")
    return ext.take_rows(w.data, int(w.ggml_type), w.cols, ids)


def quant_linear(x: torch.Tensor, w: QuantMatrix) -> torch.Tensor:
    """x [n, cols] float32 times the block weight: [n, rows], torch.equal to the fp32 kernel on dequantize(w).

    Each output is summed in the skinny kernel's order whatever n is (any n: the kernel takes the
    rows of x in passes of a few). The pure-torch fallback (no compiled path) multiplies
    dequantize(w) with torch's GEMM instead: the same values up to float32 rounding, not the same bits.
    """
    return quant_linear_parts(x, [w])


def quant_linear_parts(x: torch.Tensor, parts: list[QuantMatrix]) -> torch.Tensor:
    """x [n, cols] against several block weights with outputs side by side: [n, sum of rows].

    Each part's outputs are quant_linear's bits; one call fills one output (fused q/k/v, gate/up).
    """
    cols = parts[0].cols
    if any(w.cols != cols for w in parts):
        raise ValueError("quant_linear_parts needs parts with one column count")
    if x.dim() != 2 or x.shape[1] != cols or x.dtype != torch.float32:
        raise ValueError(f"quant_linear needs x [n, {cols}] float32, got {x.dtype} {list(x.shape)}")
    _, ext = active()
    if ext is None:
        outs = [torch.nn.functional.linear(x, _dequantize_torch(w.data, w.ggml_type, w.cols)) for w in parts]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return ext.quant_linear_parts(x, [w.data for w in parts], [int(w.ggml_type) for w in parts], cols)
