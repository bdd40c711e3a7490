"""How much of the vocabulary a lower-bit screen of the head leaves to recompute (a screen cascade's cost).

A screen is a copy Q(W) of the head W [V, d] with b-bit weights in groups of g (round to nearest,
symmetric like ggml's `_0` types or with a minimum like the `_1` ones; `row`: one scale per row).
Its logits a_i = <Q(W_i), h> carry the screening bound's sound radius c_i |h| (runtime.heads.
screen_bound: c_i = |W_i - Q(W_i)| + gamma_{d+2} (|Q(W_i)| + |W_i|)), and greedy decoding must
recompute exactly every token whose upper bound reaches the best lower bound. On real hidden
states this measures that candidate fraction per format, beside the bytes per weight the screen
would stream: a cascade (a cheap screen, then the exact rows of the survivors) pays only when
both are small.
"""

from __future__ import annotations

import torch

from runtime.heads.screen_bound import screen_coefficients

# name -> (bits, group (None: the whole row), affine: a minimum per group as well as a scale)
FORMATS = {
    "q4_0": (4, 32, False),
    "q4_1": (4, 32, True),
    "q4_1/16": (4, 16, True),
    "q5_1": (5, 32, True),
    "q6_1": (6, 32, True),
    "q8_row": (8, None, False),
}


def fake_quantize(weight: torch.Tensor, bits: int, group: int | None, affine: bool) -> torch.Tensor:
    """Q(W) [V, d] in float32: W rounded to `bits`-bit codes per group of `group` columns."""
    rows, cols = weight.shape
    g = cols if group is None else group
    if cols % g:
        raise ValueError(f"a group of {g} does not divide rows of {cols}")
    w = weight.double().reshape(rows, cols // g, g)  # [V, G, g]
    if affine:
        low = w.amin(-1, keepdim=True)
        scale = (w.amax(-1, keepdim=True) - low) / (2**bits - 1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((w - low) / scale) * scale + low
    else:
        top = 2 ** (bits - 1) - 1
        scale = w.abs().amax(-1, keepdim=True) / top
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale).clamp(-top - 1, top) * scale
    return q.reshape(rows, cols).float()


def bytes_per_weight(bits: int, group: int | None, affine: bool, cols: int) -> float:
    """What the screen streams per weight: the codes plus an fp16 scale (and minimum) per group."""
    g = cols if group is None else group
    return bits / 8 + (4 if affine else 2) / g


def greedy_candidates(weight: torch.Tensor, quantized: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] bool: the tokens greedy decoding must recompute after screening hidden [B, d] with Q(W);
    also the radius coefficients c_i [V]."""
    coef = screen_coefficients((weight.double() - quantized.double()).norm(dim=1), quantized.double().norm(dim=1),
                               weight.double().norm(dim=1), weight.shape[1]).double()  # [V]
    center = (hidden @ quantized.T).double()  # [B, V]
    radius = coef[None] * hidden.double().norm(dim=1, keepdim=True)  # [B, V]
    best_lower = (center - radius).amax(1, keepdim=True)  # [B, 1]
    return (center + radius) >= best_lower, coef


def candidate_fractions(weight: torch.Tensor, hidden: torch.Tensor, formats: list[str]) -> list[dict]:
    """Per format, the share of the vocabulary greedy decoding recomputes on hidden [B, d] (mean, p90, max)."""
    vocab, d = weight.shape
    rows = []
    for name in formats:
        bits, group, affine = FORMATS[name]
        candidates, coef = greedy_candidates(weight, fake_quantize(weight, bits, group, affine), hidden)  # [B, V], [V]
        open_share = candidates.double().sum(1) / vocab  # [B]
        rows.append({"format": name, "bits": bits, "group": group or d, "bytes_per_weight": bytes_per_weight(bits, group, affine, d),
                     "relative_error": float(coef.mean() / weight.double().norm(dim=1).mean()),
                     "candidates_mean": float(open_share.mean()), "candidates_p90": float(open_share.quantile(0.9)),
                     "candidates_max": float(open_share.max())})
    return rows
