"""Stage `screen`: an int8 copy of the LM head and a per-row bound on its error (float64, rounded up)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from runtime.common.numerics import quantize_groups_int8, round_up_to_float32

# Group sizes measured for every model; the kernel handles any multiple of 16 dividing d.
CANDIDATE_GROUPS = (0, 64, 32)  # 0 = one scale per row
# Per-row scales screen fastest (one scale per row to apply; docs/certified-head.md has the timing), and
# a per-row error of a few percent of the row norm still leaves only a handful of candidates to
# recompute. A grouped layout is chosen only when per-row error is large and grouping halves it.
MAX_PER_ROW_RELATIVE_ERROR = 0.05
GROUPED_ERROR_GAIN = 2.0
_CHUNK = 16384


def check_group_size(group: int, d: int) -> None:
    """Refuse a screening group size the kernel cannot take (before any stage is built)."""
    if d % group or group % 16:
        raise ValueError(f"group size {group} must divide the hidden size {d} and be a multiple of 16")


def quantize_int8(weight: torch.Tensor, group_size: int, progress: bool = False) -> dict[str, torch.Tensor]:
    """Symmetric int8 quantization of the head rows [V, d]; group_size 0 = one scale per row.

    Returns qweight [V, d] int8, scales [V, G] float32, and per row (float32, rounded up):
    error_norms |W_i - Q(W_i)|, qrow_norms |Q(W_i)|, row_norms |W_i|, all computed in float64.
    """
    V, d = weight.shape
    group = group_size or d
    check_group_size(group, d)
    qweight = torch.empty(V, d, dtype=torch.int8)
    scales = torch.empty(V, d // group, dtype=torch.float32)
    norms = {name: torch.empty(V, dtype=torch.float32) for name in ("error_norms", "qrow_norms", "row_norms")}
    for start in tqdm(range(0, V, _CHUNK), desc=f"int8 screen (group {group})", disable=not progress, unit="chunk"):
        rows = weight[start : start + _CHUNK].float()  # [c, d]
        q, scale = quantize_groups_int8(rows, group)  # [c, d], [c, G]
        dequant = (q.double().view(-1, d // group, group) * scale.double()[..., None]).view(-1, d)  # what the kernel multiplies, exactly
        exact = rows.double()
        qweight[start : start + _CHUNK] = q.to(torch.int8)
        scales[start : start + _CHUNK] = scale
        norms["error_norms"][start : start + _CHUNK] = round_up_to_float32((exact - dequant).norm(dim=1))
        norms["qrow_norms"][start : start + _CHUNK] = round_up_to_float32(dequant.norm(dim=1))
        norms["row_norms"][start : start + _CHUNK] = round_up_to_float32(exact.norm(dim=1))
    return {"qweight": qweight, "scales": scales, **norms}


def choose_group_size(weight: torch.Tensor) -> tuple[int, dict[str, float]]:
    """Measure the mean row error of each layout on a sample of rows and pick one (0 = per row)."""
    sample = weight[torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))[:_CHUNK]]
    errors = {}
    for group in CANDIDATE_GROUPS:
        if group and weight.shape[1] % group:
            continue
        errors[group] = float(quantize_int8(sample, group)["error_norms"].double().mean())
    row_norm = float(sample.double().norm(dim=1).mean())
    best_grouped = min((g for g in errors if g), key=lambda g: errors[g], default=None)
    chosen = 0
    if (
        best_grouped is not None
        and errors[0] > MAX_PER_ROW_RELATIVE_ERROR * row_norm
        and errors[0] > GROUPED_ERROR_GAIN * errors[best_grouped]
    ):
        chosen = best_grouped
    measured = {f"mean_error_norm_group_{g or 'row'}": e for g, e in errors.items()}
    return chosen, {**measured, "mean_row_norm": row_norm}


def build_screen(weight: torch.Tensor, group_size: int | None = None, progress: bool = True):
    """Tensors and params of stage `screen`; group_size None = measure and choose."""
    measured: dict[str, float] = {}
    if group_size is None:
        group_size, measured = choose_group_size(weight)
    tensors = quantize_int8(weight, group_size, progress)
    params = {
        "scheme": "int8_symmetric",
        "group_size": group_size or weight.shape[1],
        "per_row": group_size == 0,
        "mean_error_norm": float(tensors["error_norms"].double().mean()),
        **measured,
    }
    return tensors, params
