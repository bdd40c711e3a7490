"""The 4-bit screening bound: a 4-bit copy of the head, its projection on a basis, and a sound radius.

Stage `screen4` (prep.screen4) holds Q_i (4-bit codes; per group of 32 or 64 columns a float16 minimum
and a step D_i s_ig), a basis U [d, k] of the hidden states and B^_i ~ B_i = U^T W_i (float16). For a
hidden row h with coordinates c = fl(U^T h) and residual r_U = h - U c, the residual is rounded to int8
values a times a power of two u, r_U = u a + r_s, and the kernel (runtime.kernels.screen4_gemv)
computes y_i ~ u <Q_i, a> + <B^_i, c>. With E_i = W_i - Q_i:

    <W_i, h> = <B_i, c> + <W_i, r_U> = <B^_i, c> + <B_i - B^_i, c> + <Q_i, u a> + <Q_i, r_s> + <E_i, r_U>

exactly, so, with the float32 roundings bounded in gamma terms,

    |fl(<W_i, h>) - y_i| <= |E_i| |r_U| + |Q_i| |r_s| + |B_i - B^_i| |c| + gamma_{d+2} |W_i| |h|
                            + gamma_m ((|S_i| + |M_i|) |u a| + |B^_i| |c|)

(S_i: the scaled codes, M_i: the minimums over all d columns, m = G + k + 16 roundings per lane, and
|u a| <= |r_U| + |r_s|). U need not be orthonormal for this; a good U only makes |r_U| small (~0.7 |h|
at k = 32 on the packaged models), and taking the top directions out of h also takes out its outlier
channels, so int8 holds the residual to ~1.5 % (|r_s| / |r_U|, against ~3 % for h itself). The
selection kernel takes two terms: |c| <= g |h| folds into the |h| term (g = |U|_2 + gamma_d |U|_F), and
|Q_i| |r_s| into |E_i| |r_U| through kappa: the remainder coefficient max(|E_i| + rho_i, (|Q_i| +
rho_i) / kappa) times |r_U| + kappa |r_s| is at least both (rho_i = gamma_m (|S_i| + |M_i|)); kappa is
the median of the rows' (|Q_i| + rho_i) / (|E_i| + rho_i), so most rows pay neither term twice.
"""

from __future__ import annotations

import torch

from artifacts.schema import SCREEN4_ROW_NORMS
from runtime.heads.screen_bound import ScreenBound, ScreenState
from runtime.kernels import kernel_name, screen4_gemv, screen4_reference
from runtime.numerics import FLOAT64_SLACK, dot_rounding_gamma, round_up_to_float32

# The residual's int8 rounding takes rows with max |r_U| in this range (a power-of-two unit that
# keeps every float32 product of the kernel normal); other rows are screened in float64.
_RESIDUAL_RANGE = (2.0**-60, 2.0**60)


class Screen4Bound(ScreenBound):
    """Per-token intervals from the 4-bit screen; candidates are recomputed exactly (ScreenBound's selection)."""

    name = "screen4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict) -> None:
        self.weight = weight  # [V, d] the exact head (float32 or a QuantMatrix)
        self.bias = bias  # [V] or None
        self.codes = tensors["codes"].contiguous()  # [V, d/2] uint8
        self.multiples = tensors["multiples"].contiguous()  # [V, G] uint8
        self.row_step = tensors["row_step"].float().contiguous()  # [V]
        self.mins = tensors["mins"].contiguous()  # [V, G] float16
        self.projection = tensors["projection"].contiguous()  # [V, k] float16
        self.basis = tensors["basis"].float().contiguous()  # [d, k]
        self.basis64 = self.basis.double()
        d, k = self.basis.shape
        groups = d // 32  # at most: groups of 32 or 64 columns
        basis_frobenius = float(self.basis64.norm())
        coord_gain = (float(torch.linalg.matrix_norm(self.basis64, 2)) + dot_rounding_gamma(d) * basis_frobenius) * (1 + 1e-9)
        gamma_screen = dot_rounding_gamma(groups + k + 14)  # gamma_{G + k + 16}
        norm = {name: tensors[name].double() for name in SCREEN4_ROW_NORMS}
        rho = gamma_screen * (norm["code_norms"] + norm["min_norms"])  # [V]
        hidden_coef = (dot_rounding_gamma(d) * norm["row_norms"]
                       + (norm["projection_error_norms"] + gamma_screen * norm["projection_norms"]) * coord_gain)
        self.coefficients = round_up_to_float32(hidden_coef * (1 + FLOAT64_SLACK))  # [V] times |h|
        error, whole = norm["error_norms"] + rho, norm["qrow_norms"] + rho  # [V]
        self.kappa = float(torch.quantile((whole / error.clamp(min=1e-300)).clamp(1.0, 1e6), 0.5))
        self.remainder_coefficients = round_up_to_float32(torch.maximum(error, whole / self.kappa) * (1 + FLOAT64_SLACK))  # [V]
        self.basis_frobenius = basis_frobenius
        kernel_name()  # build / load the kernel now, not inside the first timed decode step

    @classmethod
    def from_stage(cls, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict) -> "Screen4Bound":
        """Build from the tensors of an artifact's `screen4` stage."""
        return cls(weight, bias, tensors)

    def prepare(self, hidden: torch.Tensor) -> ScreenState:
        """Screen a batch of hidden states [B, d]: centres, |h| and the remainder |r_U| + kappa |r_s|."""
        hidden = hidden.float()
        coords = hidden @ self.basis  # [B, k]
        h64, c64 = hidden.double(), coords.double()
        residual = h64 - c64 @ self.basis64.T  # [B, d] fl64(r_U)
        unit, rounded, fits = int8_rows(residual)  # [B], [B, d] int8, [B] bool
        tensors = (self.codes, self.multiples, self.row_step, self.mins, self.projection)
        center = screen4_gemv(*tensors, rounded, unit.float(), coords)  # [B, V]
        leftover = residual - rounded.double() * unit[:, None]  # [B, d] fl64(r_s)
        if not bool(fits.all()):  # rows the int8 rounding does not take: the residual as it is, r_s = 0
            center[~fits] = screen4_reference(*tensors, residual[~fits], torch.ones(int((~fits).sum())), coords[~fits])
            leftover[~fits] = 0.0
        if self.bias is not None:
            center = center + self.bias
        hidden_norm = h64.norm(dim=1)  # [B]
        # float64 rounding of r_U: per element <= gamma64_{k+1} (|h_j| + sum_k |U_jk c_k|); r_s adds one rounding
        rounding = FLOAT64_SLACK * (hidden_norm + self.basis_frobenius * c64.norm(dim=1))
        residual_norm = residual.norm(dim=1) * (1 + FLOAT64_SLACK) + rounding
        leftover_norm = leftover.norm(dim=1) * (1 + FLOAT64_SLACK) + rounding
        remainder = residual_norm + self.kappa * leftover_norm
        return ScreenState(hidden, center, hidden_norm * (1 + FLOAT64_SLACK), remainder, self.coefficients,
                           self.remainder_coefficients)


def int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [B, d] float64 -> (u [B] float64, a [B, d] int8, fits [B] bool): u a power of two with
    127 u / 2 <= max |row| < 127 u (up to the rounding of max / 127; a is clamped to +-127) and a = round(row / u);
    fits is False (u = 1, a = 0) for rows with a non-finite value or max |row| outside _RESIDUAL_RANGE."""
    amax = rows.abs().amax(dim=1)  # [B]
    low, high = _RESIDUAL_RANGE
    fits = torch.isfinite(rows).all(dim=1) & (amax >= low) & (amax <= high)
    _, exponent = torch.frexp(torch.where(fits, amax / 127, torch.ones_like(amax)))  # amax / 127 < 2^exponent
    unit = torch.where(fits, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))
    scaled = torch.where(fits[:, None], rows / unit[:, None], torch.zeros_like(rows))  # exact: a power of two
    return unit, torch.round(scaled).clamp(-127, 127).to(torch.int8), fits
