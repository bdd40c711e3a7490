"""Numerics shared by prep and the runtime: int8 quantization and sound float32 rounding bounds.

One definition each: prep's screening stage, the int8 self-drafter and the certified heads all
quantize and bound through these, so what prep stores is what the runtime assumes.
"""

from __future__ import annotations

import torch


def quantize_groups_int8(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of rows [n, d] in column groups of `group` (d = one scale per row).

    Returns the quantized values [n, d] (integers in -127..127, held in float32) and the scales
    [n, d / group] (float32, max |w| / 127 per group, at least the smallest normal float32 so an
    all-zero group stays exactly zero).
    """
    n, d = rows.shape
    grouped = rows.float().view(n, d // group, group)  # [n, G, g]
    scales = (grouped.abs().amax(dim=2) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [n, G]
    q = torch.round(grouped / scales[..., None]).clamp(-127, 127)  # [n, G, g]
    return q.view(n, d), scales


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 copy of weight [out, in]: qweight [out, in] int8 and scales [out] float32."""
    q, scales = quantize_groups_int8(weight, weight.shape[1])
    return q.to(torch.int8).contiguous(), scales[:, 0].contiguous()


# Relative slack on a norm or sum computed in float64 over d <= 8192 terms (d 2^-53 < 1e-12).
FLOAT64_SLACK = 1e-12


def dot_rounding_gamma(d: int, unit_roundoff: float = 2.0**-24) -> float:
    """Higham's gamma_n for a dot product of length d (n = d + 2 covers the scale multiply); float32 unless
    unit_roundoff says otherwise (2^-53: float64)."""
    nu = (d + 2) * unit_roundoff
    return nu / (1 - nu)


def round_up_to_float32(values: torch.Tensor) -> torch.Tensor:
    """Float64 values [n] as the smallest float32 values that are >= them."""
    rounded = values.float()
    below = rounded.double() < values
    return torch.where(below, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)
