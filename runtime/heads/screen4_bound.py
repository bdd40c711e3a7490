"""The 4-bit screening bound: a 4-bit copy of the head, a low-rank correction, and a sound radius.

Stage `screen4` (prep.screen4) holds Q_i (4-bit codes, float16 scale and minimum per group of 32 or 64), a
basis U [d, k] of the hidden states and P^_i ~ U^T (W_i - Q_i) (int8, a float32 scale per row). For
a hidden row h with coordinates c = fl(U^T h), the kernel (runtime.kernels.screen4_gemv) splits
h = 2^e a + r_s (a int16) and computes y_i ~ <Q_i, 2^e a> + <P^_i, c_eff>. With r_U = h - U c_eff:

    <W_i, h> = <Q_i, 2^e a> + <Q_i, r_s> + <P_i, c_eff> + <W_i - Q_i, r_U>      (exactly)

so, with E_i = W_i - Q_i and the float32 roundings bounded in gamma terms,

    |fl(<W_i, h>) - y_i| <= |E_i| |r_U| + |Q_i| |r_s| + |P_i - P^_i| |c_eff|
                            + gamma_{d+2} |W_i| |h| + gamma_m ((|D_i| + |M_i|)(|h| + |r_s|) + |P^_i| |c_eff|)

(D_i: the scaled codes, M_i: the minimums over all d columns; m = 2 d/32 + k + 16 covers the
kernel's at most 2 d/32 + k + 1 roundings per row).
U need not be orthonormal for this; a good U only makes |r_U| small (~0.6 |h| at k = 32 on the
packaged models, while the correction moves the centre by most of <E_i, h>). Two terms reach the
selection kernel: |c_eff| <= g |h| folds into the |h| term (g = |U|_2 + gamma_d |U|_F), and
|Q_i| |r_s| into |E_i| |r_U| through kappa: the remainder coefficient max(|E_i|, (|Q_i| + rho_i) /
kappa) times |r_U| + kappa |r_s| is at least both (|r_s| is ~1e-4 |h|).
"""

from __future__ import annotations

import torch

from artifacts.schema import SCREEN4_ROW_NORMS
from runtime.common.numerics import FLOAT64_SLACK, dot_rounding_gamma, round_up_to_float32
from runtime.heads.screen_bound import MAX_OPEN_FRACTION, ScreenBound, ScreenState, open_budget
from runtime.kernels import kernel_name, pack_screen4, screen4_gemv

KAPPA = 64.0
# Batches of more hidden rows go to the int8 screen when there is one. Per hidden row both kernels
# spend one integer dot instruction per 32 weights; the 4-bit one streams fewer bytes but its wider
# radius leaves far more candidates to recompute exactly, which past two rows costs more than the
# bytes saved (docs/certified-head.md, "The 4-bit screen's row limit").
MAX_ROWS = 2


class Screen4Bound(ScreenBound):
    """Per-token intervals from the 4-bit screen; candidates are recomputed exactly (ScreenBound's selection)."""

    name = "screen4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict, wide: ScreenBound | None = None,
                 max_open_fraction: float = MAX_OPEN_FRACTION) -> None:
        self.wide = wide  # the int8 screen, for batches of more than MAX_ROWS rows (None: none)
        self.weight = weight  # [V, d] the exact head (float32 or a QuantMatrix)
        self.bias = bias  # [V] or None
        # codes [V, d/2] uint8, scales / mins [V, G] float16, corr [V, k] int8, corr_scale [V] in the kernel's panels
        self.panels = pack_screen4(tensors["codes"], tensors["scales"], tensors["mins"], tensors["corr"], tensors["corr_scale"])
        self.basis = tensors["basis"].float().contiguous()  # [d, k]
        self.basis64 = self.basis.double()
        d, k = self.basis.shape
        halves = d // 32  # the kernel's roundings per row: <= 2 per 32 columns, k + 1 for the correction
        basis_frobenius = float(self.basis64.norm())
        coord_gain = (float(torch.linalg.matrix_norm(self.basis64, 2)) + dot_rounding_gamma(d) * basis_frobenius) * (1 + 1e-9)
        gamma_screen = dot_rounding_gamma(2 * halves + k + 14)  # gamma_{2 d/32 + k + 16}
        norm = {name: tensors[name].double() for name in SCREEN4_ROW_NORMS}
        rho = gamma_screen * (norm["code_norms"] + norm["min_norms"])  # [V]
        hidden_coef = (dot_rounding_gamma(d) * norm["row_norms"] + rho
                       + (norm["corr_error_norms"] + gamma_screen * norm["corr_norms"]) * coord_gain)
        self.coefficients = round_up_to_float32(hidden_coef * (1 + FLOAT64_SLACK))  # [V] times |h|
        self.remainder_coefficients = round_up_to_float32(
            torch.maximum(norm["error_norms"], (norm["qrow_norms"] + rho) / KAPPA) * (1 + FLOAT64_SLACK))  # [V]
        self.basis_frobenius = basis_frobenius
        self.row_norms = tensors["row_norms"].float().contiguous()  # [V] |W_i|, rounded up
        self.max_open_tokens = open_budget(self.panels.vocab, max_open_fraction)  # candidates recomputed at most
        kernel_name()  # build / load the kernel now, not inside the first timed decode step

    @classmethod
    def from_stage(cls, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict, wide: ScreenBound | None = None,
                   max_open_fraction: float = MAX_OPEN_FRACTION) -> "Screen4Bound":
        """Build from the tensors of an artifact's `screen4` stage (and its int8 screen for wide batches)."""
        return cls(weight, bias, tensors, wide, max_open_fraction)

    def prepare(self, hidden: torch.Tensor) -> ScreenState:
        """Screen a batch of hidden states [B, d]: centres, |h| and the remainder |r_U| + kappa |r_s|
        (batches of more than MAX_ROWS rows through the int8 screen, when there is one)."""
        if self.wide is not None and hidden.shape[0] > MAX_ROWS:
            return self.wide.prepare(hidden)
        hidden = hidden.float()
        coords = hidden @ self.basis  # [B, k]
        center, split_remainder, coords_used = screen4_gemv(self.panels, hidden, coords)  # [B, V], [B], [B, k]
        if self.bias is not None:
            center = center + self.bias
        h64, c64 = hidden.double(), coords_used.double()
        hidden_norm = h64.norm(dim=1)  # [B]
        residual = (h64 - c64 @ self.basis64.T).norm(dim=1)  # [B] |r_U|
        # float64 rounding of r_U: per element <= gamma64_{k+1} (|h_j| + sum_k |U_jk c_k|)
        residual = residual * (1 + FLOAT64_SLACK) + FLOAT64_SLACK * (hidden_norm + self.basis_frobenius * c64.norm(dim=1))
        remainder = residual + KAPPA * split_remainder
        return ScreenState(hidden, center, hidden_norm * (1 + FLOAT64_SLACK), remainder, self.coefficients,
                           self.remainder_coefficients)
