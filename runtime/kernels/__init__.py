"""Compiled CPU kernels, built on first use, with a pure-torch fallback."""

from __future__ import annotations

import os
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name(name) for name in ("int8_gemv.cpp", "skinny_gemm.cpp")]
SKINNY_MAX_ROWS = 16  # beyond this many rows, a packed GEMM (torch's) is faster than streaming


@lru_cache(maxsize=1)
def _extension():
    """Build (once, cached by torch under ~/.cache/torch_extensions) and load the AVX-512 kernels."""
    if os.environ.get("SPECVOCAB_NO_EXTENSION") or not _cpu_has_avx512():
        return None
    try:
        from torch.utils.cpp_extension import load

        print("specvocab: loading the CPU kernels (the first use compiles them, ~1 min)", file=sys.stderr)
        return load(
            name="specvocab_int8_gemv",
            sources=[str(source) for source in _SOURCES],
            extra_include_paths=[str(_SOURCES[0].parent)],  # simd.h; torch also rebuilds when it changes
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mfma", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler must not stop decoding, only slow it
        warnings.warn(f"CPU kernels unavailable ({exc}); using the slower torch fallbacks")
        return None


def _cpu_has_avx512() -> bool:
    try:
        return "avx512bw" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def kernel_name() -> str:
    """Which implementation `screen_gemv` runs: 'avx512' or 'torch'."""
    return "avx512" if _extension() is not None else "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for x [n, d], weight [out, d]: the streaming kernel for a few fp32 rows, else torch's.

    For n <= SKINNY_MAX_ROWS the kernel reads each weight row once for all rows of x and sums every
    output in the same order whatever n is, so a verify forward over n tokens costs about one
    weight read and gives each position the value a 1-token step would.
    """
    ext = _extension()
    if (
        ext is None
        or x.dim() != 2
        or x.shape[0] > SKINNY_MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not weight.is_contiguous()
        or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    ):
        return torch.nn.functional.linear(x, weight, bias)
    out = ext.skinny_linear(x, weight)  # [n, out]
    return out.add_(bias) if bias is not None else out


def screen_gemv(qweight: torch.Tensor, scales: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Approximate logits from the int8 screening copy of the head, fp32 activations.

    qweight: [V, d] int8, scales: [V, G] float32 (G groups per row), hidden: [B, d] float32.
    Returns [B, V] float32: sum over groups of scale * <q_group, h_group>.
    """
    ext = _extension()
    if ext is not None:
        return ext.screen_gemv(qweight, scales, hidden.float())
    return _screen_gemv_torch(qweight, scales, hidden.float())


def _screen_gemv_torch(qweight: torch.Tensor, scales: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Reference implementation, in row chunks so it never materializes the dequantized head."""
    V, d = qweight.shape
    G = scales.shape[1]
    out = torch.empty(hidden.shape[0], V, dtype=torch.float32)
    chunk = 16384
    for start in range(0, V, chunk):
        q = qweight[start : start + chunk].float().view(-1, G, d // G)  # [c, G, g]
        w = (q * scales[start : start + chunk, :, None]).view(-1, d)  # [c, d]
        out[:, start : start + chunk] = hidden @ w.T
    return out


def screen_select(
    center: torch.Tensor,
    coefficients: torch.Tensor,
    hidden_norm: float,
    slack: float,
    temperature: float,
    noise: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """Candidate ids [n] of one screened row: upper bound >= the k-th best lower bound.

    center, coefficients, noise: [V] float32. radius_i = c_i |h| + slack (|center_i| + c_i |h|);
    bounds are divided by the temperature (when > 0) and shifted by the noise.
    """
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    ext = _extension()
    if ext is not None:
        empty = torch.empty(0, dtype=torch.float32)
        return ext.screen_select(center, coefficients, hidden_norm, slack, inv_t, empty if noise is None else noise, k)
    base = coefficients * hidden_norm
    radius = base + slack * (center.abs() + base)
    lower, upper = (center - radius) * inv_t, (center + radius) * inv_t
    if noise is not None:
        lower, upper = lower + noise, upper + noise
    return torch.nonzero(upper >= torch.topk(lower, k).values[-1]).flatten()
