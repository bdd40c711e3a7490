"""Stage `screen4`: a 4-bit copy of the LM head with a low-rank correction of its error, and per-row bounds.

Row i becomes Q_i = d_g q + m_g per group g of 32 or 64 columns (q in 0..15; d and m float16, like
ggml's Q4_1), 0.63 or 0.56 bytes per weight against the int8 screen's 1. Alone, its sound radius |W_i - Q_i| |h|
leaves a quarter of gemma3-270m's vocabulary to recompute. The correction takes most of that back:
final hidden states concentrate in a few directions, so with U [d, k], the top-k right singular
vectors of calibration hidden states (ShareGPT conversations of the train split), the error's
component in span(U) is stored (P_i = U^T (W_i - Q_i), int8 with a per-row scale) and added to the
screen's logit, and only the rest is bounded: |<W_i - Q_i, h - U c>| <= |W_i - Q_i| |h - U c|
(runtime.heads.screen4_bound). Every norm is computed in float64 and rounded up.
"""

from __future__ import annotations

import itertools
import math

import torch
from tqdm import tqdm

from prep.traces import corpus_texts
from runtime.text.data import split_of
from artifacts.schema import SCREEN4_ROW_NORMS
from runtime.common.numerics import FLOAT64_SLACK, dot_rounding_gamma, round_up_to_float32

# Rank, group and calibration texts come from the recipe's [screen4] section (prep.recipes), with the measurements.
GROUPS = (32, 64)  # columns per scale and minimum
CALIBRATION_TOKENS = 256
_CHUNK = 16384
_FLOAT16_MAX = 65504.0


def check_screen4_shape(d: int, rank: int, group: int) -> None:
    """Refuse a hidden size, rank or group the 4-bit screen kernel cannot take (before anything is built)."""
    if group not in GROUPS:
        raise ValueError(f"--group must be one of {', '.join(map(str, GROUPS))}, got {group}")
    if d % 64:
        raise ValueError(f"the 4-bit screen needs a hidden size divisible by 64, this model has {d}; use the int8 screen (prep cluster)")
    if rank < 16 or rank % 16 or rank > d:
        raise ValueError(f"--rank must be a multiple of 16 between 16 and the hidden size {d}, got {rank}")


@torch.inference_mode()
def calibration_hidden(target, tokenizer, texts: int, tokens: int = CALIBRATION_TOKENS,
                       progress: bool = False) -> torch.Tensor:
    """Final-normed hidden states [N, d] float64 of the first `texts` ShareGPT train-split conversations."""
    chosen = (text for index, text in enumerate(corpus_texts("sharegpt", tokenizer)) if text and split_of("sharegpt", index) == "train")
    states = []
    for text in tqdm(list(itertools.islice(chosen, texts)), desc="calibration hidden states", disable=not progress, unit="text"):
        ids = torch.tensor(tokenizer(text)["input_ids"][:tokens])
        states.append(target.forward(ids, target.new_cache()).double())  # [T, d]
    return torch.cat(states)


def hidden_basis(hidden: torch.Tensor, rank: int) -> torch.Tensor:
    """U [d, rank] float32: the top right singular vectors of hidden [N, d] (uncentered)."""
    return torch.linalg.svd(hidden.double(), full_matrices=False).Vh[:rank].T.float().contiguous()


def quantize_int4(weight: torch.Tensor, basis: torch.Tensor, group: int, progress: bool = False) -> dict[str, torch.Tensor]:
    """The `screen4` tensors for head rows weight [V, d] and basis U [d, k].

    codes [V, d/2] uint8 (byte j of group g: q[g n + j] | q[g n + n/2 + j] << 4 for groups of n columns, ggml's
    Q4_1 order at n = 32), scales / mins [V, d/n] float16, corr [V, k] int8 and corr_scale [V] float32 (P_i ~ corr_scale_i corr_i), basis [d, k]
    float32, and per row, float32 rounded up from float64: error_norms |W_i - Q_i|, qrow_norms |Q_i|,
    row_norms |W_i|, code_norms |d q| (the scaled codes), min_norms |m| over all d columns, corr_norms
    |corr_scale_i corr_i|, corr_error_norms |P_i - corr_scale_i corr_i| (float64 rounding of P included).
    """
    V, d = weight.shape
    k = basis.shape[1]
    check_screen4_shape(d, k, group)
    G = d // group
    if not bool(torch.isfinite(weight).all()) or float(weight.abs().max()) > _FLOAT16_MAX / 2:
        raise ValueError("the head has weights outside the float16 range the 4-bit screen stores; use the int8 screen (prep cluster)")
    u64 = basis.double()
    basis_frobenius = float(u64.norm())
    out = {"codes": torch.empty(V, d // 2, dtype=torch.uint8), "scales": torch.empty(V, G, dtype=torch.float16),
           "mins": torch.empty(V, G, dtype=torch.float16), "corr": torch.empty(V, k, dtype=torch.int8),
           "corr_scale": torch.empty(V, dtype=torch.float32)}
    norms = {name: torch.empty(V, dtype=torch.float32) for name in SCREEN4_ROW_NORMS}
    for start in tqdm(range(0, V, _CHUNK), desc="4-bit screen", disable=not progress, unit="chunk"):
        rows = slice(start, start + _CHUNK)
        exact = weight[rows].double()  # [c, d]
        groups = exact.view(-1, G, group)  # [c, G, n]
        low, high = groups.amin(-1), groups.amax(-1)  # [c, G]
        scale16, min16 = ((high - low) / 15).to(torch.float16), low.to(torch.float16)
        scale, minimum = scale16.double()[..., None], min16.double()[..., None]  # what the kernel multiplies
        q = torch.where(scale > 0, torch.round((groups - minimum) / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(0, 15)
        scaled_codes = (q * scale).view(-1, d)  # [c, d], exact in float64 (11-bit scale x 4-bit code)
        quantized = scaled_codes + minimum.expand_as(groups).reshape(-1, d)  # [c, d]
        error = exact - quantized
        projected = error @ u64  # [c, k]
        corr_scale = (projected.abs().amax(1) / 127).float()  # [c]
        safe_scale = torch.where(corr_scale > 0, corr_scale, torch.ones_like(corr_scale)).double()[:, None]
        corr = torch.round(projected / safe_scale).clamp(-127, 127)
        stored = corr * corr_scale.double()[:, None]  # [c, k]
        # |P - fl64(U^T E)| <= gamma64_d |U|_F |E|: float64 dot products of d terms
        projection_rounding = dot_rounding_gamma(d, 2.0**-53) * basis_frobenius * error.norm(dim=1)
        q8 = q.to(torch.uint8)
        out["codes"][rows] = (q8[..., : group // 2] | (q8[..., group // 2 :] << 4)).view(-1, d // 2)
        out["scales"][rows], out["mins"][rows] = scale16, min16
        out["corr"][rows], out["corr_scale"][rows] = corr.to(torch.int8), corr_scale
        found = {"error_norms": error.norm(dim=1), "qrow_norms": quantized.norm(dim=1), "row_norms": exact.norm(dim=1),
                 "code_norms": scaled_codes.norm(dim=1), "min_norms": min16.double().norm(dim=1) * math.sqrt(group),
                 "corr_norms": stored.norm(dim=1),
                 "corr_error_norms": (projected - stored).norm(dim=1) + projection_rounding}
        for name, value in found.items():
            norms[name][rows] = round_up_to_float32(value * (1 + FLOAT64_SLACK))
    return {**out, "basis": basis.float().contiguous(), **norms}


def build_screen4(weight: torch.Tensor, hidden: torch.Tensor, rank: int, group: int, progress: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Stage `screen4` from the head [V, d] and calibration hidden states [N, d]: (tensors, params)."""
    check_screen4_shape(weight.shape[1], rank, group)
    tensors = quantize_int4(weight, hidden_basis(hidden, rank), group, progress)
    params = {"bits": 4, "group_size": group, "rank": rank, "calibration_positions": int(hidden.shape[0]),
              "mean_relative_error": float(tensors["error_norms"].double().mean() / tensors["row_norms"].double().mean())}
    return tensors, params
