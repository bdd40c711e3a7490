"""GGML block formats: a weight matrix kept as its GGUF blocks, and its exact float32 values.

`QuantMatrix` holds a [rows, cols] weight as the file's raw row bytes (a zero-copy view of the
memory-mapped GGUF). `dequantize` and `take_rows` give exactly the float32 values gguf-py's
`gguf.quants.dequantize` gives (the values transformers' GGUF loader puts in an fp32 model): the
compiled kernels decode in gguf-py's float32 operation order, and `_dequantize_torch` (the
fallback and the kernels' reference) repeats gguf-py's numpy code in torch, op for op.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runtime.kernels import lanes
from runtime.kernels.build import active
from runtime.kernels.lanes import LANES_TYPES, SOURCE_TYPES, k_nibbles, q5_quants, q6_k_quants

T = GGMLQuantizationType
SUPPORTED_GGML_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
KERNEL_TYPES = (*SUPPORTED_GGML_TYPES, *SOURCE_TYPES)  # and the lanes layouts the native backend repacks to
_PACK_ROWS = 256  # rows per to_lanes step
Allocate = Callable[..., torch.Tensor]  # allocate(shape, dtype=...) -> an uninitialised tensor, as torch.empty


def type_name(ggml_type: int) -> str:
    """GGML type id -> its name ('Q4_K'), or the number when gguf-py does not know it."""
    if ggml_type in SOURCE_TYPES:
        return f"{SOURCE_TYPES[ggml_type].name} (lanes)"
    return T(ggml_type).name if ggml_type in T._value2member_map_ else str(int(ggml_type))


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of `cols` elements; ValueError when cols is not a whole number of blocks."""
    if ggml_type in SOURCE_TYPES:
        row_bytes(SOURCE_TYPES[ggml_type], cols)  # the same whole-block rule
        return lanes.row_bytes(ggml_type, cols)
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


def to_lanes(w: QuantMatrix, allocate: Allocate = torch.empty) -> QuantMatrix:
    """w (Q5_0, Q4_K or Q6_K) repacked into its lanes layout (runtime.kernels.lanes): the same values,
    so the same kernel bits, with fewer instructions per weight on AVX-512 and AVX2. The bytes go into
    allocate(shape, dtype) (the native backend's: huge-page memory)."""
    if w.ggml_type not in LANES_TYPES:
        raise ValueError(f"to_lanes repacks {', '.join(t.name for t in LANES_TYPES)} matrices, not {type_name(w.ggml_type)}")
    kind = LANES_TYPES[T(w.ggml_type)]
    data = allocate((w.rows, lanes.row_bytes(kind, w.cols)), dtype=torch.uint8)  # [rows, lanes row bytes]
    _, ext = active()
    if ext is not None:  # the compiled pack (lanes_pack.h): the torch one's bytes, much faster
        ext.pack_lanes(w.data, int(w.ggml_type), w.cols, data)
        return QuantMatrix(data, kind, w.rows, w.cols)
    for start in range(0, w.rows, _PACK_ROWS):  # a few rows at a time: small temporaries, which the heap gives back
        data[start : start + _PACK_ROWS] = lanes.pack(w.data[start : start + _PACK_ROWS], w.ggml_type, w.cols)
    return QuantMatrix(data, kind, w.rows, w.cols)


def from_lanes(w: QuantMatrix) -> QuantMatrix:
    """The GGML matrix a lanes-layout matrix was packed from, byte for byte."""
    source = SOURCE_TYPES[w.ggml_type]
    return QuantMatrix(lanes.unpack(w.data, w.ggml_type, w.cols), int(source), w.rows, w.cols)


_LANES_PATHS = ("avx512vbmi", "avx512", "avx2")  # the paths that read lanes faster (portable: no gain, measured)


def kernel_layout(w: QuantMatrix, allocate: Allocate = torch.empty) -> QuantMatrix:
    """w in the layout the active kernels read fastest: a Q5_0, Q4_K or Q6_K matrix in lanes (to_lanes,
    into allocate's memory) where an AVX-512 or AVX2 path runs, else w itself. The values, and so every
    kernel output's bits, are the same."""
    path, ext = active()
    if ext is None or path not in _LANES_PATHS or w.ggml_type not in LANES_TYPES:
        return w
    return to_lanes(w, allocate)


def _dequantize_torch(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """data [rows, row_bytes] uint8 -> [rows, cols] float32, gguf-py's numpy code op for op."""
    if ggml_type in SOURCE_TYPES:
        return _dequantize_torch(lanes.unpack(data, ggml_type, cols), SOURCE_TYPES[ggml_type], cols)
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
        q = q5_quants(b, 2 if t == T.Q5_0 else 4)
        w = _f16(b, 0) * (q.to(torch.int8) - 16).float() if t == T.Q5_0 else _f16(b, 0) * q.float() + _f16(b, 2)
    elif t in (T.Q4_K, T.Q5_K):
        sc, mn = _scale_min_k4(b[..., 4:16])
        d = (_f16(b, 0) * sc.float())[..., None]  # [rows, blocks, 8, 1]
        dm = (_f16(b, 2) * mn.float())[..., None]
        qs = b[..., 16:] if t == T.Q4_K else b[..., 48:]
        q = k_nibbles(qs).unflatten(-1, (8, 32))  # [rows, blocks, 8, 32]
        if t == T.Q5_K:
            qh = b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8)[:, None]  # [rows, blocks, 8, 32]
            q = q | ((qh & 1) << 4)
        w = d * q.float() - dm
    elif t == T.Q6_K:
        d = (_f16(b, 208) * b[..., 192:208].view(torch.int8).float())[..., None]  # [rows, blocks, 16, 1]
        q = q6_k_quants(b).to(torch.int8) - 32  # [rows, blocks, 256]
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
