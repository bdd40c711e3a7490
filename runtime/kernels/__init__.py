"""Compiled CPU kernels, built on first use, with a pure-torch fallback.

`linear(x, W)` takes W as an fp32 tensor or as a `QuantMatrix` (a GGUF weight in its own blocks):
for a few rows of x both sum every output in one order (gemm.h), so `linear(x, q)` is
torch.equal to `linear(x, dequantize(q))`. The compiled path is chosen in `build.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from runtime.kernels.build import active, cpu_flags
from runtime.kernels.layer_ops import attend, layer_plan, prepare_qkv, rms_norm
from runtime.kernels.quant import SUPPORTED_GGML_TYPES, QuantMatrix, dequantize, quant_linear, quant_linear_parts, take_rows
from runtime.kernels.screen4_panels import Screen4Panels, pack_screen4, unpack_int4

SKINNY_MAX_ROWS = 16  # the most rows a verify chain, tree chunk or server piece hands the kernels at once; beyond
# each path's kTallMinRows rows of x (simd_*.h, measured per ISA) the kernel decodes weight tiles once for all rows
# (bindings.h: run_tall), with the same bits
INT16_SCREEN_MAX_COLS = 8192  # int16_screen.h's kMaxIntCols: its int32 lanes of int8 x int16 pairs cannot overflow
# The kernel paths whose 4-bit screen beats the int8 one, so the default method verifies through it. The AVX2
# kernel is bound by its byte dots (two vpmaddubsw per 4 weights and hidden row, on 256 bits), not by the
# bytes it saves: gemma3-270m spec:lookup+csv:screen4 ran at 0.82x spec:lookup+csv there (docs/certified-head.md).
SCREEN4_DEFAULT_PATHS = ("avx512vbmi", "avx512")


def kernel_name() -> str:
    """The kernel path in use: 'avx512vbmi', 'avx512', 'avx2', 'portable' (compiled, bit-identical) or 'torch'."""
    return active()[0]


def set_kernel_threads(threads: int, adaptive: bool) -> None:
    """The threads of every kernel region (the caller's included), and whether the workers stand down.

    The kernels run on their own pool (pool.h), not torch's OpenMP threads. `adaptive` (the default
    thread count): when the workers wait for a core (another process holds one), regions run on the
    calling thread alone for a while, then the workers are tried again (pool.h's Fallback). False, for
    a count the user chose: every region uses every thread. Results are the same bits either way.
    """
    ext = active()[1]
    if ext is not None:
        ext.set_threads(threads, adaptive)


def set_decoding_threads(threads: int, adaptive: bool) -> None:
    """Decode on `threads` threads: the kernels' pool at that count (`adaptive`: set_kernel_threads), torch's
    ops between the kernels on one thread, as its OpenMP workers split each op statically and spin after it
    on the core the pool's worker needs (docs/contention.md). Without compiled kernels, torch's ops are the
    model: they get the count."""
    set_kernel_threads(threads, adaptive)
    torch.set_num_threads(1 if kernel_name() != "torch" else threads)


@contextmanager
def threads_restored() -> Iterator[None]:
    """The kernels' pool setting and torch's thread count, put back as they were after the block."""
    pool, torch_count = thread_stats(), torch.get_num_threads()
    try:
        yield
    finally:
        if pool:
            set_kernel_threads(pool["threads"], adaptive=bool(pool["adaptive"]))
        torch.set_num_threads(torch_count)


@contextmanager
def decoding_threads(threads: int) -> Iterator[None]:
    """Decode on `threads` threads inside the block (set_decoding_threads, every region parallel); the
    settings before it after."""
    with threads_restored():
        set_decoding_threads(threads, adaptive=False)
        yield


def decode_threads() -> int:
    """The threads decoding uses: the kernels' pool's count (torch's own count without compiled kernels)."""
    ext = active()[1]
    return int(ext.thread_stats()["threads"]) if ext is not None else torch.get_num_threads()


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads at `count` inside the block (a backend whose forward is torch's own ops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_stats() -> dict[str, int]:
    """The kernel thread pool's counters (regions run with the workers or alone, fallbacks, probes; empty without kernels)."""
    ext = active()[1]
    return dict(ext.thread_stats()) if ext is not None else {}


def linear(x: torch.Tensor, weight: torch.Tensor | QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for x [n, d], weight [out, d] (fp32 or a QuantMatrix): the kernel, any n.

    The kernel sums every output in the same order whatever n is: up to SKINNY_MAX_ROWS rows it reads
    each weight row once for all of them (a verify forward over n tokens costs about one weight read
    and gives each position the value a 1-token step would); a longer input (a prefill chunk) runs
    over tiles of weight rows decoded once, with the same bits. Without compiled kernels, or with
    grad, torch's GEMM.
    """
    if isinstance(weight, QuantMatrix):
        out = quant_linear(x, weight)  # [n, out]
        return out.add_(bias) if bias is not None else out
    if (
        not streams(weight)
        or x.dim() != 2
        or x.dtype != torch.float32
        or torch.is_grad_enabled() and x.requires_grad
    ):
        return torch.nn.functional.linear(x, weight, bias)
    out = active()[1].skinny_linear(x, weight)  # [n, out]
    return out.add_(bias) if bias is not None else out


def streams(weight: torch.Tensor) -> bool:
    """Whether linear() runs this fp32 weight [out, d] through the kernel (for float32 rows of x),
    rather than handing it to torch's GEMM."""
    return (
        active()[1] is not None
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    )


def screen_gemv(qweight: torch.Tensor, scales: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Approximate logits from the int8 screening copy of the head, fp32 activations.

    qweight: [V, d] int8, scales: [V, G] float32 (G groups per row), hidden: [B, d] float32.
    Returns [B, V] float32: sum over groups of scale * <q_group, h_group>.
    """
    if has_screen_gemv_kernel():
        return active()[1].screen_gemv(qweight, scales, hidden.float())
    return _screen_gemv_torch(qweight, scales, hidden.float())


def has_screen_gemv_kernel() -> bool:
    """Whether screen_gemv runs compiled here (the AVX-512 paths only; AVX2 compiles the per-row int16 screen)."""
    ext = active()[1]
    return ext is not None and hasattr(ext, "screen_gemv")


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


def screen_gemv_int16(
    qweight: torch.Tensor, scales: torch.Tensor, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The per-row int8 screen with each hidden row split exactly into int16 values plus a remainder.

    hidden [B, d] = 2^e_b a_b + r_b with a_b int16; returns (y [B, V] float32 = scale_i 2^e_b <q_i, a_b>,
    |r_b| [B] float64 rounded up), the dot products exact in integers (vpdpwssd where an AVX-512 path
    runs and the CPU reports avx512_vnni, vpmaddwd otherwise). None where this path does not apply
    (no AVX-512 or AVX2 kernels, grouped scales, d not a multiple of 32 or above 8192): use screen_gemv then.
    """
    path, ext = active()
    d = qweight.shape[1]
    fits = scales.shape[1] == 1 and d % 32 == 0 and d <= INT16_SCREEN_MAX_COLS
    if ext is None or not hasattr(ext, "screen_gemv_int16") or not fits:
        return None
    vnni = path.startswith("avx512") and "avx512_vnni" in cpu_flags()
    return ext.screen_gemv_int16(qweight, scales, hidden.float(), vnni)


def has_screen4_kernel() -> bool:
    """Whether the 4-bit screen runs compiled here (the AVX-512 and AVX2 paths); elsewhere screen4_gemv's
    float64 torch path dequantizes the whole head on every call (1.6 s per step on qwen2.5-coder)."""
    ext = active()[1]
    return ext is not None and hasattr(ext, "screen4_gemv")


def screen4_pays() -> bool:
    """Whether the 4-bit screen is the certified head's fastest bound here (the default method's): compiled,
    on a path where it measured faster than the int8 screen (SCREEN4_DEFAULT_PATHS)."""
    return has_screen4_kernel() and kernel_name() in SCREEN4_DEFAULT_PATHS


def screen4_gemv(panels: Screen4Panels, hidden: torch.Tensor, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit screen with its low-rank correction (runtime.heads.screen4_bound), from its panels.

    hidden [B, d] float32, coords [B, k] float32 (the hidden rows' basis coordinates). Returns
    (center [B, V] float32 ~ <Q_i, h> + s_i <p_i, c_eff>, |r| [B] float64 of the int16 split (0 where
    the screen ran on float activations), c_eff [B, k] float32: the coordinates the center used).
    AVX-512 and AVX2 paths: integer dots against int16-split rows; elsewhere, or for a row the split does
    not take (non-finite or extreme values), float64 in torch.
    """
    hidden, coords = hidden.float().contiguous(), coords.float().contiguous()
    if not has_screen4_kernel() or panels.dim > INT16_SCREEN_MAX_COLS:
        return _screen4_torch(panels, hidden, coords), torch.zeros(hidden.shape[0], dtype=torch.float64), coords
    path, ext = active()
    vnni = path.startswith("avx512") and "avx512_vnni" in cpu_flags()
    center, remainder, effective = ext.screen4_gemv(panels.packed, panels.vocab, panels.group, hidden, coords, vnni)
    unsplit = ~torch.isfinite(remainder)  # [B]
    if bool(unsplit.any()):
        center[unsplit] = _screen4_torch(panels, hidden[unsplit], coords[unsplit])
        remainder[unsplit] = 0.0
        effective[unsplit] = coords[unsplit]
    return center, remainder, effective


def _screen4_torch(panels: Screen4Panels, hidden: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Reference 4-bit screen in float64 (row chunks), rounded to float32 at the end: [B, V]."""
    V, G, group = panels.vocab, panels.groups, panels.group
    h64, c64 = hidden.double(), coords.double()
    out = torch.empty(hidden.shape[0], V, dtype=torch.float32)
    chunk = 16384
    for start in range(0, V, chunk):
        stop = min(V, start + chunk)
        q, scales, mins, corr, corr_scale = panels.rows(start, stop)
        q = q.double().view(-1, G, group)  # [c, G, n]
        weight = (q * scales.double()[..., None] + mins.double()[..., None]).view(q.shape[0], -1)  # [c, d], exact
        correction = corr.double() * corr_scale.double()[:, None]  # [c, k]
        out[:, start:stop] = (h64 @ weight.T + c64 @ correction.T).float()
    return out


def screen_radius(
    center: torch.Tensor,
    coefficients: torch.Tensor,
    hidden_norm: float,
    slack: float,
    qrow_norms: torch.Tensor | None = None,
    remainder_norm: float = 0.0,
) -> torch.Tensor:
    """The screening radius [V] screen_select's kernel computes: base + slack (|center| + base), with
    base = c_i |h| (+ |Q(W_i)| |r| when qrow_norms is given: the int16 screen's remainder term)."""
    base = coefficients * hidden_norm
    if qrow_norms is not None:
        base = base + qrow_norms * remainder_norm
    return base + slack * (center.abs() + base)


def screen_select(
    center: torch.Tensor,
    coefficients: torch.Tensor,
    hidden_norm: float,
    slack: float,
    temperature: float,
    noise: torch.Tensor | None,
    k: int,
    qrow_norms: torch.Tensor | None = None,
    remainder_norm: float = 0.0,
) -> torch.Tensor:
    """Candidate ids [n] of one screened row: upper bound >= the k-th best lower bound.

    center, coefficients, noise, qrow_norms: [V] float32; the radius is screen_radius's; bounds are
    divided by the temperature (when > 0) and shifted by the noise.
    """
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    ext = active()[1]
    if ext is not None and hasattr(ext, "screen_select"):  # the AVX-512 and AVX2 paths
        empty = torch.empty(0, dtype=torch.float32)
        return ext.screen_select(
            center, coefficients, hidden_norm, empty if qrow_norms is None else qrow_norms, remainder_norm,
            slack, inv_t, empty if noise is None else noise, k,
        )
    radius = screen_radius(center, coefficients, hidden_norm, slack, qrow_norms, remainder_norm)
    lower, upper = (center - radius) * inv_t, (center + radius) * inv_t
    if noise is not None:
        lower, upper = lower + noise, upper + noise
    return torch.nonzero(upper >= torch.topk(lower, k).values[-1]).flatten()


__all__ = [
    "SKINNY_MAX_ROWS",
    "SUPPORTED_GGML_TYPES",
    "QuantMatrix",
    "attend",
    "dequantize",
    "kernel_name",
    "layer_plan",
    "linear",
    "prepare_qkv",
    "quant_linear",
    "quant_linear_parts",
    "rms_norm",
    "screen_gemv",
    "Screen4Panels",
    "has_screen4_kernel",
    "screen4_pays",
    "pack_screen4",
    "screen4_gemv",
    "screen_gemv_int16",
    "screen_radius",
    "screen_select",
    "decode_threads",
    "decoding_threads",
    "set_decoding_threads",
    "set_kernel_threads",
    "torch_threads",
    "take_rows",
    "thread_stats",
    "threads_restored",
    "unpack_int4",
]
